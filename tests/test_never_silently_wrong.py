"""Issue 39, "never silently wrong": what a file declares never changes a result, and values
the spec does not define are refused at load. Each test is one defect, checked against
onnxruntime (or ``onnx.reference`` where onnxruntime has no say)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import kiln

BACKENDS = ["numpy", "torch"]


def _ort(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3  # its "lenient merge" warning on the declared shape
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"]).run(None, feed)


def _kiln(model: onnx.ModelProto, feed: dict, backend: str, optimize: bool = True) -> list:
    return kiln.InferenceSession(model.SerializeToString(), backend=backend,
                                 optimize=optimize).run(None, feed)


# -- declared shapes are claims, not facts ------------------------------------------------

def _shape_op(op: str, x_shape: list, declared: list, value_info: bool) -> onnx.ModelProto:
    """``op(x, s)`` with both fed; the result is declared ``declared`` (as the graph output,
    or as value_info of an intermediate that a Relu then returns)."""
    nodes = [helper.make_node(op, ["x", "s"], ["t" if value_info else "y"])]
    if value_info:
        nodes.append(helper.make_node("Relu", ["t"], ["y"]))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, x_shape),
         helper.make_tensor_value_info("s", TP.INT64, [None])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None if value_info else declared)],
        value_info=[helper.make_tensor_value_info("t", TP.FLOAT, declared)] if value_info
        else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("value_info", [False, True], ids=["output", "value_info"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["expand", "reshape"])
def test_a_wrong_declared_shape_never_changes_the_result(case, backend, value_info):
    rng = np.random.default_rng(0)
    if case == "expand":  # [3,1] expanded by [2,1,6] is [2,3,6]; the file says [2,3,3]
        m = _shape_op("Expand", [3, 1], [2, 3, 3], value_info)
        feed = {"x": rng.random((3, 1), np.float32), "s": np.array([2, 1, 6], np.int64)}
    else:  # [6] reshaped by [-1] is [6]; the file says [3,2]
        m = _shape_op("Reshape", [None], [3, 2], value_info)
        feed = {"x": rng.random(6, np.float32), "s": np.array([-1], np.int64)}
    want = _ort(m, feed)[0]
    for optimize in (True, False):
        got = _kiln(m, feed, backend, optimize)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_get_outputs_still_describes_the_declared_shape_where_it_agrees():
    """Declarations still name dims for descriptions, as onnxruntime's ``get_outputs``."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TP.FLOAT, ["batch", 4])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    want = ort.InferenceSession(m.SerializeToString(),
                                providers=["CPUExecutionProvider"]).get_outputs()[0].shape
    for optimize in (True, False):
        s = kiln.InferenceSession(m.SerializeToString(), optimize=optimize)
        assert s.get_outputs()[0].shape == want


# -- "?" and "-1" dims are unknown, never one shared dim -----------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_question_mark_and_minus_one_dims_are_never_one_shared_dim(backend):
    """PaddleOCR's classifier declares its input ``x[-1,3,?,?]`` (as dim names); onnxruntime
    runs it on a non-square image, so the two ``?`` are not one dim."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, ["-1", 3, "?", "?"])],
        [helper.make_tensor_value_info("y", TP.FLOAT, ["-1", 3, "?", "?"])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3, 4, 7), np.float32)}
    want = _ort(m, feed)[0]
    np.testing.assert_array_equal(_kiln(m, feed, backend)[0], want)
