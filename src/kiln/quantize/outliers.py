"""Outlier-aware static quantization: measure, for every Conv/MatMul/Gemm with a constant
weight, how much noise its input's 8-bit grid puts into its output, and act on it.

A per-tensor grid is shared by every channel of the tensor. When a few channels are far
below one step of it while the layer multiplies them by large weights (PaddleOCR's v4
recognizer: a Conv with 28 of 480 input channels below one uint8 step, weights up to
22.5), rounding erases exactly the channels the layer relies on, and no single clipping
rule fixes every tensor. So the error is measured, per layer, weighted the way the layer
weights it: with ``e_c`` the rounding/clipping error of input channel ``c`` on the
calibration data and ``|W_c|^2`` the sum of squares of the weights that read it, the
noise the grid adds to an output element is ``sum_c |W_c|^2 E[e_c^2] / O`` (``O``
output channels; errors of different channels taken as independent), and the layer's
*noise ratio* is that over the mean variance of its output channels. Then:

- ``method="auto"``: each tensor gets the calibration method (minmax, percentile,
  entropy) whose grid gives the smallest noise ratio summed over the layers reading it
  (also one of the accuracy budget's cheaper fixes);
- ``max_noise=R``: a layer whose ratio under the chosen grid stays above ``R`` is kept in
  float (mixed precision per layer); the report says which and the measured ratio.

Both are opt-in: the ratio is local to a layer, and on the trained models measured the
layers that change the task answer were not the ones it ranks highest (a recurrent
head or a CTC decode can amplify a small local error; docs/quantization.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kiln.ir import DType, Model, Node
from kiln.quantize import qdq
from kiln.quantize.calibrate import Range, session_with

__all__ = ["MAX_NOISE", "Outliers", "measure_noise"]

MAX_NOISE = 0.02
"""A noise ratio worth keeping a layer in float for (output SQNR below 17 dB): the
synthetic case in tests/quantize/test_quantize_outliers.py measures 0.5. Not a default: on the
trained models the ratio did not rank the layers whose quantization changes the task
answer (docs/quantization.md)."""


@dataclass
class _Site:
    node: Node
    x: str
    y: str
    axis: int
    """Input channel axis (Conv: 1, MatMul/Gemm: the last)."""
    w2: np.ndarray
    """Squared weights summed over kernel positions, (groups, outputs per group, inputs
    per group)."""
    dw2: np.ndarray
    """The same of the weights' own rounding error on their integer grid."""
    out_axis: int


@dataclass
class Outliers:
    """What the measurement chose: a method per tensor, the layers kept in float."""

    method: dict[str, str] = field(default_factory=dict)
    noise: dict[str, float] = field(default_factory=dict)
    """Per layer (name), its noise ratio under the chosen grid."""
    keep: dict[str, str] = field(default_factory=dict)
    """Layers to keep in float, with the reason."""


