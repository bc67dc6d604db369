"""Quantization: QuantizeLinear, DequantizeLinear (per-tensor, per-axis, blocked; 8/16-bit,
4/2-bit and float8/float4 types), DynamicQuantizeLinear, QLinearMatMul, QLinearConv,
ConvInteger.

Integer products are accumulated in float64, which is exact for any realistic size
(|sum| < 2**53) and lets BLAS do the work.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kiln.ir.types import DType
from kiln.ops import cost
from kiln.ops.conv import check_kernel_shape, conv_core, conv_pads, spatial_attrs
from kiln.ops.registry import op


def _onnx_dtype(code: int) -> np.dtype:
    return DType(int(code)).numpy


def _expand(p, x, axis: int, block_size: int):
    """Scale or zero point ``p`` shaped to broadcast against ``x``."""
    if p is None or p.ndim == 0 or p.size == 1 and p.ndim <= 1:
        return None if p is None else p.reshape(())
    ax = axis + x.ndim if axis < 0 else axis
    if block_size or p.ndim == x.ndim and p.ndim > 1:
        bs = block_size or -(-x.shape[ax] // p.shape[ax])
        return np.repeat(p, bs, axis=ax)[(slice(None),) * ax + (slice(0, x.shape[ax]),)]
    shape = [1] * x.ndim
    shape[ax] = -1
    return p.reshape(shape)


def _is_float(dtype: np.dtype) -> bool:
    return dtype.kind == "f" or (dtype.kind == "V" and "float" in dtype.name)


def saturate_cast(v: np.ndarray, dtype: np.dtype, saturate: bool = True) -> np.ndarray:
    """Round (ties to even) and clamp ``v`` into ``dtype``'s range; floats (float8/4)
    clamp to their largest finite value when ``saturate``."""
    if _is_float(dtype):
        if saturate or dtype == np.dtype(ml_dtypes.float4_e2m1fn):
            big = float(ml_dtypes.finfo(dtype).max)
            v = np.clip(v, -big, big)
        return v.astype(dtype)
    info = ml_dtypes.iinfo(dtype) if dtype.kind == "V" else np.iinfo(dtype)
    return np.clip(np.rint(v), info.min, info.max).astype(dtype)


@op("QuantizeLinear", 10, differentiable=False, cost=cost.elementwise)
def quantize_linear(x, y_scale, y_zero_point=None, *, axis=1, block_size=0, output_dtype=0,
                    precision=0, saturate=1):
    if y_zero_point is not None:
        out = y_zero_point.dtype
    else:
        out = _onnx_dtype(output_dtype) if output_dtype else np.dtype(np.uint8)
    work = _onnx_dtype(precision) if precision else y_scale.dtype
    if not _is_float(work) or work.kind == "V" and work != np.dtype(ml_dtypes.bfloat16):
        work = np.dtype(np.float32)
    scale = _expand(y_scale, x, axis, block_size).astype(work)
    v = (x.astype(work) / scale).astype(np.float64)
    if not _is_float(out):
        v = np.rint(v)
    if y_zero_point is not None:
        v = v + _expand(y_zero_point, x, axis, block_size).astype(np.float64)
    return saturate_cast(v, out, bool(saturate))


@op("DequantizeLinear", 10, cost=cost.elementwise)
def dequantize_linear(x, x_scale, x_zero_point=None, *, axis=1, block_size=0,
                      output_dtype=0):
    out = _onnx_dtype(output_dtype) if output_dtype else x_scale.dtype
    if out.kind == "V" and out != np.dtype(ml_dtypes.bfloat16):
        out = np.dtype(np.float32)
    v = x.astype(np.float64)
    if x_zero_point is not None:
        v = v - _expand(x_zero_point, x, axis, block_size).astype(np.float64)
    scale = _expand(x_scale, x, axis, block_size).astype(np.float32)
    if out == np.float64:
        return v * scale.astype(np.float64)
    return (v.astype(np.float32) * scale).astype(out)


@op("DynamicQuantizeLinear", 11, differentiable=False)
def dynamic_quantize_linear(x):
    """uint8 quantization with a scale and zero point covering [min(x, 0), max(x, 0)]."""
    lo = min(float(x.min(initial=0.0)), 0.0)
    hi = max(float(x.max(initial=0.0)), 0.0)
    # in float32, as the spec's reference and onnxruntime compute it (float64 differs by
    # one ulp now and then, enough to move a rounding in the next layer)
    scale = np.float32(np.float32(hi) - np.float32(lo)) / np.float32(255)
    if scale == 0:
        return (np.zeros(x.shape, np.uint8), np.array(scale, np.float32),
                np.array(0, np.uint8))
    zp = np.clip(np.rint(np.float32(-lo) / scale), 0, 255)
    y = np.clip(np.rint(x.astype(np.float32) / scale) + zp, 0, 255).astype(np.uint8)
    return y, np.array(scale, np.float32), np.array(zp, np.uint8)


def _minus(x, zp):
    v = x.astype(np.float64)
    return v if zp is None else v - zp.astype(np.float64)


def _row_vector(p, a):
    """A per-row scale/zero point of ``a`` (a 1-D vector of its row count) as a column."""
    if p is not None and p.ndim == 1 and p.size > 1 and a.ndim >= 2 and p.size == a.shape[-2]:
        return p.reshape(-1, 1)
    return p


@op("QLinearMatMul", 10, differentiable=False, cost=cost.matmul)
def qlinear_matmul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale,
                   y_zero_point):
    a_scale, a_zero_point = _row_vector(a_scale, a), _row_vector(a_zero_point, a)
    acc = np.matmul(_minus(a, a_zero_point), _minus(b, b_zero_point))
    real = acc * (a_scale.astype(np.float64) * b_scale.astype(np.float64))
    out = y_zero_point.dtype
    v = real / y_scale.astype(np.float64)
    if not _is_float(out):
        v = np.rint(v)
    return saturate_cast(v + y_zero_point.astype(np.float64), out)


def _int_conv(x, w, group, auto_pad, dilations, pads, strides):
    """Exact convolution of float64 ``x`` and ``w`` (zero points already subtracted)."""
    nd = x.ndim - 2
    strides, dilations = spatial_attrs(nd, strides, dilations)
    begin, end = conv_pads(x.shape[2:], w.shape[2:], strides, dilations, auto_pad, pads)
    return conv_core(x, w, None, group, strides, dilations, begin, end)


def _per_channel(p, ndim):
    if p is None or p.ndim == 0 or p.size == 1:
        return p
    return p.reshape((-1,) + (1,) * (ndim - 1))


@op("ConvInteger", 10, differentiable=False, cost=cost.conv())
def conv_integer(x, w, x_zero_point=None, w_zero_point=None, *, auto_pad="NOTSET",
                 dilations=None, group=1, kernel_shape=None, pads=None, strides=None):
    check_kernel_shape(kernel_shape, w)
    y = _int_conv(_minus(x, x_zero_point), _minus(w, _per_channel(w_zero_point, w.ndim)),
                  group, auto_pad, dilations, pads, strides)
    return np.rint(y).astype(np.int32)


@op("QLinearConv", 10, differentiable=False, cost=cost.conv(3))
def qlinear_conv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, y_scale, y_zero_point,
                 b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
                 pads=None, strides=None):
    check_kernel_shape(kernel_shape, w)
    acc = _int_conv(_minus(x, x_zero_point), _minus(w, _per_channel(w_zero_point, w.ndim)),
                    group, auto_pad, dilations, pads, strides)
    chan = (1, -1) + (1,) * (acc.ndim - 2)
    if b is not None:
        acc += b.astype(np.float64).reshape(chan)
    ws = w_scale.astype(np.float64)
    mult = x_scale.astype(np.float64) * (ws.reshape(chan) if ws.size > 1 else ws)
    # The requantization multiplier in float32, as integer inference engines apply it.
    mult = (mult / y_scale.astype(np.float64)).astype(np.float32).astype(np.float64)
    v = np.rint(acc * mult) + y_zero_point.astype(np.float64)
    return saturate_cast(v, y_zero_point.dtype)
