"""Torch kernels for per-tensor QuantizeLinear / DequantizeLinear / DynamicQuantizeLinear
as torch elementwise ops (the NumPy fallback costs two transfers and a NumPy pass per
call)."""

from __future__ import annotations

import numpy as np
import torch

from kiln.ir import DType
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import decided, dtype_in, fact, gated, known_dtype, one_element

_EIGHT = (torch.uint8, torch.int8)
_EIGHT_TYPES = (DType.UINT8, DType.INT8)


def first_item(c) -> float | int | None:
    """The first element of constant ``c`` as a Python number (None for None)."""
    return None if c is None else c.reshape(-1)[0].item()




# ---------------------------------------------------------------- Q / DQ, per tensor

def _per_tensor(*params) -> bool:
    return all(p is None or p.numel() == 1 for p in params)


def _quantize(x, y_scale, y_zero_point=None):
    out = y_zero_point.dtype if y_zero_point is not None else torch.uint8
    lo, hi = (0, 255) if out == torch.uint8 else (-128, 127)
    v = torch.round(x / y_scale.reshape(()))
    if y_zero_point is not None:
        v += y_zero_point.reshape(()).to(torch.float32)
    return v.clamp_(lo, hi).to(out)


def _dequantize(x, x_scale, x_zero_point=None):
    v = x.to(torch.float32)
    if x_zero_point is not None:
        v -= x_zero_point.reshape(()).to(torch.float32)
    return v.mul_(x_scale.reshape(()))


_F32 = (torch.float32,)


def _general(site, fn, x_types: tuple, out: bool | None, attrs: tuple[str, ...]):
    """``fn``, the per-tensor Q (``x_types`` float32) or DQ (8-bit) on a grid read each
    call, for the nodes it computes: ``out`` whether the zero point (input 2), or the
    type it implies, is 8-bit; none of ``attrs`` set; a float32 scale and one-element
    scale and zero point. What the plan knows of those is settled when the session is
    made (the shared kernel takes what this one lacks); the rest is checked each call."""
    facts = [out, not any(site.attr(a, 0) for a in attrs), dtype_in(site, 0, x_types),
             dtype_in(site, 1, _F32), one_element(site, 1), one_element(site, 2)]

    def check(x, scale, zero_point=None):
        return x.dtype in x_types and scale.dtype == torch.float32 and \
            (zero_point is None or zero_point.dtype in _EIGHT) and _per_tensor(scale, zero_point)
    return decided(site, facts, fn, check)


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


# A constant grid is read once, when the node is prepared, which roughly halves a small Q
# or DQ (BERT's INT8 file has 108 of them). The ops are the general path's, so results are
# the same bit for bit.

@kernel("QuantizeLinear", 10, prepare=True)
def quantize_linear(site):
    grid = const_grid(site)
    out_attr = site.attr("output_dtype", 0)
    if grid is None or site.attr("block_size", 0) or site.attr("precision", 0) or \
            (not site.has_input(2) and out_attr) or grid[2] not in (np.uint8, np.int8):
        # a grid that is not one constant: the general kernel (without a zero point, an
        # output type asked for is not 8-bit here: torch lacks the others)
        out = fact(known_dtype(site, 2), lambda d: d in _EIGHT_TYPES) if site.has_input(2) \
            else not out_attr
        return _general(site, _quantize, _F32, out, ("block_size", "precision"))
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
        out = fact(known_dtype(site, 2), lambda d: d in _EIGHT_TYPES) if site.has_input(2) \
            else True
        return _general(site, _dequantize, _EIGHT, out, ("block_size", "output_dtype"))
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


