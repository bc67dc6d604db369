"""Torch kernels settle what the plan knows when the session is made (issue 41): a node
whose types, ranks, shapes or constant inputs a kernel lacks is declined in ``prepare``,
so the placement report names the kernel that runs it; one they fit is called with no
check in front of it. Each case is one node, its result against onnxruntime's."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import ort_run

pytest.importorskip("torch")

F32, I64, U8 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.UINT8
RNG = np.random.default_rng(41)


def _model(node, inputs: dict, out_type: int, inits=(), opset: int = 21, ms: bool = False):
    """One-node model; ``inputs``: name -> (elem type, shape)."""
    ins = [helper.make_tensor_value_info(n, t, s) for n, (t, s) in inputs.items()]
    outs = [helper.make_tensor_value_info(o, out_type, None) for o in node.output if o]
    g = helper.make_graph([node], "g", ins, outs[:1],
                          [numpy_helper.from_array(a, n) for n, a in inits])
    ops = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", 1)]
                                              if ms else [])
    return helper.make_model(g, opset_imports=ops, ir_version=10)


def _wrapped(sess, feeds) -> bool:
    """Whether the first kernel of the run is entered through a per-call check (a frame of
    kiln.ops.torch.arrays between the generated program and the kernel)."""
    found: list[list[str]] = []

    def prof(frame, event, arg):
        name = frame.f_globals.get("__name__") or ""
        if event != "call" or found or not name.startswith("kiln.ops") or \
                name == "kiln.ops.torch.arrays":
            return
        stack, f = [], frame.f_back
        while f is not None and not f.f_code.co_filename.startswith("<kiln plan"):
            stack.append(f.f_globals.get("__name__"))
            f = f.f_back
        if f is not None:
            found.append(stack)
    sys.setprofile(prof)
    try:
        sess.run(None, feeds)
    finally:
        sys.setprofile(None)
    assert found, "no kernel was called from the program"
    return "kiln.ops.torch.arrays" in found[0]


def _reference(model, feeds) -> list:
    """onnx.reference's outputs: the judge where onnxruntime refuses the node."""
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


