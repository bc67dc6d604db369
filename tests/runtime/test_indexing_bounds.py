"""Out-of-range indices are errors in every indexing op, on both backends, as they are in
onnxruntime: -11 on an axis of 10 must not wrap around to row 9 (NumPy's own indexing
would), and 10 must not read past the end."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.errors import KernelError

_ort = ort.capi.onnxruntime_pybind11_state
ORT_ERRORS = (_ort.Fail, _ort.InvalidArgument, _ort.RuntimeException)
_X = helper.make_tensor_value_info("x", TensorProto.FLOAT, [10, 1])
_I = helper.make_tensor_value_info("i", TensorProto.INT64, [1, 1])
_U = helper.make_tensor_value_info("u", TensorProto.FLOAT, [1, 1])
CASES = {
    "Gather": (["x", "i"], {"axis": 0}),
    "GatherElements": (["x", "i"], {"axis": 0}),
    "GatherND": (["x", "i"], {}),
    "ScatterElements": (["x", "i", "u"], {"axis": 0}),
    "ScatterND": (["x", "i", "u"], {}),
}


def _model(op: str):
    inputs, attrs = CASES[op]
    graph = helper.make_graph(
        [helper.make_node(op, inputs, ["y"], **attrs)], op, [_X, _I, _U][:len(inputs)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("op", sorted(CASES))
@pytest.mark.parametrize("index", [-11, 10, -10])
def test_indices_outside_the_axis_are_kernel_errors_like_onnxruntime(op, index, backend):
    proto = _model(op)
    feed = {"x": np.arange(10, dtype=np.float32).reshape(10, 1),
            "i": np.array([[index]], np.int64), "u": np.full((1, 1), 5, np.float32)}
    feed = {k: feed[k] for k in CASES[op][0]}
    ref = ort.InferenceSession(proto.SerializeToString())
    sess = kiln.InferenceSession(proto, backend=backend)
    if index == -10:  # in range: counts from the back, both agree
        np.testing.assert_array_equal(sess.run(None, feed)[0], ref.run(None, feed)[0])
        return
    with pytest.raises(ORT_ERRORS):
        ref.run(None, feed)
    with pytest.raises(KernelError, match=op):
        sess.run(None, feed)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("index", [-11, 10, -10, -1, 3])
def test_a_constant_scalar_gather_index_is_checked_like_onnxruntime(index, backend):
    """Shape -> Gather(constant scalar) is how exporters read one dim; the torch backend
    runs it as one select, which must still count from the back and refuse out-of-range."""
    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "k"], ["y"], axis=1)], "g", [_X],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("k", TensorProto.INT64, [], [index])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 16)])
    proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 10
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 2
    feed = {"x": np.arange(20, dtype=np.float32).reshape(2, 10)}
    ref = ort.InferenceSession(proto.SerializeToString())
    if -10 <= index < 10:
        want = ref.run(None, feed)[0]
        got = kiln.InferenceSession(proto, backend=backend, optimize=False).run(None, feed)[0]
        np.testing.assert_array_equal(got, want)
        return
    with pytest.raises(ORT_ERRORS):
        ref.run(None, feed)
    with pytest.raises(KernelError, match="Gather"):
        kiln.InferenceSession(proto, backend=backend, optimize=False).run(None, feed)
