"""Calibration: run the float model on representative inputs and choose, for each tensor
to be quantized, the range [lo, hi] its 8-bit grid will cover.

Three methods:

- ``minmax``: the smallest and largest value seen. Exact for the data, but one outlier
  stretches the grid for everything else.
- ``percentile``: the range that holds ``percentile`` % of the values (99.99 by default),
  read off a histogram; outliers beyond it saturate.
- ``entropy``: the clipping threshold whose 128-level quantized histogram is closest to
  the real one in Kullback-Leibler divergence (the method TensorRT popularized).

Histograms need the range first, so those two methods run the data twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from kiln.errors import InputError, OptionError
from kiln.ir import Model
from kiln.passes.base import clone_model
from kiln.quantize.engines import open_session

__all__ = ["METHODS", "Range", "calibrate", "calibrate_all", "load_feeds", "session_with"]

METHODS = ("minmax", "percentile", "entropy")
BINS = 2048


@dataclass
class Range:
    """The calibrated range of one tensor."""

    lo: float
    hi: float


def load_feeds(calibration, input_names: list[str], batch: int = 16) -> list[dict]:
    """Calibration data as a list of feeds: from an ``.npz`` path (its keys name the
    inputs; cut into batches of ``batch`` along the first axis), one feed dict, or an
    iterable of feed dicts."""
    if calibration is None:
        raise InputError("this mode needs calibration data: an .npz file whose keys are the "
                         f"model's inputs ({', '.join(input_names)}) or an iterable of feeds")
    if isinstance(calibration, (str, os.PathLike)):
        with np.load(calibration) as data:
            arrays = {k: data[k] for k in data.files}
        missing = [n for n in input_names if n not in arrays]
        if missing:
            raise InputError(f"{calibration} has no array for input(s) {', '.join(missing)}; "
                             f"its keys are {', '.join(arrays) or 'none'}")
        n = len(arrays[input_names[0]])
        return [{k: arrays[k][i:i + batch] for k in input_names} for i in range(0, n, batch)]
    if isinstance(calibration, Mapping):
        return [dict(calibration)]
    feeds = [dict(f) for f in calibration]
    if not feeds:
        raise InputError("the calibration data is empty")
    return feeds


def calibrate(model: Model, tensors: list[str], feeds: list[dict], method: str = "minmax",
              percentile: float = 99.99, backend: str | None = None,
              on_batch: Callable[[int, int], None] | None = None) -> dict[str, Range]:
    """The range of each of ``tensors`` (value names of ``model``) over ``feeds``.
    ``on_batch(done, total)`` is called after every batch (a progress bar hooks in)."""
    return calibrate_all(model, tensors, feeds, (method,), percentile, backend,
                         on_batch)[method]


def calibrate_all(model: Model, tensors: list[str], feeds: list[dict],
                  methods: tuple[str, ...] = METHODS, percentile: float = 99.99,
                  backend: str | None = None,
                  on_batch: Callable[[int, int], None] | None = None
                  ) -> dict[str, dict[str, Range]]:
    """Per method of ``methods``, the range of each of ``tensors`` over ``feeds``: one
    pass for the extremes and, where a method needs histograms, one pass for all."""
    for method in methods:
        if method not in METHODS:
            raise OptionError(f"unknown calibration method {method!r}; choose one of "
                              f"{', '.join(METHODS)}")
    sess, names = session_with(model, tensors, backend)
    hist_methods = [m for m in methods if m != "minmax"]
    total = (1 + bool(hist_methods)) * len(feeds)
    lo = {t: np.inf for t in names}
    hi = {t: -np.inf for t in names}
    step = 0
    for outs in _outputs(sess, names, feeds):
        for t, a in outs.items():
            if a.size:
                lo[t] = min(lo[t], float(a.min()))
                hi[t] = max(hi[t], float(a.max()))
        step += 1
        if on_batch is not None:
            on_batch(step, total)
    lo = {t: v if np.isfinite(v) else 0.0 for t, v in lo.items()}
    hi = {t: v if np.isfinite(v) else 0.0 for t, v in hi.items()}
    result: dict[str, dict[str, Range]] = {}
    if "minmax" in methods:
        result["minmax"] = {t: Range(lo[t], hi[t]) for t in names}
    if not hist_methods:
        return result

    # Second pass: histograms of |x| over [0, max|x|] (entropy) or of x over [lo, hi].
    edges = {m: {t: (0.0, max(abs(lo[t]), abs(hi[t]))) if m == "entropy" else (lo[t], hi[t])
                 for t in names} for m in hist_methods}
    hists = {m: {t: np.zeros(BINS, np.int64) for t in names} for m in hist_methods}
    for outs in _outputs(sess, names, feeds):
        for t, a in outs.items():
            for m in hist_methods:
                a0, a1 = edges[m][t]
                if a1 > a0:
                    # Exact zeros (ReLU's, padding's) are exact on any grid: the entropy
                    # search would only fit the grid to that spike.
                    vals = np.abs(a[a != 0]) if m == "entropy" else a
                    hists[m][t] += np.histogram(vals, BINS, (a0, a1))[0]
        step += 1
        if on_batch is not None:
            on_batch(step, total)
    for m in hist_methods:
        out = result[m] = {}
        for t in names:
            a0, a1 = edges[m][t]
            if a1 <= a0:
                out[t] = Range(lo[t], hi[t])
            elif m == "percentile":
                out[t] = _percentile_range(hists[m][t], a0, a1, percentile)
            else:
                thr = _entropy_threshold(hists[m][t], a1)
                out[t] = Range(max(lo[t], -thr), min(hi[t], thr))
    return result


def session_with(model: Model, tensors: list[str], backend: str | None):
    """A session on a copy of ``model`` that also returns ``tensors``."""
    m = clone_model(model)
    by_name = {v.name: v for _, n in m.graph.walk() for v in n.outputs if v is not None}
    by_name.update({v.name: v for v in m.graph.inputs})
    known = {v.name for v in m.graph.outputs}
    names = [t for t in tensors if t in by_name]
    for t in names:
        if t not in known:
            m.graph.outputs.append(by_name[t])
            known.add(t)
    # Unoptimized: the optimizer may fuse a Conv with its Relu, and the tensor between
    # them is what is being measured.
    return open_session(m, backend, optimize=False), names


def _outputs(sess, names: list[str], feeds: Iterable[dict]):
    for feed in feeds:
        yield dict(zip(names, sess.run(names, feed)))


def _percentile_range(hist: np.ndarray, a0: float, a1: float, pct: float) -> Range:
    cdf = np.cumsum(hist) / max(hist.sum(), 1)
    tail = (100.0 - pct) / 200.0  # split between the two ends
    width = (a1 - a0) / BINS
    i_lo = int(np.searchsorted(cdf, tail))
    i_hi = int(np.searchsorted(cdf, 1.0 - tail))
    return Range(a0 + i_lo * width, a0 + min(i_hi + 1, BINS) * width)


def _entropy_threshold(hist: np.ndarray, amax: float, levels: int = 128) -> float:
    """The |x| threshold minimizing KL(P || Q), P the histogram clipped at the threshold
    (what lies beyond piled into its last bin), Q that histogram merged into ``levels``
    levels and spread back evenly over the bins that held values."""
    hist = hist.astype(np.float64)
    width = amax / BINS
    best, best_i = np.inf, BINS
    for i in range(levels, BINS + 1, 16):
        p = hist[:i].copy()
        p[-1] += hist[i:].sum()  # what clipping at bin i saturates piles up there
        nonzero = p > 0
        bounds = np.arange(levels + 1) * i // levels
        # Q is the clipped histogram without the saturated tail, on ``levels`` levels.
        sums = np.add.reduceat(hist[:i], bounds[:-1])
        counts = np.add.reduceat(nonzero.astype(np.float64), bounds[:-1])
        per_bin = np.repeat(sums / np.maximum(counts, 1), np.diff(bounds))
        q = np.where(nonzero, per_bin, 0.0)
        ps, qs = p.sum(), q.sum()
        if ps == 0 or qs == 0:
            continue
        pn, qn = p[nonzero] / ps, q[nonzero] / qs
        kl = float(np.sum(pn * np.log(pn / np.maximum(qn, 1e-12))))
        if kl < best:
            best, best_i = kl, i
    return best_i * width