def _check(model, feeds, how: str, atol: float = 0.0, judge=ort_run):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fallback warning of a declined node
        sess = kiln.Session(model, backend="torch", optimize=False)
    assert [lp.how for lp in sess.placement().layers] == [how]
    if how == "torch":
        assert not _wrapped(sess, feeds), "a kernel of known types checks them each call"
    if judge is None:
        return
    got, want = sess.run(None, feeds)[0], judge(model, feeds)[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("zp_shape, how", [((), "torch"), ((4,), "cpu-fallback")])
def test_matmul_integer_zero_point(zp_shape, how):
    """One zero point for A: the torch kernel; one per row: declined when the session
    is made (onnxruntime refuses a per-row one and onnx.reference broadcasts it along
    the wrong axis: only where the node runs is checked then)."""
    a = RNG.integers(0, 255, (4, 8), dtype=np.uint8)
    b = RNG.integers(-128, 127, (8, 3), dtype=np.int8)
    zp = np.full(zp_shape, 3, np.uint8)
    node = helper.make_node("MatMulInteger", ["a", "b", "az"], ["y"])
    model = _model(node, {"a": (U8, [4, 8]), "az": (U8, list(zp_shape))},
                   TensorProto.INT32, [("b", b)], opset=13)
    _check(model, {"a": a, "az": zp}, how, judge=ort_run if zp_shape == () else None)


@pytest.mark.parametrize("scale_shape, how", [([], "torch"), ([3], "cpu-fallback")])
def test_quantize_linear_on_a_fed_grid(scale_shape, how):
    """A grid fed at run time: per tensor, the torch kernel without a check; per axis,
    declined when the session is made."""
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    s = np.full(scale_shape, 0.05, np.float32)
    z = np.full(scale_shape, 7, np.uint8)
    node = helper.make_node("QuantizeLinear", ["x", "s", "z"], ["y"], axis=1)
    model = _model(node, {"x": (F32, [2, 3, 4]), "s": (F32, scale_shape),
                          "z": (U8, scale_shape)}, U8)
    _check(model, {"x": x, "s": s, "z": z}, how)


@pytest.mark.parametrize("x_type, how", [(U8, "torch"), (TensorProto.INT32, "cpu-fallback")])
def test_dequantize_linear_on_a_fed_grid(x_type, how):
    np_type = helper.tensor_dtype_to_np_dtype(x_type)
    x = RNG.integers(0, 200, (2, 5)).astype(np_type)
    node = helper.make_node("DequantizeLinear", ["x", "s", "z"], ["y"])
    model = _model(node, {"x": (x_type, [2, 5]), "s": (F32, []), "z": (x_type, [])}, F32)
    _check(model, {"x": x, "s": np.array(0.1, np.float32), "z": np.array(3, np_type)}, how)


@pytest.mark.parametrize("axis", [0, 1])
def test_gather_of_known_index_types_runs_unchecked(axis):
    data = RNG.standard_normal((5, 4)).astype(np.float32)
    idx = np.array([[0, -1], [2, 3]], np.int64)
    node = helper.make_node("Gather", ["x", "i"], ["y"], axis=axis)
    model = _model(node, {"x": (F32, [5, 4]), "i": (I64, [2, 2])}, F32)
    _check(model, {"x": data, "i": idx}, "torch")


def test_gather_elements_and_nd_run_unchecked():
    data = RNG.standard_normal((3, 4)).astype(np.float32)
    idx = np.array([[0, 1, -1, 2], [2, 0, 1, 1]], np.int64)
    node = helper.make_node("GatherElements", ["x", "i"], ["y"], axis=1)
    _check(_model(node, {"x": (F32, [3, 4]), "i": (I64, [2, 4])}, F32),
           {"x": data, "i": idx[:, :4]}, "torch")
    node = helper.make_node("GatherND", ["x", "i"], ["y"])
    _check(_model(node, {"x": (F32, [3, 4]), "i": (I64, [2, 2])}, F32),
           {"x": data, "i": np.array([[0, 1], [2, 3]], np.int64)}, "torch")


@pytest.mark.parametrize("pads, how", [
    ([0, 0, 1, 2, 0, 0, 2, 1], "torch"),          # the last two dims: torch's reflect
    ([1, 1, 1, 1, 1, 1, 1, 1], "cpu-fallback"),  # all four: more than torch pads
    ([0, 0, 3, 0, 0, 0, 0, 0], "cpu-fallback"),  # as wide as the dim
])
def test_reflect_pad_settled_from_constant_pads(pads, how):
    x = RNG.standard_normal((2, 3, 3, 4)).astype(np.float32)
    node = helper.make_node("Pad", ["x", "p"], ["y"], mode="reflect")
    model = _model(node, {"x": (F32, [2, 3, 3, 4])}, F32, [("p", np.array(pads, np.int64))])
    wide = max(pads) >= 3  # onnxruntime refuses a reflection as wide as the dim
    _check(model, {"x": x}, how, judge=_reference if wide else ort_run)


@pytest.mark.parametrize("pads, how", [([1, 1, 1, 1], "torch"), ([0, 0, 1, 1], "cpu-fallback")])
def test_max_pool_indices_with_padding(pads, how):
    """Indices through torch's pool need padding it takes as it is: known uneven pads are
    declined when the session is made."""
    x = RNG.standard_normal((1, 2, 5, 5)).astype(np.float32)
    node = helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=[3, 3], pads=pads)
    model = _model(node, {"x": (F32, [1, 2, 5, 5])}, F32)
    _check(model, {"x": x}, how)


@pytest.mark.parametrize("pads, ceil, how", [
    ([1, 1, 1, 1], 0, "torch"),
    ([0, 0, 1, 1], 0, "torch"),           # uneven: padded first
    ([0, 0, 1, 1], 1, "cpu-fallback"),   # uneven in ceil mode: declined
])
def test_average_pool_padding(pads, ceil, how):
    x = RNG.standard_normal((1, 2, 6, 6)).astype(np.float32)
    node = helper.make_node("AveragePool", ["x"], ["y"], kernel_shape=[3, 3], pads=pads,
                            strides=[2, 2], ceil_mode=ceil)
    _check(_model(node, {"x": (F32, [1, 2, 6, 6])}, F32), {"x": x}, how, atol=1e-6)


