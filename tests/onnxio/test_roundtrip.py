"""Import -> export keeps what a model computes: onnxruntime gives the same outputs on
the re-exported model as on the original."""

import glob
import os

import numpy as np
import onnx
import pytest

import kiln
from conftest import LIGHT_DIR, ONNX_DATA, ort_run
from kiln.onnxio import to_proto


def _random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


_MODELS = sorted(glob.glob(os.path.join(LIGHT_DIR, "*.onnx"))) + sorted(
    glob.glob(os.path.join(ONNX_DATA, "pytorch-converted", "*", "model.onnx")))[:20]


@pytest.mark.parametrize("path", _MODELS, ids=lambda p: p.split(os.sep)[-2 if "model.onnx" in p
                                                                        else -1])
def test_export_roundtrip_matches_onnxruntime(path):
    original = onnx.load(path)
    exported = to_proto(kiln.load(path))
    onnx.checker.check_model(exported)
    feeds = _random_feeds(original)
    try:
        want = ort_run(original, feeds)
    except Exception as e:  # noqa: BLE001 - the oracle itself lacks some old op versions
        pytest.skip(f"onnxruntime cannot run the original model: {str(e)[:120]}")
    got = ort_run(exported, feeds)
    for w, g in zip(want, got):
        np.testing.assert_array_equal(w, g)


def test_save_external_data_roundtrip(tmp_path, mlp_model):
    model = kiln.load(mlp_model)
    path = kiln.save(model, tmp_path / "m.onnx", external_data=True, size_threshold=0)
    assert (tmp_path / "m.onnx.data").exists()
    feeds = {"x": np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)}
    np.testing.assert_array_equal(ort_run(str(path), feeds)[0], ort_run(mlp_model, feeds)[0])
    reloaded = kiln.load(path)
    w1 = reloaded.graph.initializers["w1"].const
    assert isinstance(w1, np.memmap), "external weights should be memory-mapped, not copied"
    np.testing.assert_array_equal(w1, onnx.numpy_helper.to_array(mlp_model.graph.initializer[0]))


def test_subgraphs_and_functions_survive_export():
    from onnx import TensorProto, helper
    f = helper.make_function("local", "AddTwice", ["a", "b"], ["c"],
                             [helper.make_node("Add", ["a", "b"], ["t"]),
                              helper.make_node("Add", ["t", "b"], ["c"])],
                             [helper.make_opsetid("", 17)])
    then_g = helper.make_graph([helper.make_node("AddTwice", ["x", "x"], ["y1"], domain="local")],
                               "then", [], [helper.make_tensor_value_info("y1", TensorProto.FLOAT,
                                                                          [2])])
    else_g = helper.make_graph([helper.make_node("Neg", ["x"], ["y2"])], "else", [],
                               [helper.make_tensor_value_info("y2", TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    m = helper.make_model(graph, functions=[f], opset_imports=[helper.make_opsetid("", 17),
                                                               helper.make_opsetid("local", 1)])
    m.ir_version = 8
    exported = to_proto(kiln.load(m))
    onnx.checker.check_model(exported)
    x = np.array([1.0, -2.0], np.float32)
    for c in (True, False):
        feeds = {"c": np.array(c), "x": x}
        np.testing.assert_array_equal(ort_run(exported, feeds)[0], ort_run(m, feeds)[0])
        np.testing.assert_array_equal(kiln.InferenceSession(m).run(None, feeds)[0],
                                      ort_run(m, feeds)[0])
