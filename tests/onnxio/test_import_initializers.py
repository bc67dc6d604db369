"""Initializers read straight from the file into their arrays (the protobuf is parsed
without their bytes) equal what onnx's own parser and numpy_helper make of the same file,
for every storage layout; and a file does not sit in memory several times over."""

from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import make_model
from kiln.errors import ModelLoadError


def _tensors() -> list[TensorProto]:
    rng = np.random.default_rng(0)
    arrays = {
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "f16": rng.standard_normal(5).astype(np.float16),
        "f64": rng.standard_normal(2),
        "i64": np.arange(-3, 3, dtype=np.int64),
        "u8": np.arange(7, dtype=np.uint8),
        "b": np.array([True, False, True]),
        "c64": np.array([1 + 2j, -3j], np.complex64),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(2.5, np.float32),
    }
    out = [numpy_helper.from_array(a, k) for k, a in arrays.items()]
    out.append(helper.make_tensor("listed", TensorProto.FLOAT, [2], [1.5, -2.0]))  # float_data
    out.append(helper.make_tensor("bf16", TensorProto.BFLOAT16, [3], np.array(
        [1.0, -2.5, 3.0], ml_dtypes.bfloat16).view(np.uint16).tobytes(), raw=True))
    out.append(helper.make_tensor("i4", TensorProto.INT4, [3], [1, -2, 7]))  # packed nibbles
    out.append(helper.make_tensor("s", TensorProto.STRING, [2], [b"ab", b"c"]))
    return out


def _model(inits: list[TensorProto]) -> onnx.ModelProto:
    # each initializer is a graph output through Identity, so nothing is unused
    nodes = [helper.make_node("Identity", [t.name], [f"out_{t.name}"]) for t in inits]
    outs = [helper.make_tensor_value_info(f"out_{t.name}", t.data_type, None) for t in inits]
    return make_model(nodes, [], outs, inits, opset=21)


def _check(m: kiln.ir.Model, proto: onnx.ModelProto) -> None:
    inits = m.graph.initializers
    assert list(inits) == [t.name for t in proto.graph.initializer]
    for t in proto.graph.initializer:
        want = numpy_helper.to_array(t)
        got = inits[t.name].const
        assert got.dtype == want.dtype and got.shape == want.shape, t.name
        assert got.tobytes() == want.tobytes() if want.dtype != object else \
            list(got.reshape(-1)) == [s for s in want.reshape(-1)], t.name


def test_every_layout_from_a_file_and_from_bytes(tmp_path):
    proto = _model(_tensors())
    path = tmp_path / "m.onnx"
    path.write_bytes(proto.SerializeToString())
    _check(kiln.load(path), proto)
    _check(kiln.load(proto.SerializeToString()), proto)


def test_a_graph_split_over_two_fields_is_merged_as_protobuf_does(tmp_path):
    """Serialized messages concatenate into their merge: initializers of both pieces."""
    first, second = _tensors()[:4], _tensors()[4:7]
    head = _model(first)
    extra = onnx.ModelProto(graph=onnx.GraphProto(initializer=second))
    data = head.SerializeToString() + extra.SerializeToString()
    merged = onnx.ModelProto()
    merged.ParseFromString(data)
    assert len(merged.graph.initializer) == 7
    path = tmp_path / "m.onnx"
    path.write_bytes(data)
    _check(kiln.load(path), merged)


def test_a_subgraph_initializer_and_a_session_run(tmp_path):
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    then = helper.make_graph([helper.make_node("Add", ["x", "k"], ["a"])], "then", [],
                             [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])],
                             [numpy_helper.from_array(np.full(3, 10, np.float32), "k")])
    other = helper.make_graph([helper.make_node("Mul", ["x", "w"], ["b"])], "else", [],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 3])])
    m = make_model([helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                    helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                   [numpy_helper.from_array(w, "w")])
    path = tmp_path / "m.onnx"
    path.write_bytes(m.SerializeToString())
    sess = kiln.InferenceSession(str(path))
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x, "c": np.array(True)})[0], x + 10)
    np.testing.assert_array_equal(sess.run(None, {"x": x, "c": np.array(False)})[0], x * w)


@pytest.mark.parametrize("cut", [1, 7, 100, -3])
def test_a_truncated_file_is_a_load_error(tmp_path, cut):
    data = _model(_tensors()).SerializeToString()
    path = tmp_path / "m.onnx"
    path.write_bytes(data[:cut] if cut > 0 else data[:cut])
    with pytest.raises(ModelLoadError, match="not a valid ONNX model"):
        kiln.load(path)


def test_a_tensor_whose_raw_data_does_not_match_its_dims_is_a_load_error(tmp_path):
    t = numpy_helper.from_array(np.zeros(4, np.float32), "w")
    t.dims[:] = [5]
    path = tmp_path / "m.onnx"
    path.write_bytes(_model([t]).SerializeToString())
    with pytest.raises(ModelLoadError, match="'w'"):
        kiln.load(path)


PEAK = r"""
import sys
import kiln
def status(key):  # this process's own memory (ru_maxrss would count the parent's, from fork)
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith(key))
before = status("VmRSS:")
m = kiln.load(sys.argv[1])
print((status("VmHWM:") - before) * 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_loading_a_file_holds_its_weights_about_once(tmp_path):
    """64 MB of weights: the file's bytes, protobuf's copy and the arrays used to coexist
    (3x); now the arrays are the only copy (the rest is interpreter noise)."""
    w = np.random.default_rng(0).standard_normal(16 * 2**20).astype(np.float32)
    path = tmp_path / "big.onnx"
    path.write_bytes(_model([numpy_helper.from_array(w, "w")]).SerializeToString())
    added = int(subprocess.run([sys.executable, "-c", PEAK, str(path)], check=True,
                               capture_output=True, text=True).stdout)
    assert w.nbytes * 0.9 < added < w.nbytes * 1.4, added / w.nbytes
