"""``kiln.quantize``: one call that plans, calibrates, rewrites and measures."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import OptionError
from kiln.ir import DType, Model
from kiln.onnxio import save
from kiln.onnxio.exporter import register_converter
from kiln.passes import FoldConstants
from kiln.passes.base import clone_model
from kiln.passes.dce import DeadCodeElimination
from kiln.passes.fuse_batchnorm import FuseBatchNorm
from kiln.passes.infer_shapes import infer_model
from kiln.quantize import qdq, weight_only
from kiln.quantize.bias import correct_biases
from kiln.quantize.budget import Budget
from kiln.quantize.calibrate import METHODS, calibrate, calibrate_all, load_feeds
from kiln.quantize.cpu import weight_range
from kiln.quantize.engines import ONNXRUNTIME, engines, integer_engines, open_session
from kiln.quantize.fp16 import as_model, at_opset, log_of_power, standard_ops
from kiln.quantize.outliers import measure_noise
from kiln.quantize.report import (
    QuantizeReport,
    compare,
    latency_ms,
    model_bytes,
    output_errors,
    outputs_of,
)
from kiln.quantize.smooth import smooth
from kiln.quantize.speed import (
    LayerTiming,
    one_sample,
    slowest,
    time_layers,
    whole_model_ms,
)
from kiln.runtime.backends import default_backend_name

__all__ = ["MODES", "Budget", "Quantized", "quantize"]

MODES = ("dynamic", "static", "weight-only")
SMOOTH_ALPHAS = (0.5, 0.8)
"""SmoothQuant strengths tried (static, ``smooth_alpha="auto"``): by the accuracy budget,
in order, and on a transformer-like model against no migration. Every layer quantized:
PaddleOCR's v4 recognizer reads 72.5% of lines like fp32 at 0.5, 60% at 0.8 and 50%
without; a MiniLM encoder keeps 82% of nearest neighbours at 0.5, 91% at 0.8 and 80.5%
without (docs/quantization.md)."""
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
             max_noise: float | None = None, smooth_alpha: float | str | None = "auto",
             bits: int = 4,
             block_size: int = 128, budget: Budget | str | None = None,
             budget_seconds: float = 600.0,
             backend: str | None = None, measure_latency: bool = True,
             bias_correction: bool = True,
             speed_aware: bool | None = None,
             on_batch: Callable[[int, int], None] | None = None,
             on_stage: Callable[[str], None] | None = None) -> Quantized:
    """Quantize ``model`` (a path, bytes, ModelProto or Kiln Model) in QDQ format.

    ``mode``: ``"static"`` (int8 weights and activations, scales from ``calibration``),
    ``"dynamic"`` (int8 weights, activation scales computed at run time) or
    ``"weight-only"`` (MatMul weights int4/int8 in blocks of ``block_size``, ``bits``).
    ``calibration``: an ``.npz`` path (keys = input names), a feed dict or an iterable of
    feeds; required for static. ``method``: ``minmax``, ``percentile``, ``entropy`` or
    ``auto`` (per tensor, the one whose grid puts the least measured noise into the
    layers reading it, :mod:`kiln.quantize.outliers`). ``max_noise`` (static; e.g.
    ``0.02``): a Conv/MatMul/Gemm whose measured noise ratio (the noise its 8-bit input
    and weights add to its output, over the output's power, per sample) exceeds it is
    kept in float, the report says so with the figure. Neither is the default: on the
    trained models measured (docs/quantization.md) they did not beat minmax.
    ``smooth_alpha`` (static; e.g. ``0.5``): SmoothQuant-style migration before
    calibration (:mod:`kiln.quantize.smooth`): each Conv/MatMul/Gemm's input channels are
    divided by ``s_j = max|x_j|^alpha / max|W_j|^(1-alpha)`` and its weights multiplied by
    it, the division folded into what produces the input where that is exact (else a
    float Mul in front); the report lists the layers and how. ``"auto"`` (default): on a
    model that looks like a transformer (a MatMul of two computed tensors and a Softmax),
    none, 0.5 and 0.8 are each tried with every planned layer quantized and the one whose
    outputs are nearest the float model's on the check feeds (mean |error| over mean
    |output|) is kept, the report says which and the figures (two trained transformers
    measured: the best strength differs, 0.5 and 0.8, and each beat none by 10-22
    points, docs/quantization.md); elsewhere none: on seven CNN and LSTM models it moved
    task agreement by -6 to +1 points, and the least output error (0.5 on silero's
    sequence VAD) was the 6-point loss. ``None``: no migration.
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
    latency, speed-aware timing. Engines round quantized layers differently, so a budget
    holds where it was measured: measure on the engine the file will run on. ``None``
    (default): the backend a default ``kiln.InferenceSession`` runs the file on
    (:func:`kiln.runtime.backends.default_backend_name`: ``torch`` where PyTorch is
    installed); the report says which, and that it was the default.
    ``budget`` (a :class:`Budget` or ``"rel=0.01"``/``"top1=0.995"``): accuracy-aware
    mode: cheaper fixes first (8-bit weights, per-channel weights, percentile or entropy
    calibration), then layers go back to float, most sensitive first (ranked once by
    measurement), fewest that meet the budget found by doubling and bisection; it stops
    after ``budget_seconds`` with the best model found. The report lists what it tried.
    ``speed_aware``: time every quantized Conv/ConvTranspose/MatMul/Gemm alone, float and
    quantized, on ``backend`` on this machine (:mod:`kiln.quantize.speed`) and keep in
    float those whose quantized version was not faster; the first feed is timed as given
    and, where it holds many samples, cut to one (:func:`kiln.quantize.speed.one_sample`):
    a layer stays quantized only if faster at both; the report lists the worse times.
    ``None`` (default): on for the engines with integer kernels (``torch``,
    ``onnxruntime``, so with the default ``backend`` wherever PyTorch is installed)
    wherever there is data to time on (static mode always; the others with
    ``calibration`` or ``validation``), so that the INT8 file is never slower layer by
    layer than the float one where it is to run; off on ``numpy``, which computes
    quantized layers in float (every one measured slower: the file would come back
    float), the report says so. ``False`` quantizes every layer the plan allows, for size.
    ``bias_correction`` (static): each quantized Conv/Gemm's mean output shift per
    channel, measured against the float model on the check feeds one layer at a time in
    run order, is taken out of its int32 bias (:mod:`kiln.quantize.bias`); the report's
    notes say how many. On the trained models measured it gained up to 12.5 points and
    lost none beyond noise (docs/quantization.md).
    ``on_batch(done, total)`` follows calibration (a progress bar hooks in);
    ``on_stage(text)`` is called as each stage starts (loading, calibrating, ...).
    """
    stage = on_stage or (lambda text: None)
    if isinstance(budget, str):
        budget = Budget.parse(budget)
    # Measured where a default session will run the file: speed-aware decisions, the
    # accuracy figures and the budget hold there (on NumPy, the reference, quantized
    # layers run in float and a default torch session then ran every layer as int8:
    # slower than fp32 on 6 of 11 trained models, docs/performance.md).
    asked = backend
    backend = backend or default_backend_name()
    if backend not in engines():
        raise OptionError(f"unknown backend {backend!r} to measure on; choose one of "
                          f"{', '.join(engines())}")
    if mode not in MODES:
        raise OptionError(f"unknown quantization mode {mode!r}; choose one of "
                          f"{', '.join(MODES)}")
    if isinstance(smooth_alpha, str) and smooth_alpha != "auto":
        raise OptionError(f"smooth_alpha={smooth_alpha!r}: give a strength (0..1), 'auto' "
                          "or None")
    stage("loading the model")
    wrange = weight_range(reduce_range)
    # Kiln's fused ops (kiln.optimize's output) are expanded into standard ops first, so
    # every Conv/MatMul/Gemm inside them is planned like any other (a session fuses the
    # quantized layers again); those without a standard body are counted as kept.
    original, opaque = standard_ops(as_model(model))
    infer_model(original)
    notes: list[str] = []
    if mode == "weight-only":
        base = at_opset(original, 21)
    elif per_channel and original.opset < 13:
        # A scale per channel is DequantizeLinear's axis, which opset 13 added: below it
        # every weight got one scale, silently (PaddleOCR's v4 recognizer, opset 12: 0%
        # of lines read like fp32; converted first, per-channel, 12.5%).
        try:
            base = at_opset(original, 13)
            notes.append(f"per-channel weights need opset 13 (DequantizeLinear's axis): "
                         f"the model (opset {original.opset}) was converted to opset 13")
        except Exception as e:  # ONNX's converter lacks some adapters (it raises its own)
            base = as_model(original)
            notes.append(f"per-tensor weights: per-channel needs opset 13 and converting "
                         f"this opset-{original.opset} model failed "
                         f"({type(e).__name__}: {str(e)[:80]})")
    else:
        base = as_model(original)
    # Constant nodes (Clip's bounds, exporters' scalars) become initializers: a layer
    # reading one is then quantized like one reading a constant, not left in float as if
    # it read a computed tensor.
    FoldConstants()(base)
    # An inference BatchNormalization after a quantized Conv stayed a float layer between
    # a DequantizeLinear and a QuantizeLinear (PaddleOCR's classifier: 35 of them, a
    # fifth of its INT8 run on torch); folded first, its Conv is quantized with it.
    FuseBatchNorm()(base)
    # Folding leaves what it folded from behind, in If/Loop bodies too (silero's VAD: an
    # LSTM's weights next to their folded Concat and Slices, 5.44 MB written for 2.33).
    DeadCodeElimination()(base)
    infer_model(base)
    inputs = [v.name for v in base.graph.inputs]
    feeds = load_feeds(calibration, inputs) if calibration is not None or mode == "static" \
        else []
    exclude = set(exclude)
    types = tuple(op_types) if op_types is not None else \
        qdq.COMPUTE_OPS + qdq.ELEMENTWISE_OPS + qdq.EMBEDDING_OPS
    # A log of a power spans many decades: the 8-bit grid zeroes its small magnitudes and
    # the logarithm spreads them out again (openWakeWord's log-mel front end, every layer
    # quantized: 45 dB off at the median, docs/quantization.md).
    log_kept = {} if mode == "weight-only" else {
        _label(n): f"feeds the logarithm {log} of a power ({power}): an 8-bit grid zeroes "
                   "the small magnitudes the logarithm spreads out again"
        for n, (log, power) in log_of_power(base, set(base.graph.nodes)).items()
        if n.op_type in types and _label(n) not in exclude}
    exclude |= set(log_kept)
    ranges = None
    outlier_kept: dict[str, str] = {}
    asked_base = base

    def smoothed(alpha: float) -> tuple[Model, set[str], dict[str, str]]:
        """A copy of ``base`` with activation range migrated into the weights
        (:mod:`kiln.quantize.smooth`), the float Muls it inserted, what it did."""
        stage(f"migrating activation outliers into the weights (SmoothQuant, alpha "
              f"{alpha:g})")
        b = as_model(asked_base)
        plan = qdq.plan_layers(b, mode, types, exclude)
        done = smooth(b, [n for n in plan.quantized if n.op_type in qdq.COMPUTE_OPS],
                      feeds, alpha, backend, plan.quantized)
        infer_model(b)
        return b, set(done.inserted), done.layers

    def tensors_of(b: Model, skip: set[str]) -> list[str]:
        """The float tensors a static plan of ``b`` quantizes (what calibration reads)."""
        plan = qdq.plan_layers(b, mode, types, skip)
        return sorted({v.name for n in plan.quantized if n.op_type not in qdq.EMBEDDING_OPS
                       for v in list(n.inputs) + list(n.outputs)
                       if v is not None and v.const is None and v.dtype == DType.FLOAT})

    def build(skip: set[str], how: Setting | None = None) -> tuple[Model, qdq.Plan]:
        how = how or setting
        m = as_model(how.base or base)
        if mode == "weight-only":
            plan = weight_only.plan_weight_only(m, skip)
            weight_only.rewrite_weight_only(m, plan, block_size, bits)
        else:
            plan = qdq.plan_layers(m, mode, types, skip | how.skip)
            qdq.rewrite(m, plan, mode, how.ranges, how.per_channel, symmetric, how.bits,
                        float_ends=backend != ONNXRUNTIME)
        return m, plan

    check = (load_feeds(validation, inputs) if validation is not None else feeds)[:REPORT_FEEDS]
    smooth_notes: dict[str, str] = {}
    exclude_added: set[str] = set()
    tried: dict[float | None, tuple[Model, set[str], dict[str, str]]] = {}

    def choose_strength() -> float | None:
        """The SmoothQuant strength (None: none) whose file, every planned layer quantized
        on minmax ranges, is nearest the float model on the check feeds; a note says so."""
        stage("choosing SmoothQuant's strength by measured output error")
        reference = outputs_of(base, check, backend)  # once, not per strength
        errors = {}
        for alpha in (None, *SMOOTH_ALPHAS):
            b, skip, _ = tried[alpha] = smoothed(alpha) if alpha is not None else \
                (base, set(), {})
            ranges = calibrate(b, tensors_of(b, exclude | skip), feeds, "minmax", percentile,
                               backend)
            trial, _ = build(exclude, Setting("", ranges, per_channel, wrange.bits, base=b,
                                              skip=frozenset(skip)))
            errors[alpha] = max(e.mean_rel for e in compare(reference, trial, check,
                                                            backend).values())
        best = min(errors, key=errors.get)
        notes.append(f"SmoothQuant {'off' if best is None else f'at alpha {best:g}'}, chosen "
                     "by mean output error against the float model, every planned layer "
                     "quantized: " + ", ".join(f"{e:.3g} {'without' if a is None else f'at {a:g}'}"
                                               for a, e in errors.items()))
        return best

    auto_smooth = smooth_alpha == "auto"
    if auto_smooth:
        smooth_alpha = choose_strength() if mode == "static" and budget is None and check \
            and _looks_like_transformer(base) else None
    if mode == "static" and smooth_alpha is not None:
        base, exclude_added, smooth_notes = tried.get(smooth_alpha) or smoothed(smooth_alpha)
        exclude = exclude | exclude_added
    if mode == "static":
        plan = qdq.plan_layers(base, mode, types, exclude)
        tensors = tensors_of(base, exclude)
        stage(f"calibrating on {len(feeds)} batch(es) on {backend}")
        if method not in METHODS + ("auto",):
            raise OptionError(f"unknown calibration method {method!r}; choose one of "
                              f"{', '.join(METHODS)} or auto")
        methods = METHODS if method == "auto" else (method,)
        candidates = calibrate_all(base, tensors, feeds, methods, percentile, backend,
                                   on_batch)

        def measured(limit: float) -> tuple[dict, dict[str, str]]:
            """Ranges with each tensor's method chosen by measured noise, and the layers
            over ``limit`` (module kiln.quantize.outliers)."""
            stage("measuring each layer's quantization noise")
            noisy = measure_noise(base, plan, feeds, candidates, symmetric, wrange.bits,
                                  per_channel, backend, limit)
            chosen = dict(candidates[methods[0]])
            chosen.update({t: candidates[k][t] for t, k in noisy.method.items()})
            return chosen, noisy.keep

        ranges = dict(candidates[methods[0]])
        if max_noise is not None or method == "auto":
            ranges, keep = measured(np.inf if max_noise is None else max_noise)
            outlier_kept = {n: why for n, why in keep.items() if n not in exclude}
            exclude = exclude | set(outlier_kept)

    setting = Setting("as asked", ranges, per_channel, wrange.bits)

    def alternatives() -> list[Setting]:
        """Cheaper fixes than reverting layers, cheapest first (see _meet_budget)."""
        alts = []
        if mode == "weight-only":
            return alts
        if setting.bits == 7:
            alts.append(Setting("8-bit weights", ranges, setting.per_channel, 8))
        if not setting.per_channel:
            alts.append(Setting("per-channel weights", ranges, True, setting.bits))
        if mode == "static":
            # SmoothQuant before the other calibration methods: it costs one pass of
            # extremes, their histograms and entropy searches cost far more (PaddleOCR's
            # recognizer: 510 s for both at load 23, then SmoothQuant came out best)
            if auto_smooth:
                for alpha in SMOOTH_ALPHAS:
                    alts.append(Setting(f"SmoothQuant migration (alpha {alpha:g}), {method} "
                                        "calibration", None, setting.per_channel,
                                        setting.bits, method if method != "auto" else
                                        "minmax", smooth=alpha))
            for other in METHODS + ("auto",):
                if other != method:
                    label = "each tensor's calibration method chosen by measured noise" \
                        if other == "auto" else f"{other} calibration"
                    alts.append(Setting(label, None, setting.per_channel, setting.bits,
                                        other))
        return alts

    def ranges_by(how: Setting) -> Setting:
        if how.smooth is not None and how.base is None:
            how.base, skip, how.notes = smoothed(how.smooth)
            how.skip = frozenset(skip)
            stage(f"accuracy budget: calibrating with {how.method}")
            how.ranges = calibrate(how.base, tensors_of(how.base, exclude | skip), feeds,
                                   how.method, percentile, backend)
        if how.ranges is None and how.method is not None:
            # every method at once: one histogram pass serves them all
            missing = tuple(k for k in METHODS if k not in candidates)
            if missing:
                stage(f"accuracy budget: calibrating with {', '.join(missing)}")
                candidates.update(calibrate_all(base, tensors, feeds, missing, percentile,
                                                backend))
            how.ranges = measured(np.inf)[0] if how.method == "auto" else \
                candidates[how.method]
        return how

    stage("quantizing")
    m, plan = build(exclude)
    reverted: dict[str, str] = {}
    if budget is not None:
        if not check:
            raise OptionError("an accuracy budget needs data to check it on: give "
                              "calibration or validation feeds")
        stage(f"meeting the accuracy budget ({budget})")
        search = _meet_budget(original, build, exclude, budget, check, backend,
                              [ranges_by, alternatives], budget_seconds)
        m, plan, reverted = search.model, search.plan, search.reverted
        setting = search.how or setting  # what build() uses from here on
    timings: dict[str, LayerTiming] = {}
    speed_note = []
    if speed_aware is None:
        fast = integer_engines()
        speed_aware = bool(check) and mode != "weight-only" and backend in fast
        if mode != "weight-only" and backend not in fast:
            speed_note = [f"speed-aware off on {backend}, which runs quantized layers in "
                          "float (slower than the float model); to keep in float what "
                          "is slower where the file will run, pass backend="
                          f"{' or '.join(repr(e) for e in fast)}"]
    if speed_aware and mode != "weight-only":
        if not check:
            raise OptionError("speed-aware quantization times layers on real inputs: give "
                              "calibration or validation feeds")
        by_name = {n.name: n for n in (setting.base or base).graph.nodes if n.name}
        layers = [by_name[n.name] for n in plan.quantized
                  if n.op_type in qdq.COMPUTE_OPS and n.name in by_name]
        timed_on = setting.base or base
        # the feed as given, and one sample of it: a file run at batch 1 and at the
        # calibration batch is to be faster at both
        feeds_t = [check[0]]
        one = one_sample(timed_on, check[0])
        if one is not None:
            try:
                open_session(timed_on, backend).run(None, one)
                feeds_t.append(one)
            except Exception:  # a batch tied across inputs (silero's state): as given only
                pass
        stage(f"timing {len(layers)} layers float and quantized on {backend}"
              + (" (calibration batch and batch 1)" if len(feeds_t) > 1 else ""))
        timings = slowest([time_layers(timed_on, m, layers, f, backend) for f in feeds_t])
        slower = {name: f"reverted to float, speed-aware: {t.quant_ms:.3f} ms quantized vs "
                        f"{t.float_ms:.3f} ms float on {backend}"
                  for name, t in timings.items() if not t.faster}
        if slower:
            reverted.update(slower)
            m, plan = build(exclude | set(reverted))
        left = [n.name for n in plan.quantized if n.op_type in qdq.COMPUTE_OPS and n.name]
        if left:
            # Layers timed alone miss what lies between them (a chain broken by a
            # reverted neighbour pays Q/DQ both sides): the whole model decides last.
            stage(f"timing the whole model float and quantized on {backend}")
            for f in feeds_t:
                # against the float model as loaded: a smoothed copy carries float Muls
                # that only the quantized file needs
                f_ms, q_ms = whole_model_ms(asked_base, m, f, backend)
                if q_ms >= f_ms:
                    at = "" if f is check[0] else " at batch 1"
                    reverted.update({name: f"reverted to float, speed-aware: the model with "
                                           f"{len(left)} layer(s) quantized ran in {q_ms:.3f} "
                                           f"ms vs {f_ms:.3f} ms float on {backend}{at}"
                                     for name in left})
                    m, plan = build(exclude | set(reverted))
                    break
    if mode == "static" and bias_correction and check:
        stage(f"correcting each layer's mean output shift on {backend}")
        before = clone_model(m)  # arrays shared: the correction replaces, never writes
        shifted, sites = correct_biases(setting.base or base, m, check, backend)
        if shifted and budget is not None:
            # the budget was met without it: the correction stays only if it still holds
            reference = outputs_of(original, check, backend)
            if _shortfall(budget, reference, m, check, backend) > \
                    _shortfall(budget, reference, before, check, backend):
                m, shifted = before, {}
                notes.append("bias correction undone: the accuracy budget held less well "
                             "with it on the check feeds")
        if shifted:
            worst = max(shifted, key=shifted.get)
            notes.append(f"bias correction: {len(shifted)} of {sites} layer(s)' int32 biases "
                         f"take out their measured mean output shift (largest: {worst}, "
                         f"{shifted[worst]:.1%} of its mean |output|)")
    report = QuantizeReport(mode=mode, size_before=model_bytes(original),
                            size_after=model_bytes(m), backend=backend,
                            backend_why="as asked (backend=)" if asked else
                            "the backend a default kiln.InferenceSession runs the file on",
                            quantized=[_label(n) for n in plan.quantized],
                            kept={**{k: v for k, v in plan.kept.items()
                                     if k not in setting.skip and k not in exclude_added},
                                  **log_kept, **outlier_kept, **reverted,
                                  **{name: "a Kiln op with no standard-ONNX body"
                                     for name in opaque},
                                  **{_label(n): "inside a subgraph (If/Loop/Scan body): "
                                                "not quantized"
                                     for g, n in base.graph.walk()
                                     if g is not base.graph and n.op_type in qdq.COMPUTE_OPS}},
                            layer_times={k: (t.float_ms, t.quant_ms) for k, t in timings.items()},
                            weight_bits=None if mode == "weight-only" else setting.bits,
                            weight_bits_reason=wrange.reason,
                            budget_log=search.log if budget is not None else [],
                            smoothed=smooth_notes if setting.base is None else
                            setting.notes,
                            notes=notes, advice=_advice(base, mode) + speed_note)
    if TRANSFORMER_ADVICE in report.advice:
        # The report alone is easy to miss, and the loss is large: say it where it happens.
        warnings.warn(f"kiln.quantize(static): {TRANSFORMER_ADVICE}", UserWarning,
                      stacklevel=2)
    if check:
        stage(f"measuring the error on {backend}")
        report.outputs = compare(original, m, check, backend)
        report.samples = sum(len(next(iter(f.values()))) for f in check)
        if measure_latency:
            stage(f"timing the model before and after on {backend}")
            report.latency_before_ms = latency_ms(original, check[0], backend)
            report.latency_after_ms = latency_ms(m, check[0], backend)
    return Quantized(m, report)


@dataclass
class Setting:
    """One way to quantize: activation ranges, weight granularity and bits."""

    label: str
    ranges: dict | None
    per_channel: bool
    bits: int
    method: str | None = None
    """Calibration method whose ranges are to be computed on first use (ranges None)."""
    smooth: float | None = None
    """SmoothQuant's alpha: quantize a smoothed copy of the model (made on first use)."""
    base: Model | None = None
    """The model this setting quantizes (None: the one loaded)."""
    skip: frozenset = frozenset()
    """Nodes the setting added that stay float (the smoothing Muls)."""
    notes: dict = field(default_factory=dict)
    """Per smoothed layer, how (:func:`kiln.quantize.smooth.smooth`)."""


