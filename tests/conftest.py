"""Shared test helpers: small models built with onnx.helper, and onnxruntime as oracle."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

ONNX_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
LIGHT_DIR = os.path.join(ONNX_DATA, "light")


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17, **kw) -> onnx.ModelProto:
    """A ModelProto from node/value-info lists (opset 17 unless said)."""
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kw)
    model.ir_version = 8
    return model


def ort_run(model: onnx.ModelProto | str, feeds: dict) -> list[np.ndarray]:
    """Outputs of onnxruntime (CPU) for ``feeds``: the oracle Kiln is checked against."""
    ort = pytest.importorskip("onnxruntime")
    src = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.fixture
def mlp_model() -> onnx.ModelProto:
    """x[batch,4] -> MatMul -> Add -> Relu -> MatMul -> Softmax, with seeded weights."""
    rng = np.random.default_rng(0)
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [4, 8], rng.standard_normal(32).tolist())
    b1 = helper.make_tensor("b1", TensorProto.FLOAT, [8], rng.standard_normal(8).tolist())
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [8, 3], rng.standard_normal(24).tolist())
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["y"], axis=-1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                      [w1, b1, w2])
