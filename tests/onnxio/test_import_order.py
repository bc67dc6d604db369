"""The importer puts nodes in dependency order whatever order the file lists them in (sorted
files skip the search), reads through subgraphs' captures, and refuses cycles."""

from __future__ import annotations

import random

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from conftest import make_model
from kiln.errors import ModelLoadError


def _chain(n: int, shuffle_seed: int | None):
    """x -> Add 1 -> Mul 2 -> Add 1 -> ... (n nodes), listed in a shuffled order."""
    nodes, prev = [], "x"
    for i in range(n):
        out = f"v{i}" if i < n - 1 else "y"
        op = "Add" if i % 2 == 0 else "Mul"
        nodes.append(helper.make_node(op, [prev, "one" if op == "Add" else "two"], [out]))
        prev = out
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(nodes)
    inits = [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0]),
             helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])], inits)


def _numpy_chain(x: np.ndarray, n: int) -> np.ndarray:
    for i in range(n):
        x = x + 1 if i % 2 == 0 else x * 2
    return x


@pytest.mark.parametrize("seed", [None, 0, 1])
def test_nodes_in_any_order_run_in_dependency_order(seed):
    x = np.array([-1.0, 0.0, 0.5], np.float32)
    m = kiln.load(_chain(40, seed))
    order = {v.name: i for i, n in enumerate(m.graph.nodes) for v in n.outputs}
    assert all(order[v.name] < i for i, n in enumerate(m.graph.nodes) for v in n.inputs
               if v.name in order)
    got = kiln.InferenceSession(m, optimize=False).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, _numpy_chain(x, 40), rtol=1e-6)


def test_a_subgraph_capture_listed_after_its_if_is_sorted_before_it():
    """The If is listed first; its branches read ``t``, which a later node computes."""
    then = helper.make_graph([helper.make_node("Add", ["t", "t"], ["a"])], "then", [],
                             [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3])])
    other = helper.make_graph([helper.make_node("Neg", ["t"], ["b"])], "else", [],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [3])])
    nodes = [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other),
             helper.make_node("Abs", ["x"], ["t"])]
    m = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3]),
                           helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    sess = kiln.InferenceSession(m, optimize=False)
    x = np.array([-1.5, 0.0, 2.0], np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x, "c": np.array(True)})[0],
                                  2 * np.abs(x))
    np.testing.assert_array_equal(sess.run(None, {"x": x, "c": np.array(False)})[0],
                                  -np.abs(x))


def test_a_cycle_is_a_load_error_naming_a_node_on_it():
    nodes = [helper.make_node("Relu", ["b"], ["a"], name="first"),
             helper.make_node("Neg", ["a"], ["b"], name="second"),
             helper.make_node("Add", ["x", "a"], ["y"], name="out")]
    m = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    with pytest.raises(ModelLoadError, match="cycle through node '(first|second)'"):
        kiln.load(m)