@dataclass
class _Search:
    model: Model
    plan: qdq.Plan
    reverted: dict[str, str]
    log: list[str]
    how: Setting | None = None
    """The setting that won (None: as asked)."""


def _meet_budget(original: Model, build, exclude: set[str], budget: Budget, check: list,
                 backend: str, setting_fns, seconds: float) -> _Search:
    """Find a quantized model within ``budget``, cheapest change first, within ``seconds``.

    1. The model as asked; then each alternative setting (8-bit weights, per-channel
       weights, other calibration methods): the first that meets the budget wins, the
       one with the smallest shortfall is kept for what follows.
    2. Each layer's sensitivity, measured once: the shortfall with that layer alone
       quantized. When every layer alone breaks the budget, no INT8 setting tried can
       meet it: the float model comes back at once, and the log says so.
    3. The k most sensitive layers reverted, k = 1, 2, 4, ... until the budget holds,
       then bisection for the smallest such k.
    The search stops when ``seconds`` have passed and returns the best model seen (the
    log says the budget was not met)."""
    resolve, alternatives = setting_fns
    t0 = time.perf_counter()
    log: list[str] = []

    def over() -> bool:
        return time.perf_counter() - t0 > seconds

    reference = outputs_of(original, check, backend)  # once, not per candidate

    def score(m: Model) -> float:
        return _shortfall(budget, reference, m, check, backend)

    def measure(skip: set[str], how, what: str):
        m, plan = build(skip, how)
        gap = score(m)
        log.append(f"{what}: shortfall {gap:.3g} ({time.perf_counter() - t0:.1f} s)")
        return gap, m, plan

    gap, m, plan = measure(exclude, None, "as asked")
    best = (gap, m, plan, None, {})
    if gap == 0:
        return _Search(m, plan, {}, log)
    for how in alternatives():
        if over():
            break
        g, m2, p2 = measure(exclude, resolve(how), how.label)
        if g < best[0]:
            best = (g, m2, p2, how, {})
        if g == 0:
            log.append(f"budget met by {how.label}, no layer reverted")
            return _Search(m2, p2, {}, log, how)
    how = best[3]
    names = [n.name for n in best[2].quantized
             if n.op_type in qdq.COMPUTE_OPS + qdq.EMBEDDING_OPS and n.name]
    # Sensitivity: the shortfall with that layer alone quantized. (With the model far
    # outside the budget, one layer back in float changes almost nothing and ranks
    # nothing: PaddleOCR's recognizer reads 0% of lines like fp32 with any one of its
    # layers reverted, while most of its layers alone cost 6-38% of lines.)
    alone: dict[str, float] = {}
    for name in names:
        if over():
            log.append(f"time budget ({seconds:.0f} s) spent ranking: {len(alone)} of "
                       f"{len(names)} layers ranked")
            break
        trial, _ = build(exclude | (set(names) - {name}), how)
        alone[name] = score(trial)
    order = sorted(names, key=lambda n: -alone.get(n, float("inf")))
    if alone:
        top = ", ".join(f"{n} ({alone[n]:.3g})" for n in order[:3] if n in alone)
        log.append(f"ranked {len(alone)} layers by sensitivity once (shortfall with "
                   f"each alone quantized); most sensitive: {top}")
    if alone and len(alone) == len(names) and min(alone.values()) > 0:
        floor = min(alone, key=alone.get)
        log.append(f"no INT8 setting tried keeps this model within the budget: each of its "
                   f"{len(names)} layers alone quantized breaks it (the least, {floor}, by "
                   f"{alone[floor]:.3g}); returning the float model "
                   f"({time.perf_counter() - t0:.1f} s)")
        why = {n: f"reverted to float for the accuracy budget ({budget}): quantized alone "
                  f"it falls short by {alone[n]:.3g}" for n in names}
        m2, p2 = build(exclude | set(why), how)
        return _Search(m2, p2, why, log, how)

    def revert(k: int):
        why = {n: f"reverted to float for the accuracy budget ({budget}): quantized alone "
                  f"it falls short by {alone[n]:.3g}" if n in alone else
                  f"reverted to float for the accuracy budget ({budget}): not ranked in time"
               for n in order[:k]}
        g, m2, p2 = measure(exclude | set(why), how, f"{k} most sensitive layer(s) in float")
        return g, m2, p2, why

    lo, hi, found = 0, None, None
    k = 1
    while k <= len(order) and not over():
        g, m2, p2, why = revert(k)
        if g < best[0]:
            best = (g, m2, p2, how, why)
        if g == 0:
            hi, found = k, (m2, p2, why)
            break
        lo = k
        k = min(2 * k, len(order)) if k < len(order) else k + 1
    while hi is not None and hi - lo > 1 and not over():
        mid = (lo + hi) // 2
        g, m2, p2, why = revert(mid)
        if g == 0:
            hi, found = mid, (m2, p2, why)
        else:
            lo = mid
    if found is not None and hi >= len(order):
        log.append(f"budget met only with every one of the {hi} quantized layer(s) in "
                   "float: no INT8 setting tried keeps this model within the budget; "
                   "this is the float model")
        return _Search(found[0], found[1], found[2], log, how)
    if found is not None:
        log.append(f"budget met with {hi} layer(s) in float"
                   + (f" and {how.label}" if how is not None else ""))
        return _Search(found[0], found[1], found[2], log, how)
    log.append(f"budget not met{' within ' + format(seconds, '.0f') + ' s' if over() else ''}"
               f"; returning the closest model (shortfall {best[0]:.3g})")
    return _Search(best[1], best[2], best[4], log, best[3])


