"""A run goes from ``Session.run`` to a layer's kernel in four calls, none of them into the
backend: the plan decided each layer's kernel and transfers when the session was made.
Read from Python's own profiler (``sys.setprofile``): the frames on the stack when the
first kernel is entered."""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln

PATH = ["kiln.runtime.session.execute_plan", "kiln.runtime.plan.run_main", "program"]


def _model(op: str):
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4, 4]) for n in "xy"]
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g", info[:1], info[1:])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _frames_to_first_kernel(sess) -> list[str]:
    """The frames between Session.run and the first call into kiln.ops (the kernel)."""
    feed = {"x": np.linspace(-1, 1, 16, dtype=np.float32).reshape(4, 4)}
    sess.run(None, feed)
    found: list[str] = []

    def prof(frame, event, arg):
        name = frame.f_globals.get("__name__") or ""
        if event != "call" or found or not name.startswith("kiln.ops") or \
                name == "kiln.ops.torch.arrays":
            return
        stack, f = [], frame.f_back
        while f is not None and not (f.f_code.co_name == "run" and
                                     f.f_globals.get("__name__") == "kiln.runtime.session"):
            generated = f.f_code.co_filename.startswith("<kiln plan")
            stack.append("program" if generated else
                         f"{f.f_globals.get('__name__')}.{f.f_code.co_name}")
            f = f.f_back
        if "program" in stack:  # a layer, not the feeds' conversion
            found.extend(reversed(stack))
    sys.setprofile(prof)
    try:
        sess.run(None, feed)
    finally:
        sys.setprofile(None)
    return found


@pytest.mark.parametrize("backend, op", [
    ("numpy", "Relu"),
    ("torch", "Relu"),      # a torch kernel
    ("torch", "Exp"),       # the shared array-API kernel on tensors
    ("torch", "EyeLike"),   # the NumPy kernel, its values moved by the program
])
def test_a_run_reaches_the_kernel_in_four_calls(backend, op):
    if backend == "torch":
        pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # EyeLike on torch: the fallback warning
        sess = kiln.Session(_model(op), backend=backend, optimize=False)
    assert _frames_to_first_kernel(sess) == PATH


def _typed_model(op: str, dtype: int, opset: int = 17):
    info = [helper.make_tensor_value_info(n, dtype, [4, 4]) for n in "xy"]
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g", info[:1], info[1:])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("op, dtype, how", [
    ("Sign", TensorProto.FLOAT, "torch"),          # a type the torch kernel takes
    ("Sign", TensorProto.UINT8, "torch-generic"),  # one it does not: declined at prepare
    ("Relu", TensorProto.INT8, "torch"),
    ("Relu", TensorProto.FLOAT, "torch"),
    ("Floor", TensorProto.DOUBLE, "torch"),
    ("Abs", TensorProto.UINT8, "torch"),
    ("Abs", TensorProto.UINT32, "torch-generic"),
    ("ReduceL1", TensorProto.INT32, "torch-generic"),  # a prepared kernel declines too
    ("ReduceL1", TensorProto.FLOAT, "torch"),
    ("ArgMax", TensorProto.INT64, "torch"),
    ("LpNormalization", TensorProto.DOUBLE, "torch"),
])
def test_a_kernel_declines_a_type_the_plan_knows_when_the_session_is_made(op, dtype, how):
    """A torch kernel that computes only some types declines a node of another known type
    while the session is made, so the placement report names the kernel that really runs
    (not the torch kernel handing every call on); the result is onnxruntime's."""
    pytest.importorskip("torch")
    from onnx import helper as h

    from conftest import ort_run

    model = _typed_model(op, dtype)
    sess = kiln.Session(model, backend="torch", optimize=False)
    assert [lp.how for lp in sess.placement().layers] == [how]
    np_type = h.tensor_dtype_to_np_dtype(dtype)
    x = (np.arange(16).reshape(4, 4) * (1 if np_type.kind == "u" else -1) + 3).astype(np_type)
    got = sess.run(None, {"x": x})[0]
    want = ort_run(model, {"x": x})[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)
