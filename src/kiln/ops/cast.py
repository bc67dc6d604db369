"""Cast, CastLike and BitCast over every ONNX element type: NumPy dtypes plus ml_dtypes'
bfloat16, float8 (e4m3fn, e4m3fnuz, e5m2, e5m2fnuz, e8m0), float4e2m1 and the 4/2-bit
integers; strings are NumPy object arrays of ``str``."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kiln.ir import DType
from kiln.ops import cost
from kiln.ops.registry import op

_F8 = {np.dtype(t) for t in (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz,
                             ml_dtypes.float8_e5m2, ml_dtypes.float8_e5m2fnuz,
                             ml_dtypes.float4_e2m1fn)}
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
_SUBBYTE_BITS = {np.dtype(ml_dtypes.int4): 4, np.dtype(ml_dtypes.uint4): 4,
                 np.dtype(ml_dtypes.float4_e2m1fn): 4, np.dtype(ml_dtypes.int2): 2,
                 np.dtype(ml_dtypes.uint2): 2}
_SIGNED_SUBBYTE = {np.dtype(ml_dtypes.int4), np.dtype(ml_dtypes.int2)}
_NARROW_FLOAT = _F8 | {_E8M0, np.dtype(ml_dtypes.bfloat16)}
_STRING = np.dtype(object)


def _plain(x: np.ndarray) -> np.ndarray:
    """Narrow (ml_dtypes) floats as float32, which every NumPy routine understands."""
    return x.astype(np.float32) if x.dtype in _NARROW_FLOAT else x


def _from_strings(x: np.ndarray, to: np.dtype) -> np.ndarray:
    """Parse decimal/scientific literals and INF/-INF/NaN (any case)."""
    s = x.astype(str)
    if to.kind in "iub":  # integers parse exactly; "2.5" and the like (undefined) truncate
        for t in ((np.uint64,) if to == np.uint64 else ()) + (np.int64,):
            try:
                return s.astype(t)
            except (ValueError, OverflowError):
                pass
    return s.astype(np.float64)


def _to_strings(x: np.ndarray) -> np.ndarray:
    """Numbers as onnxruntime writes them: integers in full, floats with 8 significant
    digits ('%.8g'), NaN/INF/-INF spelled as the spec's literals, booleans as 1/0."""
    if x.dtype == np.bool_ or (x.dtype in _SUBBYTE_BITS and x.dtype not in _F8):
        x = x.astype(np.int8)
    if x.dtype.kind in "iu":
        return x.astype(str).astype(object)
    v = _plain(x).astype(np.float64)
    out = np.char.mod("%.8g", v).astype(object)
    out[np.isnan(v)] = "NaN"
    out[v == np.inf] = "INF"
    out[v == -np.inf] = "-INF"
    return out


def _wrap_int(x: np.ndarray, to: np.dtype) -> np.ndarray:
    """Integers of 4 or 2 bits keep the low bits (two's complement), like wider ints."""
    bits = _SUBBYTE_BITS[to]
    with np.errstate(invalid="ignore", over="ignore"):
        v = _plain(x).astype(np.int64)
    v &= (1 << bits) - 1
    if to in _SIGNED_SUBBYTE:
        v = np.where(v >= 1 << (bits - 1), v - (1 << bits), v)
    return v.astype(to)


def _to_small_float(x: np.ndarray, to: np.dtype, saturate: int) -> np.ndarray:
    """float8/float4 with RNE; saturate clamps overflow (and infinities) to +-max."""
    if x.dtype != np.float64:
        x = _plain(x).astype(np.float32, copy=False)
    if saturate:
        top = float(ml_dtypes.finfo(to).max)
        x = np.clip(x, -top, top)  # NaN passes through
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(to)


def _to_e8m0(x: np.ndarray, saturate: int, round_mode: str) -> np.ndarray:
    """Power-of-two scale type: the code is float32's biased exponent, rounded per
    ``round_mode`` using the mantissa bits; 255 is NaN. The sign is ignored."""
    bits = _plain(x).astype(np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    exp = (bits >> np.uint32(23)).astype(np.int32)
    man = bits & np.uint32(0x7FFFFF)
    half = np.uint32(0x400000)
    if round_mode == "up":
        code = exp + (man != 0)
    elif round_mode == "down":
        code = exp.copy()
    else:  # nearest, ties to the even code
        code = exp + ((man > half) | ((man == half) & (exp % 2 == 1)))
    nan = bits > np.uint32(0x7F800000)
    inf_or_over = (exp == 255) & ~nan | (code > 254)
    if saturate:
        code = np.where(inf_or_over, 254, code)
    else:
        code = np.where(inf_or_over | (bits == 0), 255, code)
    code = np.where(nan, 255, np.clip(code, 0, 255))
    return code.astype(np.uint8).view(_E8M0)


def cast(x: np.ndarray, to: np.dtype, saturate: int = 1, round_mode: str = "up"
         ) -> np.ndarray:
    """``x`` converted to ``to`` by ONNX Cast rules."""
    x = np.asarray(x)
    if x.dtype == to:
        return x
    if to == _STRING:
        return _to_strings(x)
    if x.dtype == _STRING or x.dtype.kind in "US":
        x = _from_strings(x, to)
        if x.dtype == to:
            return x
    if to in _F8:
        return _to_small_float(x, to, saturate)
    if to == _E8M0:
        return _to_e8m0(x, saturate, round_mode)
    if to in _SUBBYTE_BITS:
        return _wrap_int(x, to)
    if to == np.bool_:
        return _plain(x) != 0
    with np.errstate(invalid="ignore", over="ignore"):
        return _plain(x).astype(to) if to.kind != "V" else x.astype(to)


@op("Cast", 1, cost=cost.elementwise)
def cast_(input, *, to=None, saturate=1, round_mode="up"):
    # Opset 1 names the type as a string ("FLOAT"); later opsets use the enum value.
    code = DType[to.upper()] if isinstance(to, str) else DType(to)
    return cast(input, code.numpy, saturate, round_mode)


@op("CastLike", 15)
def cast_like(input, target_type, *, saturate=1, round_mode="up"):
    return cast(input, np.asarray(target_type).dtype, saturate, round_mode)


@op("BitCast", 26)
def bit_cast(input, *, to=None):
    """Reinterpret the bits of each element as type ``to`` (same width)."""
    target = DType(to).numpy
    x = input if input.flags.c_contiguous else input.copy()
    if x.dtype in _SUBBYTE_BITS:  # one element per byte, value in the low bits
        x = x.view(np.uint8) & np.uint8((1 << _SUBBYTE_BITS[x.dtype]) - 1)
    if x.dtype.itemsize != target.itemsize:
        raise ValueError(f"BitCast from {input.dtype} to {target}: the widths differ")
    if target == np.bool_:  # keep NumPy's bools canonical (one byte, 0 or 1)
        return x.view(np.uint8) != 0
    return x.view(target)