def _shortfall(budget: Budget, reference: dict[str, list], m: Model, check: list,
               backend: str) -> float:
    """How far ``m`` falls outside ``budget`` on ``check`` against the float model's
    outputs ``reference`` (:func:`kiln.quantize.report.outputs_of`)."""
    got = outputs_of(m, check, backend)

    def runs(outs: dict[str, list]) -> list[list]:
        return [[outs[n][i] for n in outs] for i in range(len(check))]

    return budget.shortfall(output_errors(reference, {n: got[n] for n in reference}),
                            (runs(reference), runs(got)))


TRANSFORMER_ADVICE = (
    "this looks like a transformer (a MatMul of two computed tensors and a Softmax): "
    "per-tensor static activation scales lose accuracy on its outlier channels; unless "
    "smooth_alpha was given, SmoothQuant's strength was chosen by measured error (the "
    "report's notes). A trained MiniLM encoder, every layer quantized, keeps fp32's "
    "nearest neighbour for 91% of sentences so (80% without migration) and 86% with "
    "mode='dynamic', which computes a scale per run (docs/quantization.md): measure both")


def _looks_like_transformer(m: Model) -> bool:
    """A MatMul of two computed tensors and a Softmax: attention."""
    g = m.graph
    attention = any(n.op_type == "MatMul" and all(v is not None and v.const is None
                                                  for v in n.inputs[:2]) for n in g.nodes)
    return attention and any(n.op_type == "Softmax" for n in g.nodes)


def _advice(m: Model, mode: str) -> list[str]:
    """What to try instead, where the model's kind is known to suit another mode."""
    return [TRANSFORMER_ADVICE] if mode == "static" and _looks_like_transformer(m) else []


def _label(n) -> str:
    return n.name or f"{n.op_type}({n.outputs[0].name})"


# kiln.save(kiln.quantize(...), path) writes the quantized model, as Quantized.save does.
register_converter(lambda obj: obj.model if isinstance(obj, Quantized) else None)
