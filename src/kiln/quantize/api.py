"""``kiln.quantize``: one call that plans, calibrates, rewrites and measures."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import onnx.version_converter

from kiln.errors import OptionError
from kiln.ir import DType, Model
from kiln.onnxio import load, save, to_proto
from kiln.passes.infer_shapes import infer_model
from kiln.quantize import qdq, weight_only
from kiln.quantize.calibrate import calibrate, load_feeds
from kiln.quantize.fp16 import as_model
from kiln.quantize.report import QuantizeReport, compare, latency_ms, model_bytes

__all__ = ["MODES", "Quantized", "quantize"]

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
             reduce_range: bool = True, validation=None, percentile: float = 99.99,
             bits: int = 4,
             block_size: int = 128, backend: str = "numpy", measure_latency: bool = True,
             on_batch: Callable[[int, int], None] | None = None) -> Quantized:
    """Quantize ``model`` (a path, bytes, ModelProto or Kiln Model) in QDQ format.

    ``mode``: ``"static"`` (int8 weights and activations, scales from ``calibration``),
    ``"dynamic"`` (int8 weights, activation scales computed at run time) or
    ``"weight-only"`` (MatMul weights int4/int8 in blocks of ``block_size``, ``bits``).
    ``calibration``: an ``.npz`` path (keys = input names), a feed dict or an iterable of
    feeds; required for static. ``method``: ``minmax``, ``percentile`` or ``entropy``.
    ``symmetric``: int8 activations around 0 instead of uint8 with a zero point.
    ``reduce_range``: weights in -63..63, so that no pair of 8-bit x int8 products
    overflows the 16-bit sums of AVX2 integer kernels without VNNI (onnxruntime's and
    fbgemm's); full-range weights give wrong results there (measured: digits CNN off by
    up to 3.5 logits uint8, 13 int8 in onnxruntime 1.32).
    ``op_types``/``exclude``: which op types to consider / layer names or op types to keep
    in float. ``validation`` (default: the calibration data) is what the report's error
    and top-1 agreement are measured on; latency is measured on ``backend``.
    ``on_batch(done, total)`` follows calibration (a progress bar hooks in).
    """
    if mode not in MODES:
        raise OptionError(f"unknown quantization mode {mode!r}; choose one of "
                          f"{', '.join(MODES)}")
    original = as_model(model)
    infer_model(original)
    m = _at_opset(original, 21) if mode == "weight-only" else as_model(original)
    infer_model(m)
    inputs = [v.name for v in m.graph.inputs]
    feeds = load_feeds(calibration, inputs) if calibration is not None or mode == "static" \
        else []
    exclude = set(exclude)
    if mode == "weight-only":
        plan = weight_only.plan_weight_only(m, exclude)
        weight_only.rewrite_weight_only(m, plan, block_size, bits)
    else:
        types = tuple(op_types) if op_types is not None else qdq.COMPUTE_OPS + qdq.ELEMENTWISE_OPS
        plan = qdq.plan_layers(m, mode, types, exclude)
        ranges = None
        if mode == "static":
            tensors = sorted({v.name for n in plan.quantized
                              for v in list(n.inputs) + list(n.outputs)
                              if v is not None and v.const is None and v.dtype == DType.FLOAT})
            ranges = calibrate(m, tensors, feeds, method, percentile, backend, on_batch)
        qdq.rewrite(m, plan, mode, ranges, per_channel, symmetric,
                    7 if reduce_range else 8)
    report = QuantizeReport(mode=mode, size_before=model_bytes(original),
                            size_after=model_bytes(m), backend=backend,
                            quantized=[_label(n) for n in plan.quantized], kept=dict(plan.kept))
    check = load_feeds(validation, inputs) if validation is not None else feeds
    check = check[:REPORT_FEEDS]
    if check:
        report.outputs = compare(original, m, check, backend)
        report.samples = sum(len(next(iter(f.values()))) for f in check)
        if measure_latency:
            report.latency_before_ms = latency_ms(original, check[0], backend)
            report.latency_after_ms = latency_ms(m, check[0], backend)
    return Quantized(m, report)


def _label(n) -> str:
    return n.name or f"{n.op_type}({n.outputs[0].name})"


def _at_opset(m: Model, opset: int) -> Model:
    """``m`` at default-domain opset >= ``opset`` (ONNX's version converter rewrites the
    ops whose signature changed on the way, such as Reduce*'s axes becoming an input)."""
    if m.opset >= opset:
        return as_model(m)
    return load(onnx.version_converter.convert_version(to_proto(m), opset))
