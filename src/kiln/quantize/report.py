"""What a quantization cost and bought, measured: file size, per-output error and top-1
agreement against the float model on the given data, layers quantized and kept in float
(with the reason), and latency before and after on one backend."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from kiln.ir import Model
from kiln.onnxio import to_proto
from kiln.quantize.engines import open_session

__all__ = ["OutputError", "QuantizeReport", "compare", "latency_ms", "model_bytes",
           "output_errors", "outputs_of"]


@dataclass
class OutputError:
    """How far one output of the quantized model is from the float model's."""

    max_abs: float
    rel: float
    """max |quantized - float| / max |float|"""
    top1: float | None
    """fraction of rows whose argmax over the last axis agrees (None: not a score output)"""
    mean_rel: float = 0.0
    """mean |quantized - float| / mean |float|: the typical error, where ``rel`` is the
    worst (a few outlier values, as transformers' hidden states carry, set ``rel``)"""


@dataclass
class QuantizeReport:
    """Sizes, accuracy, layers and latency of one quantization."""

    mode: str
    size_before: int
    size_after: int
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    outputs: dict[str, OutputError] = field(default_factory=dict)
    samples: int = 0
    backend: str | None = None
    """The engine calibrated and measured on."""
    backend_why: str = ""
    """Why that engine: asked for, or the default session's backend."""
    latency_before_ms: float | None = None
    latency_after_ms: float | None = None
    layer_times: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Speed-aware mode: per layer, (float ms, quantized ms) measured alone."""
    weight_bits: int | None = None
    """INT8 weights' range: 8 (-127..127) or 7 (-63..63, reduce_range)."""
    weight_bits_reason: str = ""
    budget_log: list[str] = field(default_factory=list)
    """Accuracy-aware mode: each setting tried, its shortfall and the time so far."""
    notes: list[str] = field(default_factory=list)
    """What was changed to carry out the request (e.g. the opset raised for per-channel
    weights)."""
    advice: list[str] = field(default_factory=list)
    smoothed: dict[str, str] = field(default_factory=dict)
    """Layers whose input range was migrated into their weights (SmoothQuant), and how."""

    def worst_rel(self) -> float:
        """The largest relative error over the outputs (0 when nothing was measured)."""
        return max((e.rel for e in self.outputs.values()), default=0.0)

    def worst_top1(self) -> float | None:
        """The lowest top-1 agreement over the score outputs, or None."""
        vals = [e.top1 for e in self.outputs.values() if e.top1 is not None]
        return min(vals) if vals else None

    def __str__(self) -> str:
        mb = 1e6
        lines = [f"quantization ({self.mode}): {self.size_before / mb:.2f} MB -> "
                 f"{self.size_after / mb:.2f} MB "
                 f"({self.size_before / max(self.size_after, 1):.2f}x smaller)",
                 f"layers quantized: {len(self.quantized)}, kept in float: {len(self.kept)}"]
        if self.backend:
            lines.insert(1, f"measured on {self.backend}"
                            + (f": {self.backend_why}" if self.backend_why else ""))
        if self.weight_bits is not None:
            span = 2 ** (self.weight_bits - 1) - 1
            lines.insert(1, f"weights: {self.weight_bits}-bit (-{span}..{span}): "
                            f"{self.weight_bits_reason}")
        lines += self.notes
        for name, why in list(self.kept.items())[:20]:
            lines.append(f"  kept {name}: {why}")
        if len(self.kept) > 20:
            lines.append(f"  ... {len(self.kept) - 20} more kept")
        if self.smoothed:
            lines.append(f"SmoothQuant migration: {len(self.smoothed)} layer(s), e.g. "
                         + "; ".join(f"{k}: {v}" for k, v in list(self.smoothed.items())[:2]))
        if self.budget_log:
            lines.append("accuracy budget search:")
            lines += [f"  {line}" for line in self.budget_log]
        lines += [f"advice: {a}" for a in self.advice]
        if self.layer_times:
            lines.append(f"per-layer times on {self.backend}, float -> quantized "
                         "(speed-aware; slower ones reverted, then the whole model timed):")
            for name, (f_ms, q_ms) in self.layer_times.items():
                verdict = "reverted" if name in self.kept else "kept"
                lines.append(f"  {name}: {f_ms:.4f} ms -> {q_ms:.4f} ms ({verdict})")
        if self.outputs:
            lines.append(f"error against the float model on {self.samples} sample(s):")
            for name, e in self.outputs.items():
                top = "" if e.top1 is None else f", top-1 agreement {e.top1:.2%}"
                lines.append(f"  {name}: max abs {e.max_abs:.4g}, relative {e.rel:.2%}, "
                             f"mean relative {e.mean_rel:.2%}{top}")
        else:
            lines.append("error: not measured (no data given)")
        if self.latency_before_ms is not None and self.latency_after_ms is not None:
            ratio = self.latency_before_ms / max(self.latency_after_ms, 1e-9)
            lines.append(f"latency on {self.backend} (best of runs, first sample): "
                         f"{self.latency_before_ms:.2f} ms -> {self.latency_after_ms:.2f} ms "
                         f"({ratio:.2f}x {'faster' if ratio >= 1 else 'as fast'})")
        return "\n".join(lines)


