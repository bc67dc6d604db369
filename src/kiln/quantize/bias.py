"""Empirical bias correction: a quantized layer's mean output shift taken out of its bias.

Rounding weights and activations to 8 bits shifts a layer's output by an amount whose
mean per output channel is not zero (Nagel et al., Data-Free Quantization, 2019; OpenVINO's
post-training quantization corrects it by default). The shift is measured: each quantized
Conv/Gemm with an int32 bias, in run order, is run in the quantized model and in the float
model on the same feeds, and the difference of their per-channel means, in bias steps, is
subtracted from its int32 bias. One layer at a time, each measured with the corrections
before it in place, since a layer's shift carries what the layers before it added: all
corrected at once from one measurement, PaddleOCR's v4 recognizer read 0% of lines like
fp32, one at a time 62.5% against 50% (docs/quantization.md).
"""

from __future__ import annotations

import time
import warnings

import numpy as np

from kiln.ir import DType, Model, Node, TensorType, Value
from kiln.passes.base import clone_model
from kiln.quantize.calibrate import session_with

__all__ = ["correct_biases"]

CORRECTED_OPS = ("Conv", "Gemm")


def _int32_bias(n: Node) -> Node | None:
    """The DequantizeLinear giving ``n`` its int32 bias, or None."""
    if n.op_type not in CORRECTED_OPS or len(n.inputs) < 3 or n.inputs[2] is None:
        return None
    dq = n.inputs[2].producer
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    data, scale = dq.inputs[0], dq.inputs[1]
    if data is None or data.const is None or data.const.dtype != np.int32 \
            or scale is None or scale.const is None:
        return None
    return dq


def _means(sess, names: list[str], feeds: list[dict], axis_of: dict[str, int],
           extra: dict | None = None) -> dict[str, np.ndarray]:
    """Per name, the mean over ``feeds`` of each channel (``axis_of[name]``)."""
    sums: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feed in feeds:
        for name, out in zip(names, sess.run(names, {**feed, **(extra or {})})):
            out = np.asarray(out, np.float64)
            ax = axis_of[name] % out.ndim
            sums[name].append(out.mean(axis=tuple(i for i in range(out.ndim) if i != ax)))
    return {k: np.mean(v, axis=0) for k, v in sums.items()}


def correct_biases(float_model: Model, quant: Model, feeds: list[dict], backend: str,
                   seconds: float = 60.0, samples: int = 16) -> tuple[dict[str, float], int]:
    """Correct ``quant``'s int32 biases in place against ``float_model`` (the model it was
    quantized from, whose values carry the same names) on the first feeds holding
    ``samples`` samples; per corrected layer, the largest shift taken out in units of its
    output's mean |value|, and how many layers there were to correct. A run of the model
    per layer is the cost: after ``seconds`` the layers left keep their biases (the ones
    before them are corrected, which is what a later layer's correction assumes)."""
    t0 = time.perf_counter()
    feeds = _first_samples(feeds, samples)
    known = {v.name for _, n in float_model.graph.walk() for v in n.outputs if v is not None}
    sites = [(n, dq) for n in quant.graph.nodes
             if (dq := _int32_bias(n)) is not None and n.outputs[0].name in known
             and dq.inputs[0].num_uses == 1]
    if not sites or not feeds:
        return {}, len(sites)
    axis_of = {n.outputs[0].name: (1 if n.op_type == "Conv" else -1) for n, _ in sites}
    outs = list(axis_of)
    sess, found = session_with(float_model, outs, backend)
    ref = _means(sess, found, feeds, axis_of)
    # The dequantized biases become float inputs of one measuring copy: each correction
    # is a new feed, not a new session.
    probe = clone_model(quant)
    by_name = probe.graph.values_by_name()
    biases, scales, fed_as = {}, {}, {}
    for _, dq in sites:
        data, bias = dq.inputs[0], by_name[dq.outputs[0].name]
        fed = Value(f"{bias.name}_fed", TensorType(DType.FLOAT, tuple(data.const.shape)))
        for use in bias.uses:
            use.node.set_input(use.index, fed)
        if not bias.is_used():  # left, it would run: torch has no int32 DequantizeLinear
            probe.graph.remove_node(bias.producer)
        probe.graph.inputs.append(fed)
        biases[data.name] = data.const.astype(np.int64)
        scales[data.name] = np.asarray(dq.inputs[1].const, np.float32)
        fed_as[data.name] = fed.name
    with warnings.catch_warnings():
        # an internal, unoptimized copy: where its Q/DQ nodes run is no news to the user
        warnings.simplefilter("ignore")
        sess, found = session_with(probe, outs, backend)
    done = {}
    for n, dq in sites:
        out, data = n.outputs[0].name, dq.inputs[0]
        if time.perf_counter() - t0 > seconds:
            break
        if out not in ref or out not in found:
            continue
        now = {fed_as[k]: (v * scales[k]).astype(np.float32) for k, v in biases.items()}
        got = _means(sess, [out], feeds, axis_of, now)[out]
        steps = np.round((got - ref[out]) / scales[data.name].astype(np.float64))
        if got.shape != ref[out].shape or steps.shape != data.const.shape or not steps.any():
            continue
        biases[data.name] = np.clip(biases[data.name] - steps, -2 ** 31, 2 ** 31 - 1)
        data.const = biases[data.name].astype(np.int32)
        done[n.name or out] = float(np.abs(got - ref[out]).max() /
                                    max(float(np.abs(ref[out]).mean()), 1e-12))
    return done, len(sites)


def _first_samples(feeds: list[dict], samples: int) -> list[dict]:
    """The first feeds that together hold ``samples`` samples (along each feed's first
    input's first axis)."""
    out, held = [], 0
    for feed in feeds:
        if held >= samples:
            break
        out.append(feed)
        first = np.asarray(next(iter(feed.values())))
        held += first.shape[0] if first.ndim else 1
    return out
