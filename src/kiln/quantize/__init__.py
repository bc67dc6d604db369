"""Reduced precision: half-precision conversion and INT8/INT4 quantization, written as
standard ONNX (Casts, QuantizeLinear/DequantizeLinear) that any runtime can load."""

from kiln.quantize.api import MODES, Budget, Quantized, quantize
from kiln.quantize.fp16 import convert_float16
from kiln.quantize.report import QuantizeReport

__all__ = ["MODES", "Budget", "QuantizeReport", "Quantized", "convert_float16", "quantize"]
