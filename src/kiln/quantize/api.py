"""``kiln.quantize``: one call that plans, calibrates, rewrites and measures."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kiln.errors import OptionError
from kiln.ir import DType, Model
from kiln.onnxio import save
from kiln.onnxio.exporter import register_converter
from kiln.passes import FoldConstants
from kiln.passes.infer_shapes import infer_model
from kiln.quantize import qdq, weight_only
from kiln.quantize.calibrate import calibrate, load_feeds
from kiln.quantize.cpu import weight_range
from kiln.quantize.engines import BACKENDS
from kiln.quantize.fp16 import as_model, at_opset, standard_ops
from kiln.quantize.report import QuantizeReport, compare, latency_ms, model_bytes
from kiln.quantize.speed import LayerTiming, time_layers

__all__ = ["MODES", "Budget", "Quantized", "quantize"]

MODES = ("dynamic", "static", "weight-only")
# How many feeds the report's accuracy check runs at most.
REPORT_FEEDS = 8


@dataclass
class Quantized:
    """A quantized model and the report of what quantizing it did."""

    model: Model
    report: QuantizeReport

    def save(self, path: str | os.PathLike) -> None:
        """Write the quantized model as an ONNX file."""
        save(self.model, path)

    def __str__(self) -> str:
        return str(self.report)


def quantize(model, mode: str = "static", calibration=None, *, method: str = "minmax",
             per_channel: bool = True, symmetric: bool = False,
             op_types: Iterable[str] | None = None, exclude: Iterable[str] = (),
             reduce_range: bool | None = None, validation=None, percentile: float = 99.99,
             bits: int = 4,
             block_size: int = 128, budget: Budget | str | None = None,
             backend: str = "numpy", measure_latency: bool = True,
             speed_aware: bool = False,
             on_batch: Callable[[int, int], None] | None = None,
             on_stage: Callable[[str], None] | None = None) -> Quantized:
    """Quantize ``model`` (a path, bytes, ModelProto or Kiln Model) in QDQ format.

    ``mode``: ``"static"`` (int8 weights and activations, scales from ``calibration``),
    ``"dynamic"`` (int8 weights, activation scales computed at run time) or
    ``"weight-only"`` (MatMul weights int4/int8 in blocks of ``block_size``, ``bits``).
    ``calibration``: an ``.npz`` path (keys = input names), a feed dict or an iterable of
    feeds; required for static. ``method``: ``minmax``, ``percentile`` or ``entropy``.
    ``symmetric``: int8 activations around 0 instead of uint8 with a zero point.
    ``reduce_range``: weights in -63..63, so that no pair of 8-bit x int8 products
    overflows the 16-bit sums of x86 integer kernels without VNNI (onnxruntime's and
    fbgemm's); full-range weights give wrong results there (measured: digits CNN off by
    up to 3.5 logits uint8, 13 int8 in onnxruntime 1.32). ``None`` (default): what this
    machine's CPU needs (:func:`kiln.quantize.cpu.weight_range`: 8-bit weights with VNNI
    or on ARM, 7-bit on x86 without VNNI); the report says which and why. Quantizing for
    another machine, pass what that one needs.
    ``op_types``/``exclude``: which op types to consider / layer names or op types to keep
    in float. ``validation`` (default: the calibration data) is what the report's error
    and top-1 agreement are measured on. ``backend`` (``numpy``, ``torch`` or
    ``onnxruntime``) runs calibration and every measurement: error, top-1, the budget,
    latency. Engines round quantized layers differently, so a budget holds where it was
    measured: measure on the engine the file will run on.
    ``budget`` (a :class:`Budget` or ``"rel=0.01"``/``"top1=0.995"``): accuracy-aware
    mode; layers go back to float, most sensitive first, until the quantized model is
    within the budget on the validation data (the report says which, and why).
    ``speed_aware``: time every quantized Conv/ConvTranspose/MatMul/Gemm alone, float and
    quantized, on ``backend`` on this machine (:mod:`kiln.quantize.speed`) and keep in
    float those whose quantized version was not faster; the report lists the times.
    ``on_batch(done, total)`` follows calibration (a progress bar hooks in);
    ``on_stage(text)`` is called as each stage starts (loading, calibrating, ...).
    """
    stage = on_stage or (lambda text: None)
    if isinstance(budget, str):
        budget = Budget.parse(budget)
    if backend not in BACKENDS:
        raise OptionError(f"unknown backend {backend!r} to measure on; choose one of "
                          f"{', '.join(BACKENDS)}")
    if mode not in MODES:
        raise OptionError(f"unknown quantization mode {mode!r}; choose one of "
                          f"{', '.join(MODES)}")
    stage("loading the model")
    wrange = weight_range(reduce_range)
    # Kiln's fused ops (kiln.optimize's output) are expanded into standard ops first, so
    # every Conv/MatMul/Gemm inside them is planned like any other (a session fuses the
    # quantized layers again); those without a standard body are counted as kept.
    original, opaque = standard_ops(as_model(model))
    infer_model(original)
    base = at_opset(original, 21) if mode == "weight-only" else as_model(original)
    # Constant nodes (Clip's bounds, exporters' scalars) become initializers: a layer
    # reading one is then quantized like one reading a constant, not left in float as if
    # it read a computed tensor.
    FoldConstants()(base)
    infer_model(base)
    inputs = [v.name for v in base.graph.inputs]
    feeds = load_feeds(calibration, inputs) if calibration is not None or mode == "static" \
        else []
    exclude = set(exclude)
    types = tuple(op_types) if op_types is not None else \
        qdq.COMPUTE_OPS + qdq.ELEMENTWISE_OPS + qdq.EMBEDDING_OPS
    ranges = None
    if mode == "static":
        plan = qdq.plan_layers(base, mode, types, exclude)
        tensors = sorted({v.name for n in plan.quantized if n.op_type not in qdq.EMBEDDING_OPS
                          for v in list(n.inputs) + list(n.outputs)
                          if v is not None and v.const is None and v.dtype == DType.FLOAT})
        stage(f"calibrating on {len(feeds)} batch(es) on {backend}")
        ranges = calibrate(base, tensors, feeds, method, percentile, backend, on_batch)

    def build(skip: set[str]) -> tuple[Model, qdq.Plan]:
        m = as_model(base)
        if mode == "weight-only":
            plan = weight_only.plan_weight_only(m, skip)
            weight_only.rewrite_weight_only(m, plan, block_size, bits)
        else:
            plan = qdq.plan_layers(m, mode, types, skip)
            qdq.rewrite(m, plan, mode, ranges, per_channel, symmetric, wrange.bits)
        return m, plan

    check = (load_feeds(validation, inputs) if validation is not None else feeds)[:REPORT_FEEDS]
    stage("quantizing")
    m, plan = build(exclude)
    reverted: dict[str, str] = {}
    if budget is not None:
        if not check:
            raise OptionError("an accuracy budget needs data to check it on: give "
                              "calibration or validation feeds")
        stage(f"meeting the accuracy budget ({budget})")
        m, plan, reverted = _meet_budget(original, build, exclude, budget, check, backend)
    timings: dict[str, LayerTiming] = {}
    if speed_aware and mode != "weight-only":
        if not check:
            raise OptionError("speed-aware quantization times layers on real inputs: give "
                              "calibration or validation feeds")
        by_name = {n.name: n for n in base.graph.nodes if n.name}
        layers = [by_name[n.name] for n in plan.quantized
                  if n.op_type in qdq.COMPUTE_OPS and n.name in by_name]
        stage(f"timing {len(layers)} layers float and quantized on {backend}")
        timings = time_layers(base, m, layers, check[0], backend)
        slower = {name: f"reverted to float, speed-aware: {t.quant_ms:.3f} ms quantized vs "
                        f"{t.float_ms:.3f} ms float on {backend}"
                  for name, t in timings.items() if not t.faster}
        if slower:
            reverted.update(slower)
            m, plan = build(exclude | set(reverted))
    report = QuantizeReport(mode=mode, size_before=model_bytes(original),
                            size_after=model_bytes(m), backend=backend,
                            quantized=[_label(n) for n in plan.quantized],
                            kept={**plan.kept, **reverted,
                                  **{name: "a Kiln op with no standard-ONNX body"
                                     for name in opaque},
                                  **{_label(n): "inside a subgraph (If/Loop/Scan body): "
                                                "not quantized"
                                     for g, n in base.graph.walk()
                                     if g is not base.graph and n.op_type in qdq.COMPUTE_OPS}},
                            layer_times={k: (t.float_ms, t.quant_ms) for k, t in timings.items()},
                            weight_bits=None if mode == "weight-only" else wrange.bits,
                            weight_bits_reason=wrange.reason)
    if check:
        stage(f"measuring the error on {backend}")
        report.outputs = compare(original, m, check, backend)
        report.samples = sum(len(next(iter(f.values()))) for f in check)
        if measure_latency:
            stage(f"timing the model before and after on {backend}")
            report.latency_before_ms = latency_ms(original, check[0], backend)
            report.latency_after_ms = latency_ms(m, check[0], backend)
    return Quantized(m, report)


@dataclass(frozen=True)
class Budget:
    """How much worse than the float model a quantized one may be, on the given data:
    ``max_rel`` bounds every output's max |error| / max |float output|, ``min_top1`` the
    fraction of rows whose argmax agrees with the float model's (0.995 bounds a top-1
    accuracy drop at 0.5 points)."""

    max_rel: float | None = None
    min_top1: float | None = None

    @classmethod
    def parse(cls, text: str) -> Budget:
        """``rel=0.01``, ``top1=0.995`` or both, comma-separated."""
        kw: dict[str, float] = {}
        for part in text.split(","):
            key, _, val = part.partition("=")
            names = {"rel": "max_rel", "top1": "min_top1"}
            try:
                kw[names[key.strip()]] = float(val)
            except (KeyError, ValueError):
                raise OptionError(f"accuracy budget {text!r}: expected rel=R and/or top1=F, "
                                  "e.g. rel=0.01 or top1=0.995") from None
        return cls(**kw)

    def shortfall(self, outputs: dict) -> float:
        """How far ``outputs`` (name -> OutputError) are outside the budget; 0 inside."""
        worst_rel = max((e.rel for e in outputs.values()), default=0.0)
        tops = [e.top1 for e in outputs.values() if e.top1 is not None]
        gap = 0.0
        if self.max_rel is not None:
            gap += max(0.0, worst_rel - self.max_rel) / max(self.max_rel, 1e-12)
        if self.min_top1 is not None and tops:
            gap += max(0.0, self.min_top1 - min(tops)) * 100
        return gap

    def __str__(self) -> str:
        parts = []
        if self.max_rel is not None:
            parts.append(f"relative error <= {self.max_rel:g}")
        if self.min_top1 is not None:
            parts.append(f"top-1 agreement >= {self.min_top1:.2%}")
        return " and ".join(parts) or "none"


def _meet_budget(original: Model, build, exclude: set[str], budget: Budget, check: list,
                 backend: str):
    """Revert compute layers to float, most sensitive first, until ``budget`` holds.

    A layer's sensitivity is how much the error shrinks when that one layer alone is
    kept in float (everything else quantized); layers are then reverted in that order,
    re-measuring after each, until the budget holds or nothing is left to revert."""
    m, plan = build(exclude)
    gap = budget.shortfall(compare(original, m, check, backend))
    if gap == 0:
        return m, plan, {}
    names = [n.name for n in plan.quantized
             if n.op_type in qdq.COMPUTE_OPS + qdq.EMBEDDING_OPS and n.name]
    gain = {}
    for name in names:
        trial, _ = build(exclude | {name})
        gain[name] = gap - budget.shortfall(compare(original, trial, check, backend))
    order = sorted(names, key=lambda n: -gain[n])
    reverted: dict[str, str] = {}
    for name in order:
        reverted[name] = (f"reverted to float for the accuracy budget ({budget}): "
                          f"keeping it in float alone cut the shortfall by {gain[name]:.3g}")
        m, plan = build(exclude | set(reverted))
        if budget.shortfall(compare(original, m, check, backend)) == 0:
            break
    return m, plan, reverted


def _label(n) -> str:
    return n.name or f"{n.op_type}({n.outputs[0].name})"


# kiln.save(kiln.quantize(...), path) writes the quantized model, as Quantized.save does.
register_converter(lambda obj: obj.model if isinstance(obj, Quantized) else None)
