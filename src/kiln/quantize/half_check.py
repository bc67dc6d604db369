"""Half precision measured against float32 on calibration data, and the layers whose
half-precision error costs an accuracy budget kept in float32.

Float16 keeps about three significant digits: an output reaching 50 has a step of 0.03,
and a long accumulation or a log of small magnitudes loses more. Whether that matters is
the task's question (openWakeWord's log-mel bins compared at 0.05 lose it; a classifier's
argmax does not), so what is decided here is decided by measurement: the converted model
runs beside the float32 one on the calibration feeds, the figures go into a warning, and
with a budget the layers adding the most error are kept in float32 until it holds.

Ranking costs one run of each model: every converted layer's output is compared with
float32's, and a layer's score is the relative error it *adds* (its output's error less
its inputs' largest), so a Conv that rounds a large accumulation ranks above the Relu
that merely passes the error on. Then the k worst stay float32 for k = 1, 2, 4, ...
until the budget holds, and bisection finds the smallest such k.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from kiln.ir import DType, Model
from kiln.quantize.budget import Budget
from kiln.quantize.calibrate import session_with
from kiln.quantize.report import OutputError, output_errors, outputs_of

__all__ = ["CHECK_FEEDS", "check_half"]

CHECK_FEEDS = 8
"""How many calibration feeds the measurement runs at most."""


def check_half(original: Model, build: Callable[[set[str]], Model], keys: list[str],
               feeds: list[dict], budget, seconds: float, backend: str | None,
               kind: str = "float16") -> tuple[set[str], list[str]]:
    """Which of ``keys`` (converted layers, by first output name) to keep in float32, and
    notes with the measured figures. ``build(kept)`` converts the model with ``kept`` in
    float32; ``original`` is the float32 model it is measured against."""
    if isinstance(budget, str):
        budget = Budget.parse(budget)
    feeds = feeds[:CHECK_FEEDS]
    t0 = time.perf_counter()
    ref = outputs_of(original, feeds, backend)
    where = backend or "Kiln's reference backend"

    def runs(outs: dict[str, list]) -> list[list]:
        return [[outs[n][i] for n in outs] for i in range(len(feeds))]

    def measure(kept: set[str]) -> tuple[float, str]:
        got = outputs_of(build(kept), feeds, backend)
        got = {n: got[n] for n in ref}
        errs = output_errors(ref, got)
        gap = budget.shortfall(errs, (runs(ref), runs(got))) if budget is not None else 0.0
        agree = (float(budget.agreement(runs(ref), runs(got)))
                 if budget is not None and budget.agreement is not None else None)
        return gap, _figures(errs, agree)

    gap, figures = measure(set())
    head = f"{kind} measured against float32 on {len(feeds)} calibration feed(s) ({where}): "
    if budget is None:
        return set(), [head + figures + "; pass budget= to keep in float32 the layers that "
                       "cost accuracy"]
    if gap == 0:
        return set(), [head + figures + f"; within the budget ({budget})"]
    order = _rank(original, build(set()), keys, feeds, backend)
    labels = _labels(original)
    best = (gap, set(), figures)
    lo, hi = 0, None
    found = None

    def over() -> bool:
        return time.perf_counter() - t0 > seconds

    def trial(k: int):
        nonlocal best
        kept = set(order[:k])
        g, f = measure(kept)
        if g < best[0]:
            best = (g, kept, f)
        return g, kept, f

    k = 1
    while k <= len(order) and not over():
        g, kept, f = trial(k)
        if g == 0:
            hi, found = k, (kept, f)
            break
        lo = k
        if k == len(order):
            break
        k = min(2 * k, len(order))
    while hi is not None and hi - lo > 1 and not over():
        mid = (lo + hi) // 2
        g, kept, f = trial(mid)
        if g == 0:
            hi, found = mid, (kept, f)
        else:
            lo = mid
    secs = time.perf_counter() - t0
    if found is not None:
        kept, f = found
        every = (" (every layer that converted: this is the float32 model)"
                 if len(kept) == len(order) else "")
        return kept, [head + figures + f"; outside the budget ({budget}), so "
                      f"{len(kept)} layer(s) adding the most error stay float32{every}: "
                      + _names([labels.get(k, k) for k in order if k in kept])
                      + f"; then: {f} ({secs:.0f} s)"]
    g, kept, f = best
    why = (f"not met within {seconds:.0f} s" if over()
           else "not met even with every layer in float32")
    return kept, [head + figures + f"; budget ({budget}) {why}: the closest kept "
                  f"{len(kept)} layer(s) float32 (" + _names([labels.get(k, k) for k in order
                                                             if k in kept])
                  + f"), then: {f}, shortfall {g:.3g} ({secs:.0f} s)"]


def _rank(original: Model, half: Model, keys: list[str], feeds: list[dict],
          backend: str | None) -> list[str]:
    """``keys`` by the relative error each layer adds in ``half``, largest first."""
    inputs = {}
    for n in original.graph.nodes:
        key = next((v.name for v in n.outputs if v is not None), None)
        if key in keys:
            inputs[key] = [v.name for v in n.inputs if v is not None and v.const is None
                           and v.dtype == DType.FLOAT]
    names = sorted(set(inputs) | {v for vs in inputs.values() for v in vs})
    ref_sess, ref_names = session_with(original, names, backend)
    half_sess, half_names = session_with(half, names, backend)
    common = [t for t in ref_names if t in set(half_names)]
    diff = dict.fromkeys(common, 0.0)
    power = dict.fromkeys(common, 0.0)
    for feed in feeds:
        r = dict(zip(common, ref_sess.run(common, feed)))
        h = dict(zip(common, half_sess.run(common, feed)))
        for t in common:
            a = np.asarray(r[t], np.float64)
            b = np.asarray(h[t], np.float64)
            if a.shape != b.shape:
                continue
            d = np.where(np.isfinite(b), b - a, np.abs(a) + 1.0)
            diff[t] += float((d * d).sum())
            power[t] += float((a * a).sum())
    err = {t: np.sqrt(diff[t] / power[t]) if power[t] > 0 else np.sqrt(diff[t])
           for t in common}
    added = {k: err.get(k, 0.0) - max((err.get(v, 0.0) for v in inputs[k]), default=0.0)
             for k in inputs}
    return sorted(added, key=lambda k: -added[k])


def _figures(errs: dict[str, OutputError], agree: float | None) -> str:
    parts = []
    for name, e in errs.items():
        part = f"{name} max |error| {e.max_abs:.3g} ({e.rel:.2%} of its largest value)"
        if e.top1 is not None:
            part += f", top-1 {e.top1:.1%}"
        parts.append(part)
    text = "; ".join(parts[:4]) + (f" and {len(parts) - 4} more output(s)"
                                   if len(parts) > 4 else "")
    return text + (f"; task agreement {agree:.1%}" if agree is not None else "")


def _labels(m: Model) -> dict[str, str]:
    out = {}
    for n in m.graph.nodes:
        key = next((v.name for v in n.outputs if v is not None), None)
        if key is not None:
            out[key] = n.name or f"{n.op_type}({key})"
    return out


def _names(items: list[str], limit: int = 8) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more"
                                       if len(items) > limit else "")
