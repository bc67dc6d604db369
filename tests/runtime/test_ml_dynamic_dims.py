"""Input dims stored as -1, 0 or an empty name are dynamic: feeds of any size there run
and give onnxruntime's outputs. (onnxruntime 1.32 reads -1 and "" as dynamic but holds a
stored 0 to zero rows; Kiln reads 0 as dynamic too, so its oracle copy of the model names
that dim.)"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln

ort = pytest.importorskip("onnxruntime")


def _input(name: str, dims: list) -> onnx.ValueInfoProto:
    vi = helper.make_tensor_value_info(name, TensorProto.FLOAT, None)
    shape = vi.type.tensor_type.shape
    for d in dims:
        dim = shape.dim.add()
        if isinstance(d, str):
            dim.dim_param = d
        else:
            dim.dim_value = d
    return vi


def _model(zero: int | str) -> bytes:
    # a: (-1, 3), b: (0, 3), c: ("", 3); out = (a @ w) + sum(b, c over rows)
    w = helper.make_tensor("w", TensorProto.FLOAT, [3, 2], np.arange(6, dtype=np.float32))
    nodes = [
        helper.make_node("MatMul", ["a", "w"], ["aw"]),
        helper.make_node("ReduceSum", ["b"], ["bs"], keepdims=1, axes=[0]),
        helper.make_node("ReduceSum", ["c"], ["cs"], keepdims=1, axes=[0]),
        helper.make_node("Add", ["bs", "cs"], ["bc"]),
        helper.make_node("Concat", ["aw", "aw"], ["out"], axis=1),
        helper.make_node("Mul", ["bc", "bc"], ["out2"]),
    ]
    graph = helper.make_graph(nodes, "dims", [_input("a", [-1, 3]), _input("b", [zero, 3]),
                                              _input("c", ["", 3])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
                               helper.make_tensor_value_info("out2", TensorProto.FLOAT, None)],
                              [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 11)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_minus_one_zero_and_empty_dims_are_dynamic(backend):
    onx = _model(0)
    ref = ort.InferenceSession(_model("rows_b"), providers=["CPUExecutionProvider"])
    sess = kiln.InferenceSession(onx, backend=backend)
    rng = np.random.default_rng(0)
    for rows in (2, 5):
        feed = {k: rng.normal(size=(rows + i, 3)).astype(np.float32)
                for i, k in enumerate("abc")}
        for got, want in zip(sess.run(None, feed), ref.run(None, feed)):
            np.testing.assert_allclose(got, want, rtol=1e-6)
    # The dims the file fixed (3) are still checked.
    with pytest.raises(kiln.InputError):
        sess.run(None, {"a": np.zeros((2, 4), np.float32), "b": feed["b"], "c": feed["c"]})