def model_bytes(m: Model) -> int:
    """Serialized size of ``m`` in bytes."""
    return to_proto(m).ByteSize()


def compare(ref: Model | dict[str, list[np.ndarray]], quant: Model, feeds: list[dict],
            backend: str | None = None) -> dict[str, OutputError]:
    """Per-output error of ``quant`` against ``ref`` over ``feeds``; ``ref`` may be the
    float model's outputs already computed (:func:`outputs_of`), as a search comparing
    many candidates against one model does."""
    refs = ref if isinstance(ref, dict) else outputs_of(ref, feeds, backend)
    gots = outputs_of(quant, feeds, backend)
    return output_errors(refs, {n: gots[n] for n in refs})


def outputs_of(m: Model, feeds: list[dict], backend: str | None = None
               ) -> dict[str, list[np.ndarray]]:
    """Each output of ``m`` (name -> one array per feed) on ``backend``."""
    sess = open_session(m, backend)
    names = [o.name for o in sess.get_outputs()]
    outs: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feed in feeds:
        for n, r in zip(names, sess.run(None, feed)):
            outs[n].append(np.asarray(r))
    return outs


def output_errors(refs: dict[str, list[np.ndarray]], gots: dict[str, list[np.ndarray]]
                  ) -> dict[str, OutputError]:
    """Per-output error of ``gots`` against ``refs`` (output name -> one array per feed)."""
    # Statistics per feed, pooled: outputs may differ in shape between feeds (a 1-D
    # output whose length follows the input's), so they are never concatenated.
    out = {}
    for n in refs:
        diff = scale = abs_err = abs_ref = 0.0
        same = rows = 0
        mismatched = 0
        is_float = True
        for r, g in zip(refs[n], gots[n]):
            r2 = r.reshape(-1, *r.shape[-1:]) if r.ndim else r.reshape(1, 1)
            g2 = g.reshape(-1, *g.shape[-1:]) if g.ndim else g.reshape(1, 1)
            if r.dtype.kind != "f":
                is_float = False
                diff = max(diff, float(np.abs(r2.astype(np.float64) - g2).max(initial=0)))
                mismatched += int((r2 != g2).sum())
                rows += r2.size
                continue
            err = np.abs(r2 - g2)
            diff = max(diff, float(err.max(initial=0.0)))
            scale = max(scale, float(np.abs(r2).max(initial=0.0)))
            abs_err += float(err.sum(dtype=np.float64))
            abs_ref += float(np.abs(r2).sum(dtype=np.float64))
            if r.ndim > 1 and r2.shape[-1] > 1:  # a 1-D output is no row of scores
                same += int((r2.argmax(-1) == g2.argmax(-1)).sum())
                rows += r2.shape[0]
        if not is_float:
            out[n] = OutputError(diff, mismatched / rows if rows else 0.0, None)
            continue
        top1 = same / rows if rows else None
        out[n] = OutputError(diff, diff / scale if scale > 0 else diff, top1,
                             abs_err / abs_ref if abs_ref > 0 else abs_err)
    return out


def latency_ms(m: Model, feed: dict, backend: str | None = None, runs: int = 5) -> float:
    """Best-of-``runs`` wall time of one run of ``m`` on ``feed`` (after a warm-up)."""
    sess = open_session(m, backend)
    sess.run(None, feed)
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        sess.run(None, feed)
        best = min(best, time.perf_counter() - t0)
    return best * 1e3
