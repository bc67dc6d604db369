"""Reduced precision: half-precision conversion and INT8/INT4 quantization, written as
standard ONNX (Casts, QuantizeLinear/DequantizeLinear) that any runtime can load."""

from kiln.quantize.fp16 import convert_float16

__all__ = ["convert_float16"]
