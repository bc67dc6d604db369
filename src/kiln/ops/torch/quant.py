"""Torch kernels for per-tensor QuantizeLinear / DequantizeLinear / DynamicQuantizeLinear
as torch elementwise ops (the NumPy fallback costs two transfers and a NumPy pass per
call)."""

from __future__ import annotations

import numpy as np
import torch

from kiln.ops.registry import Kernel
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import gated

NI = NotImplemented
_EIGHT = (torch.uint8, torch.int8)


def first_item(c) -> float | int | None:
    """The first element of constant ``c`` as a Python number (None for None)."""
    return None if c is None else c.reshape(-1)[0].item()




# ---------------------------------------------------------------- Q / DQ, per tensor

def _per_tensor(*params) -> bool:
    return all(p is None or p.numel() == 1 for p in params)


def _quantize(x, y_scale, y_zero_point=None, *, axis=1, block_size=0, output_dtype=0,
              precision=0, saturate=1):
    out = y_zero_point.dtype if y_zero_point is not None else (
        torch.uint8 if not output_dtype else None)
    if out not in _EIGHT or block_size or precision or x.dtype != torch.float32 or \
            y_scale.dtype != torch.float32 or not _per_tensor(y_scale, y_zero_point):
        return NI
    lo, hi = (0, 255) if out == torch.uint8 else (-128, 127)
    v = torch.round(x / y_scale.reshape(()))
    if y_zero_point is not None:
        v += y_zero_point.reshape(()).to(torch.float32)
    return v.clamp_(lo, hi).to(out)


def _dequantize(x, x_scale, x_zero_point=None, *, axis=1, block_size=0, output_dtype=0):
    if x.dtype not in _EIGHT or block_size or output_dtype or \
            x_scale.dtype != torch.float32 or not _per_tensor(x_scale, x_zero_point):
        return NI
    v = x.to(torch.float32)
    if x_zero_point is not None:
        v -= x_zero_point.reshape(()).to(torch.float32)
    return v.mul_(x_scale.reshape(()))


def _as_float(x: torch.Tensor) -> torch.Tensor:
    """``x`` as float32, contiguous unless it is a dense NCHW or NHWC tensor: a DQ moved
    behind a Transpose reads a permuted view, and a product of permuted operands copies
    them again (BERT's attention products took longer that way)."""
    if x.is_contiguous() or x.is_contiguous(memory_format=torch.channels_last):
        return x.to(torch.float32)
    return x.to(torch.float32, memory_format=torch.contiguous_format)


_ROUND, _ROUND_BITS = 12582912.0, 0x4B400000  # 1.5 * 2**23 and its float32 bits


def _to_grid(v: torch.Tensor, zp: float, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
    """saturate(rint(v) + zp) as ``dtype``, overwriting the float32 ``v``. Adding 1.5 * 2**23
    rounds v to an integer (ties to even, as rint) held in the float's low mantissa bits,
    and the integer is read from those bits: torch's float-to-8-bit conversion alone takes
    as long as three elementwise passes, and this way the quantize takes less time
    (docs/quantization.md)."""
    z = int(zp)
    v.add_(_ROUND).clamp_(_ROUND + lo - z, _ROUND + hi - z)
    return v.view(torch.int32).sub_(_ROUND_BITS - z).to(dtype)


def const_grid(site) -> tuple[torch.Tensor, float, np.dtype] | None:
    """(0-d float32 scale, zero point, zero point's dtype) of a Q/DQ node whose grid is
    one constant per-tensor scale and zero point, else None."""
    s, z = site.const(1), site.const(2)
    if s is None or s.size != 1 or s.dtype != np.float32 or \
            (site.has_input(2) and (z is None or z.size != 1)):
        return None
    zdt = z.dtype if z is not None else np.dtype(np.uint8)
    # On the backend's device: CUDA divides by a CPU scalar as a product with its
    # reciprocal, which rounds ties differently from ONNX's division.
    dev = site.target.device
    return (torch.tensor(float(s.reshape(-1)[0]), device=dev), float(first_item(z) or 0), zdt)


# A grid that is not one constant takes the general kernels, bound to the node's attributes
# as the registry binds any plain kernel.
_QUANTIZE, _DEQUANTIZE = Kernel(_quantize), Kernel(_dequantize)


# A constant grid is read once, when the node is prepared, which roughly halves a small Q
# or DQ (BERT's INT8 file has 108 of them). The ops are the general path's, so results are
# the same bit for bit.

@kernel("QuantizeLinear", 10, prepare=True)
def quantize_linear(site):
    grid = const_grid(site)
    out_attr = site.attr("output_dtype", 0)
    if grid is None or site.attr("block_size", 0) or site.attr("precision", 0) or \
            (not site.has_input(2) and out_attr) or grid[2] not in (np.uint8, np.int8):
        return _QUANTIZE.bind(site)[0]
    scale, zp, zdt = grid
    out = torch.uint8 if zdt == np.uint8 else torch.int8
    lo, hi = (0, 255) if out == torch.uint8 else (-128, 127)

    def run(x, *rest):
        return _to_grid(torch.div(x, scale), zp, lo, hi, out)
    return gated(site, (torch.float32,), run)


@kernel("DequantizeLinear", 10, prepare=True)
def dequantize_linear(site):
    grid = const_grid(site)
    if grid is None or site.attr("block_size", 0) or site.attr("output_dtype", 0):
        return _DEQUANTIZE.bind(site)[0]
    scale, zp, _ = grid

    def run(x, *rest):
        v = _as_float(x)
        return (v.sub_(zp) if zp else v).mul_(scale)
    return gated(site, _EIGHT, run)


@kernel("DynamicQuantizeLinear", 11, dtypes=(torch.float32,))
def dynamic_quantize_linear(x):
    # The scale and zero point computed as the reference kernel does (in float32), so
    # both backends pick the same grid.
    lo = hi = 0.0
    if x.numel():
        lo_t, hi_t = torch.aminmax(x)  # one pass: each torch call has a fixed cost
        lo, hi = min(float(lo_t), 0.0), max(float(hi_t), 0.0)
    scale = np.float32(np.float32(hi) - np.float32(lo)) / np.float32(255)
    if scale == 0:
        return (torch.zeros(x.shape, dtype=torch.uint8, device=x.device), x.new_tensor(scale),
                torch.tensor(0, dtype=torch.uint8, device=x.device))
    zp = min(max(round(float(np.float32(-lo) / scale)), 0), 255)  # ties to even, as rint
    s = x.new_tensor(scale)  # on x's device: see const_grid
    y = _to_grid(torch.div(x, s), zp, 0, 255, torch.uint8)
    return y, s, torch.tensor(zp, dtype=torch.uint8, device=x.device)


