"""Bias correction (``kiln.quantize.bias``): a quantized layer's mean output shift per
channel, measured against the float model, comes out of its int32 bias. Oracle:
onnxruntime running the float model and the quantized files on feeds the correction did
not see."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import make_model, ort_run
from kiln.onnxio import to_proto


def _biased_conv():
    """A Conv whose every weight but one per channel lies 0.4 of a step above the int8
    grid (the one on it sets the step), reading a positive input: rounding the weights
    shifts each output channel by about 0.4 step times the sum of its inputs."""
    rng = np.random.default_rng(0)
    step = rng.uniform(0.002, 0.01, (4, 1, 1, 1))
    n = rng.integers(-100, 100, (4, 8, 3, 3)).astype(np.float64) + 0.4
    n[:, 0, 0, 0] = 127
    inits = [numpy_helper.from_array((n * step).astype(np.float32), "w"),
             numpy_helper.from_array(rng.normal(0, 0.1, 4).astype(np.float32), "b")]
    model = make_model(
        [helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", pads=[1] * 4)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 12, 12])], inits)
    feeds = [{"x": rng.uniform(0.5, 1.5, (2, 8, 12, 12)).astype(np.float32)}
             for _ in range(8)]
    return model, feeds


def _mean_shift(model, quantized, feeds) -> float:
    """Mean over channels of |mean of (quantized - float)| per output channel."""
    d = np.concatenate([ort_run(to_proto(quantized.model), f)[0] - ort_run(model, f)[0]
                        for f in feeds])
    return float(np.abs(d.mean(axis=(0, 2, 3))).mean())


def test_bias_correction_takes_out_the_mean_shift_of_rounded_weights():
    model, feeds = _biased_conv()
    files = {bc: kiln.quantize(model, "static", feeds[:4], reduce_range=False,
                               measure_latency=False, speed_aware=False,
                               bias_correction=bc) for bc in (False, True)}
    before, after = (_mean_shift(model, files[bc], feeds[4:]) for bc in (False, True))
    assert before > 0.02, before  # the shift is there to take out
    assert after < 0.2 * before, (before, after)
    assert any(n.startswith("bias correction: 1 of 1 layer") for n in files[True].report.notes)
    assert not any(n.startswith("bias correction") for n in files[False].report.notes)
