"""A runaway Loop stops with a KernelError saying what to raise, bounded in memory and time
as well as iterations (issue 39, item 13); a loop within the bounds gives onnxruntime's
result."""

from __future__ import annotations

import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

import kiln
import kiln.ops.control
from kiln.errors import KernelError

INT64_MAX = 2**63 - 1


def _stacking_loop(trip: int, width: int) -> onnx.ModelProto:
    """A while-loop (condition always true) whose scan output is ``width`` floats a
    iteration: the acc value broadcast to (width,)."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond_in"], ["cond_out"]),
         helper.make_node("Add", ["acc_in", "one"], ["acc_out"]),
         helper.make_node("Expand", ["acc_out", "width"], ["row"])],
        "body",
        [helper.make_tensor_value_info("i", TP.INT64, []),
         helper.make_tensor_value_info("cond_in", TP.BOOL, []),
         helper.make_tensor_value_info("acc_in", TP.FLOAT, [])],
        [helper.make_tensor_value_info("cond_out", TP.BOOL, []),
         helper.make_tensor_value_info("acc_out", TP.FLOAT, []),
         helper.make_tensor_value_info("row", TP.FLOAT, [width])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trip", "cond", "x"], ["y", "rows"], body=body)], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [])],
        [helper.make_tensor_value_info("y", TP.FLOAT, []),
         helper.make_tensor_value_info("rows", TP.FLOAT, None)],
        [helper.make_tensor("trip", TP.INT64, [], [trip]),
         helper.make_tensor("cond", TP.BOOL, [], [True]),
         helper.make_tensor("one", TP.FLOAT, [], [1.0]),
         helper.make_tensor("width", TP.INT64, [1], [width])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


BACKENDS = ["numpy", "torch"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loop_within_the_bounds_matches_onnxruntime(backend):
    ort = pytest.importorskip("onnxruntime")
    if backend == "torch":
        pytest.importorskip("torch")
    model = _stacking_loop(7, 1 << 20).SerializeToString()
    x = np.array(2.0, np.float32)
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = kiln.InferenceSession(model, backend=backend).run(None, {"x": x})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), w)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_runaway_loop_stacking_4_mib_a_step_stops_at_the_memory_bound(backend, monkeypatch):
    if backend == "torch":
        pytest.importorskip("torch")
    monkeypatch.setattr(kiln.ops.control, "MAX_LOOP_SCAN_BYTES", 64 << 20)
    sess = kiln.InferenceSession(_stacking_loop(INT64_MAX, 1 << 20).SerializeToString(),
                                 backend=backend)
    with pytest.raises(KernelError, match="MAX_LOOP_SCAN_BYTES") as e:
        sess.run(None, {"x": np.array(0.0, np.float32)})
    assert "after 17 iterations" in str(e.value)  # 17 x 4 MiB is the first over 64 MiB


def test_the_memory_bound_is_a_few_gib_by_default():
    assert 1 << 30 <= kiln.ops.control.MAX_LOOP_SCAN_BYTES <= 8 << 30


def test_a_runaway_loop_stops_at_the_time_bound(monkeypatch):
    monkeypatch.setattr(kiln.ops.control, "MAX_LOOP_SECONDS", 0.5)
    sess = kiln.InferenceSession(_stacking_loop(INT64_MAX, 1).SerializeToString(),
                                 backend="numpy")
    t0 = time.monotonic()
    with pytest.raises(KernelError, match="MAX_LOOP_SECONDS"):
        sess.run(["y"], {"x": np.array(0.0, np.float32)})
    assert time.monotonic() - t0 < 20  # not the 14-40 s of the iteration cap