def _site(n: Node, bits: int, per_channel: bool) -> _Site | None:
    x, w = n.inputs[0], n.inputs[1]
    if not n.name or x is None or x.const is not None or w is None or w.const is None or \
            x.dtype != DType.FLOAT or n.outputs[0].dtype != DType.FLOAT:
        return None
    wc = np.asarray(w.const, np.float32)
    if n.op_type == "Conv" and wc.ndim >= 3:
        g, axis = int(n.attrs.get("group", 1)), 1
        if wc.shape[0] % g:
            return None
        q_axis = 0
    elif n.op_type == "MatMul" and wc.ndim == 2:
        g, axis, q_axis = 1, -1, 1
    elif n.op_type == "Gemm" and wc.ndim == 2 and not n.attrs.get("transA", 0):
        g, axis = 1, -1
        q_axis = 0 if n.attrs.get("transB", 0) else 1
    else:
        return None
    q, scale = qdq.quantize_weight(wc, q_axis if per_channel else None, bits)
    shape = [1] * wc.ndim
    if per_channel:
        shape[q_axis] = -1
    dw = q.astype(np.float32) * scale.reshape(shape) - wc
    if n.op_type == "Gemm" and n.attrs.get("transB", 0):
        wc, dw = wc.T, dw.T
    if n.op_type != "Conv":  # (K, N) -> (1, N, K)
        wc, dw = wc.T[None], dw.T[None]
    def squares(a: np.ndarray) -> np.ndarray:
        a = np.asarray(a, np.float64) ** 2
        if n.op_type != "Conv":
            return a
        o, cpg = a.shape[0], a.shape[1]
        return a.reshape(o, cpg, -1).sum(-1).reshape(g, o // g, cpg)
    return _Site(n, x.name, n.outputs[0].name, axis, squares(wc), squares(dw), axis)


def _per_sample(a: np.ndarray, axis: int) -> np.ndarray:
    """(samples, channels): means over every axis but the first (the sample) and
    ``axis`` (the channel); a 2-D MatMul input's rows are its samples."""
    axis = axis % a.ndim
    if a.ndim < 2 or axis == 0:
        return a.reshape(1, -1) if a.ndim == 1 else a.mean(
            axis=tuple(range(1, a.ndim))).reshape(1, -1)
    return a.mean(axis=tuple(i for i in range(1, a.ndim) if i != axis))


def measure_noise(model: Model, plan: qdq.Plan, feeds: list[dict],
                  candidates: dict[str, dict[str, Range]], symmetric: bool, bits: int,
                  per_channel: bool, backend: str, max_noise: float = MAX_NOISE
                  ) -> Outliers:
    """Run ``feeds`` once more, measure every quantized layer's noise ratio under each
    method's grid (``candidates``: method -> tensor -> range) and choose (module doc)."""
    sites = [s for s in (_site(n, bits, per_channel) for n in plan.quantized
                         if n.op_type in qdq.COMPUTE_OPS) if s is not None]
    if not sites or not feeds:
        return Outliers()
    methods = list(candidates)
    xs = sorted({(s.x, s.axis) for s in sites})
    ys = sorted({(s.y, s.out_axis) for s in sites})
    sess, names = session_with(model, sorted({t for t, _ in xs + ys}), backend)
    grids = {(t, k): qdq.act_params(candidates[k][t], symmetric)
             for t, _ in xs for k in methods if t in candidates[k]}
    # Per sample and channel: the grid's mean squared error under each method (rows;
    # the last row is x^2 itself) of each input; y and y^2 of each output.
    stats: dict[tuple, list[np.ndarray]] = {}
    for feed in feeds:
        outs = dict(zip(names, sess.run(names, feed)))
        for t, axis in xs:
            a = outs.get(t)
            if a is None or a.size == 0 or any((t, k) not in grids for k in methods):
                continue
            a = np.asarray(a, np.float32)
            rows = []
            for k in methods:
                scale, zp = grids[t, k]
                lo, hi = (0, 255) if zp.dtype == np.uint8 else (-128, 127)
                z = float(zp)
                q = (np.clip(np.rint(a / scale) + z, lo, hi) - z) * scale
                rows.append(_per_sample((q - a) ** 2, axis))
            rows.append(_per_sample(a * a, axis))
            stats.setdefault((t, axis), []).append(np.stack(rows))
        for t, axis in ys:
            a = outs.get(t)
            if a is not None and a.size:
                a = np.asarray(a, np.float64)
                stats.setdefault(("y", t, axis), []).append(
                    np.stack([_per_sample(a, axis), _per_sample(a * a, axis)]))
    cat = {k: np.concatenate(v, axis=1) for k, v in stats.items()}
    ratios: dict[str, np.ndarray] = {}
    for s in sites:
        kx, ky = (s.x, s.axis), ("y", s.y, s.out_axis)
        g, per_group, cpg = s.w2.shape
        if kx not in cat or ky not in cat or cat[kx].shape[2] != g * cpg or \
                cat[ky].shape[2] != g * per_group or cat[kx].shape[1] != cat[ky].shape[1]:
            continue
        st = cat[kx].reshape(len(methods) + 1, -1, g, cpg)
        mse, ex2 = st[:-1], st[-1]
        # noise per sample and output channel: the input's rounding through the
        # weights, plus the weights' rounding through the input
        noise = np.einsum("msgc,goc->msgo", mse, s.w2) + \
            np.einsum("sgc,goc->sgo", ex2, s.dw2)[None]
        noise = noise.reshape(len(methods), -1, g * per_group).sum(-1)
        y1, y2 = cat[ky]
        mean = y1.mean(0)  # each channel's mean over the data
        signal = np.maximum(y2 - 2 * mean * y1 + mean * mean, 0.0).sum(-1)
        # per sample, then averaged: a quiet sample (silence, a faint stroke) drowned
        # by the grid counts as much as a loud one
        ratios[s.node.name] = (noise / np.maximum(signal, 1e-30)).mean(-1)
    out = Outliers()
    by_tensor: dict[str, np.ndarray] = {}
    for s in sites:
        if s.node.name in ratios:
            by_tensor[s.x] = by_tensor.get(s.x, 0) + ratios[s.node.name]
    for t, total in by_tensor.items():
        out.method[t] = methods[int(np.argmin(total))]
    for s in sites:
        r = ratios.get(s.node.name)
        if r is None:
            continue
        chosen = out.method[s.x]
        out.noise[s.node.name] = float(r[methods.index(chosen)])
        if out.noise[s.node.name] > max_noise:
            out.keep[s.node.name] = (
                f"kept in float, outlier-aware: its input's 8-bit grid ({chosen}) puts "
                f"noise at {out.noise[s.node.name]:.3g} of its output's variance "
                f"(limit {max_noise:g}), measured on the calibration data")
    return out
