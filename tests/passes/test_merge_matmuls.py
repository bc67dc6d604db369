"""Products of one input by several constant weights merged into one wider product and a
Split (the ``merge_matmuls`` pass). Oracle: onnxruntime on the original files, and on the
optimized ones once saved (FusedMatMul carries its standard ops as a function body)."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import ort_run
from kiln.onnxio import to_proto


def _siblings_model(opset: int) -> onnx.ModelProto:
    """x (2, 5, 8) read by: three products with biases or none (merge), one by a weight a
    feed may override and one followed by Relu (stay), and one product of another input."""
    rng = np.random.default_rng(0)
    inits, nodes = [], []

    def const(name, shape):
        inits.append(numpy_helper.from_array(rng.normal(0, 1, shape).astype(np.float32),
                                             name))

    for name, width, bias in (("q", 6, True), ("k", 4, True), ("v", 6, False),
                              ("r", 3, True)):
        const(f"w_{name}", (8, width))
        nodes.append(helper.make_node("MatMul", ["x", f"w_{name}"], [f"{name}_p"]))
        out = f"{name}_p"
        if bias:
            const(f"b_{name}", (width,))
            nodes.append(helper.make_node("Add", [out, f"b_{name}"], [f"{name}_b"]))
            out = f"{name}_b"
        op = "Relu" if name == "r" else "Identity"
        nodes.append(helper.make_node(op, [out], [name]))
    const("w_in", (8, 2))
    nodes.append(helper.make_node("MatMul", ["x", "w_in"], ["i"]))
    const("w_other", (8, 5))
    nodes.append(helper.make_node("MatMul", ["x2", "w_other"], ["o"]))
    f = TensorProto.FLOAT
    outs = [("q", 6), ("k", 4), ("v", 6), ("r", 3), ("i", 2), ("o", 5)]
    graph = helper.make_graph(
        nodes, "siblings", [helper.make_tensor_value_info("x", f, [2, 5, 8]),
                            helper.make_tensor_value_info("x2", f, [2, 5, 8]),
                            helper.make_tensor_value_info("w_in", f, [8, 2])],
        [helper.make_tensor_value_info(n, f, [2, 5, w]) for n, w in outs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("opset", [11, 17])
@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_siblings_merge_and_match_onnxruntime(opset, backend):
    if backend == "torch":
        pytest.importorskip("torch")
    proto = _siblings_model(opset)
    rng = np.random.default_rng(1)
    feed = {k: rng.normal(0, 1, s).astype(np.float32)
            for k, s in (("x", (2, 5, 8)), ("x2", (2, 5, 8)), ("w_in", (8, 2)))}
    want = ort_run(proto, feed)
    m = kiln.optimize(proto, backend=backend)
    counts = Counter(n.op_type for n in m.graph.nodes)
    # q, k, v -> one FusedMatMul and a Split; r keeps its Relu apart; the overridable
    # weight and the other input's product stay plain MatMuls
    assert counts["Split"] == 1 and counts["FusedMatMul"] == 2 and counts["MatMul"] == 2, \
        counts
    split = next(n for n in m.graph.nodes if n.op_type == "Split")
    assert [v.name for v in split.outputs] == ["q", "k", "v"]
    got = kiln.InferenceSession(proto, backend=backend).run(None, feed)
    for name, g, w in zip("qkvrio", got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=name)
    saved = ort_run(to_proto(m), feed)
    for name, g, w in zip("qkvrio", saved, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=f"saved {name}")


def test_can_be_disabled():
    m = kiln.optimize(_siblings_model(17), disable=["merge_matmuls"])
    assert "Split" not in {n.op_type for n in m.graph.nodes}


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_bert_projections_merge(zoo_model, backend):
    """The zoo BERT's four layers each project the hidden state three times: 8 fewer
    products, outputs as onnxruntime's."""
    if backend == "torch":
        pytest.importorskip("torch")
    from kiln.zoo.registry import make_inputs

    path = str(zoo_model("bert"))
    feed = make_inputs("bert", batch=2, seq=16, seed=3)
    want = ort_run(path, feed)
    merged = Counter(n.op_type for n in kiln.optimize(path, backend=backend).graph.nodes)
    apart = Counter(n.op_type for n in kiln.optimize(
        path, backend=backend, disable=["merge_matmuls"]).graph.nodes)
    assert apart["FusedMatMul"] - merged["FusedMatMul"] == 8, (merged, apart)
    assert merged["Split"] - apart["Split"] == 4
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = kiln.InferenceSession(path, backend=backend).run(None, feed)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
