"""Outlier-aware static quantization (issue 48 item 2, kiln.quantize.outliers): a layer
whose input has channels far below one step of its 8-bit grid, read through large
weights, is measured noisy and kept in float; each tensor's calibration method is the
one measured least noisy for the layers reading it (``method="auto"``). Both opt-in:
on the trained models measured they did not beat minmax (docs/quantization.md).

Oracles: onnxruntime runs the float file and Kiln's quantized files; NumPy computes the
grid's error for the method choice."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import ort_run
from kiln.onnxio import to_proto


def _outlier_conv() -> tuple[onnx.ModelProto, list[dict]]:
    """A 1x1 Conv over 8 channels: six loud (std 10), two quiet (std 0.02) that the
    weights amplify 500x, so the quiet ones carry half the output."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (4, 8, 1, 1)).astype(np.float32)
    w[:, 6:] *= 500 * 10 / 0.02 / 500  # |w| * std equal for loud and quiet channels
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="mix")]
    graph = helper.make_graph(
        nodes, "outliers", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                           [2, 8, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 6, 6])],
        [numpy_helper.from_array(w, "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    std = np.array([10] * 6 + [0.02] * 2, np.float32).reshape(1, 8, 1, 1)
    feeds = [{"x": (rng.normal(0, 1, (2, 8, 6, 6)) * std).astype(np.float32)}
             for _ in range(4)]
    return proto, feeds


def _rel_error(proto, quantized, feeds) -> float:
    err = ref = 0.0
    for f in feeds:
        (a,), (b,) = ort_run(proto, f), ort_run(to_proto(quantized.model), f)
        err, ref = max(err, float(np.abs(a - b).max())), max(ref, float(np.abs(a).max()))
    return err / ref


def test_a_layer_reading_quiet_channels_through_large_weights_stays_float():
    """``max_noise``: the Conv whose quiet channels fall below one step of the per-tensor
    grid is measured noisy and kept float; without it, it is quantized (the default)."""
    proto, feeds = _outlier_conv()
    q = kiln.quantize(proto, "static", feeds[:2], max_noise=0.02, measure_latency=False)
    assert "outlier-aware" in q.report.kept.get("mix", ""), q.report.kept
    every = kiln.quantize(proto, "static", feeds[:2], measure_latency=False)
    assert "mix" in every.report.quantized
    # onnxruntime on held-out feeds: the quantized Conv loses the quiet half of the
    # signal; the kept one is the float layer
    assert _rel_error(proto, every, feeds[2:]) > 0.05
    assert _rel_error(proto, q, feeds[2:]) < 1e-6


def test_each_tensor_takes_the_method_its_readers_measure_least_noisy():
    """With one loud value among small ones, minmax spends the grid on it and the other
    methods clip it: the auto choice must be the method whose grid NumPy measures the
    smallest squared error on the data (an identity 1x1 Conv weighs every channel the
    same)."""
    from kiln.passes.infer_shapes import infer_model
    from kiln.quantize import outliers, qdq
    from kiln.quantize.api import as_model
    from kiln.quantize.calibrate import calibrate_all

    rng = np.random.default_rng(1)
    w = np.eye(4, dtype=np.float32).reshape(4, 4, 1, 1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="c")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 32, 32])],
        [numpy_helper.from_array(w, "w")])
    m = as_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    infer_model(m)
    feeds = []
    for _ in range(3):
        x = rng.normal(0, 1, (1, 4, 32, 32)).astype(np.float32)
        x[0, 0, 0, 0] = 200.0
        feeds.append({"x": x})
    plan = qdq.plan_layers(m, "static", qdq.COMPUTE_OPS, set())
    cands = calibrate_all(m, ["x", "y"], feeds)
    chosen = outliers.measure_noise(m, plan, feeds, cands, False, 8, True, "numpy")
    xs = np.concatenate([f["x"] for f in feeds])

    def mse(method):
        scale, zp = qdq.act_params(cands[method]["x"], False)
        q = (np.clip(np.rint(xs / scale) + float(zp), 0, 255) - float(zp)) * scale
        return float(((q - xs) ** 2).mean())
    assert chosen.method["x"] == min(cands, key=mse)
