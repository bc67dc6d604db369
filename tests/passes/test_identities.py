"""Algebraic identities (x*1, x/1, x^1, x-0, x+(-0), logic with true/false, double
negation) leave the optimized model computing exactly what onnxruntime computes on the
original, bit for bit: NaN, infinities and signed zeros in the data, constants that would
broadcast the result to a larger shape or are not all identity elements, and ``x + 0``,
which is not an identity (-0 + +0 is +0). The oracle is onnxruntime on the unoptimized
model; the node counts show which identities were removed."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import make_model

F = TensorProto.FLOAT
DATA = np.array([[-0.0, 0.0, np.nan, np.inf, -np.inf, 1.5, -2.25, 3e38]], np.float32)


def _one_op(op: str, const: np.ndarray, x_first: bool = True, x_shape=(1, 8),
            dtype=F, data=DATA):
    """x -> Neg (Not for booleans) -> ``op`` with constant ``const`` -> y: a node in front,
    so that y could be computed by it when ``op`` goes."""
    c = numpy_helper.from_array(const, "c")
    ins = ["a", "c"] if x_first else ["c", "a"]
    nodes = [helper.make_node("Not" if dtype == TensorProto.BOOL else "Neg", ["x"], ["a"]),
             helper.make_node(op, ins, ["y"])]
    m = make_model(nodes, [helper.make_tensor_value_info("x", dtype, list(x_shape))],
                   [helper.make_tensor_value_info("y", dtype, None)], [c])
    return m, {"x": data}


def _check(model, feed, removed: bool) -> list[str]:
    """The optimized model's ops after the first; both backends agree with onnxruntime."""
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feed)[0]
    optimized = kiln.optimize(model)
    ops = [n.op_type for n in optimized.graph.nodes][1:]
    for backend in ("numpy", "torch"):
        if backend == "torch":
            pytest.importorskip("torch")
        got = kiln.Session(model, backend=backend).run(None, feed)[0]
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got, want)
        if got.dtype.kind == "f":
            # signs of zeros (IEEE 754 leaves a NaN's sign to the operation: not compared)
            num = ~np.isnan(want)
            np.testing.assert_array_equal(np.signbit(got[num]), np.signbit(want[num]))
    return ops


@pytest.mark.parametrize("op, const, x_first", [
    ("Mul", 1.0, True), ("Mul", 1.0, False), ("Div", 1.0, True), ("Pow", 1.0, True),
    ("Sub", 0.0, True), ("Add", -0.0, True), ("Add", -0.0, False)])
def test_identities_are_removed_and_keep_nan_inf_and_signed_zeros(op, const, x_first):
    model, feed = _one_op(op, np.full((1, 8), const, np.float32), x_first)
    assert _check(model, feed, removed=True) == []


@pytest.mark.parametrize("op, const, why", [
    ("Add", 0.0, "-0 + +0 is +0"), ("Sub", -0.0, "-0 - (-0) is +0"),
    ("Mul", -1.0, "not an identity"), ("Div", 2.0, "not an identity")])
def test_look_alikes_that_change_values_stay(op, const, why):
    model, feed = _one_op(op, np.full((1, 8), const, np.float32))
    assert _check(model, feed, removed=False) == [op], why


def test_a_constant_not_all_ones_stays():
    c = np.ones((1, 8), np.float32)
    c[0, 3] = 2.0
    model, feed = _one_op("Mul", c)
    assert _check(model, feed, removed=False) == ["Mul"]


@pytest.mark.parametrize("const_shape", [(2, 8), (3, 1, 8), (2, 1)])
def test_an_identity_constant_that_broadcasts_the_result_stays(const_shape):
    model, feed = _one_op("Mul", np.ones(const_shape, np.float32))
    assert _check(model, feed, removed=False) == ["Mul"]


def test_a_broadcast_identity_of_the_result_shape_goes():
    model, feed = _one_op("Mul", np.ones((8,), np.float32))  # (1, 8) * (8,) is (1, 8)
    assert _check(model, feed, removed=True) == []


def test_integer_zero_is_an_identity_for_add():
    data = np.array([[-3, 0, 7, 2**31 - 1]], np.int32)
    model, feed = _one_op("Add", np.zeros((1, 4), np.int32), x_shape=(1, 4),
                          dtype=TensorProto.INT32, data=data)
    assert _check(model, feed, removed=True) == []


@pytest.mark.parametrize("op, const", [("And", True), ("Or", False), ("Xor", False)])
def test_logic_identities(op, const):
    data = np.array([[True, False, True]])
    model, feed = _one_op(op, np.full((1, 3), const), x_shape=(1, 3),
                          dtype=TensorProto.BOOL, data=data)
    assert _check(model, feed, removed=True) == []


@pytest.mark.parametrize("op, dtype, data", [
    ("Neg", F, DATA), ("Not", TensorProto.BOOL, np.array([[True, False]]))])
def test_double_negation(op, dtype, data):
    nodes = [helper.make_node("Abs" if dtype == F else "Not", ["x"], ["a"]),
             helper.make_node(op, ["a"], ["b"]), helper.make_node(op, ["b"], ["y"])]
    model = make_model(nodes, [helper.make_tensor_value_info("x", dtype, list(data.shape))],
                       [helper.make_tensor_value_info("y", dtype, None)])
    assert _check(model, {"x": data}, removed=True) == []


def test_an_identity_computing_a_graph_output_from_a_graph_input_stays():
    """Nothing else could compute ``y`` then: the output's name is the model's interface."""
    c = numpy_helper.from_array(np.ones((1, 8), np.float32), "c")
    model = make_model([helper.make_node("Mul", ["x", "c"], ["y"])],
                       [helper.make_tensor_value_info("x", F, [1, 8])],
                       [helper.make_tensor_value_info("y", F, None)], [c])
    want = ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": DATA})[0]
    np.testing.assert_array_equal(kiln.Session(model).run(None, {"x": DATA})[0], want)
    assert [n.op_type for n in kiln.optimize(model).graph.nodes] == ["Mul"]