@pytest.mark.parametrize("slope_shape, how", [((3, 1, 1), "torch"), ((4,), "torch-generic")])
def test_prelu_slope_shape(slope_shape, how):
    x = RNG.standard_normal((2, 3, 2, 4)).astype(np.float32)
    slope = RNG.standard_normal(slope_shape).astype(np.float32)
    node = helper.make_node("PRelu", ["x", "s"], ["y"])
    model = _model(node, {"x": (F32, [2, 3, 2, 4])}, F32, [("s", slope)])
    _check(model, {"x": x}, how)


@pytest.mark.parametrize("scales, how", [([1, 1, 2, 2], "torch"), ([2, 1, 2, 2], "cpu-fallback")])
def test_resize_constant_scales(scales, how):
    x = RNG.standard_normal((1, 2, 3, 3)).astype(np.float32)
    node = helper.make_node("Resize", ["x", "", "s"], ["y"], mode="nearest",
                            coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    model = _model(node, {"x": (F32, [1, 2, 3, 3])}, F32,
                   [("s", np.array(scales, np.float32))])
    _check(model, {"x": x}, how)


@pytest.mark.parametrize("op, shape, attrs", [
    ("Gemm", [3, 4], {}),
    ("ArgMax", [3, 4], {"axis": 1}),
    ("ReduceMax", [3, 4], {}),
    ("LRN", [1, 3, 2, 2], {"size": 3}),
    ("InstanceNormalization", [1, 3, 2, 2], {}),
    ("Squeeze", [3, 1, 4], {}),
    ("Concat", [3, 4], {"axis": 0}),
    ("Split", [4, 4], {"axis": 0, "num_outputs": 2}),
])
def test_kernels_whose_ranks_and_shapes_are_known_run_unchecked(op, shape, attrs):
    x = RNG.standard_normal(shape).astype(np.float32)
    ins, inits, out = ["x"], [], F32
    if op == "Gemm":
        ins, inits = ["x", "w"], [("w", RNG.standard_normal((4, 2)).astype(np.float32))]
    elif op == "InstanceNormalization":
        ins, inits = ["x", "s", "b"], [("s", np.ones(3, np.float32)),
                                       ("b", np.zeros(3, np.float32))]
    elif op == "Squeeze":
        ins, inits = ["x", "a"], [("a", np.array([1], np.int64))]
    elif op == "Concat":
        ins = ["x", "x"]
    elif op == "ArgMax":
        out = I64
    outs = ["y", "z"] if op == "Split" else ["y"]
    node = helper.make_node(op, ins, outs, **attrs)
    _check(_model(node, {"x": (F32, shape)}, out, inits), {"x": x}, "torch", atol=1e-6)


def test_dropout_asked_to_train_by_a_constant_is_declined():
    """training_mode a constant True: the NumPy kernel's seeded masks, decided when the
    session is made (ratio 0 keeps every value, so onnxruntime's draw agrees)."""
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    node = helper.make_node("Dropout", ["x", "r", "t"], ["y"])
    model = _model(node, {"x": (F32, [3, 4])}, F32,
                   [("r", np.array(0.0, np.float32)), ("t", np.array(True))])
    _check(model, {"x": x}, "cpu-fallback")


def test_multi_head_attention_known_shapes():
    """Separate 3-D query/key/value of known shapes: the torch kernel, unchecked; one-way
    with fewer queries than keys: declined when the session is made."""
    b, s, t, d = 2, 3, 5, 8
    feeds = {n: RNG.standard_normal((b, m, d)).astype(np.float32)
             for n, m in (("q", s), ("k", t), ("v", t))}
    shapes = {n: (F32, list(a.shape)) for n, a in feeds.items()}
    for uni, how in ((0, "torch"), (1, "cpu-fallback")):
        node = helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["y"],
                                domain="com.microsoft", num_heads=2, unidirectional=uni)
        if uni:  # onnxruntime's MultiHeadAttention has no unidirectional: kernels only
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                sess = kiln.Session(_model(node, shapes, F32, ms=True), backend="torch",
                                    optimize=False)
            assert [lp.how for lp in sess.placement().layers] == [how]
            continue
        _check(_model(node, shapes, F32, ms=True), feeds, how, atol=1e-5)
