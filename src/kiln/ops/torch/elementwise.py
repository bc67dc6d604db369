"""Torch kernels for elementwise math, comparisons, casts and matrix products.

They cover the dtypes where torch matches ONNX exactly and return NotImplemented for the
rest (integer Div, say), which then run on the generic or NumPy kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ir import DType
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import FLOATS, TORCH_OF, const_tensor, is_float

NI = NotImplemented


# -- arithmetic ---------------------------------------------------------------------------

@kernel("Add", 7)
def add(a, b):
    return a + b if a.dtype == b.dtype and a.dtype != torch.bool else NI


@kernel("Sub", 7)
def sub(a, b):
    return a - b if a.dtype == b.dtype and a.dtype != torch.bool else NI


@kernel("Mul", 7)
def mul(a, b):
    return a * b if a.dtype == b.dtype and a.dtype != torch.bool else NI


@kernel("Div", 7)
def div(a, b):
    # Integer Div truncates; leave that (and its division by zero) to the NumPy kernel.
    return a / b if a.dtype == b.dtype and a.dtype in FLOATS else NI


@kernel("Pow", 7)
def pow_(x, y):
    if x.dtype not in FLOATS or not (y.dtype in FLOATS or y.dtype == torch.int64
                                     or y.dtype == torch.int32):
        return NI
    r = torch.pow(x, y)
    return r if r.dtype == x.dtype else r.to(x.dtype)


@kernel("Mod", 10)
def mod(a, b, *, fmod=0):
    if a.dtype != b.dtype or a.dtype == torch.bool:
        return NI
    if a.dtype in FLOATS:
        return torch.fmod(a, b) if fmod else NI
    if (b == 0).any():
        return NI
    return torch.fmod(a, b) if fmod else torch.remainder(a, b)


def _variadic(fn):
    def run(*xs):
        if len({x.dtype for x in xs}) != 1:
            return NI
        r = xs[0]
        for x in xs[1:]:
            r = fn(r, x)
        return r
    return run


kernel("Max", 8)(_variadic(torch.maximum))
kernel("Min", 8)(_variadic(torch.minimum))
kernel("Sum", 8)(_variadic(torch.add))


@kernel("Mean", 8)
def mean(*xs):
    if not is_float(*xs) or len({x.dtype for x in xs}) != 1:
        return NI
    r = xs[0]
    for x in xs[1:]:
        r = r + x
    return r / len(xs)


# -- unary --------------------------------------------------------------------------------

def _float_unary(fn):
    def run(x):
        return fn(x) if x.dtype in FLOATS else NI
    return run


for _name, _fn in {"Sigmoid": torch.sigmoid, "Tanh": torch.tanh, "Exp": torch.exp,
                   "Log": torch.log, "Sqrt": torch.sqrt, "Erf": torch.erf,
                   "Reciprocal": torch.reciprocal, "Sin": torch.sin, "Cos": torch.cos,
                   "Floor": torch.floor, "Ceil": torch.ceil, "Round": torch.round,
                   "Softsign": F.softsign, "Tan": torch.tan, "Asin": torch.asin,
                   "Acos": torch.acos, "Atan": torch.atan, "Sinh": torch.sinh,
                   "Cosh": torch.cosh, "Asinh": torch.asinh, "Acosh": torch.acosh,
                   "Atanh": torch.atanh}.items():
    kernel(_name, 6 if _name in ("Sigmoid", "Tanh", "Exp", "Log", "Sqrt", "Reciprocal",
                                 "Floor", "Ceil") else 1)(_float_unary(_fn))


_SIGNED = FLOATS + (torch.int8, torch.int16, torch.int32, torch.int64)


@kernel("Neg", 6)
def neg(x):
    return torch.neg(x) if x.dtype in _SIGNED else NI


@kernel("Abs", 6)
def abs_(x):
    return torch.abs(x) if x.dtype in _SIGNED or x.dtype == torch.uint8 else NI


@kernel("Sign", 9)
def sign(x):
    return torch.sign(x) if x.dtype in _SIGNED else NI


@kernel("Relu", 1)
def relu(x):
    return torch.relu(x) if x.dtype in _SIGNED else NI


@kernel("LeakyRelu", 6)
def leaky_relu(x, *, alpha=0.01):
    return F.leaky_relu(x, alpha) if x.dtype in FLOATS else NI


@kernel("Elu", 6)
def elu(x, *, alpha=1.0):
    return F.elu(x, alpha) if x.dtype in FLOATS else NI


@kernel("Selu", 6)
def selu(x, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    if x.dtype not in FLOATS:
        return NI
    return gamma * torch.where(x > 0, x, alpha * torch.expm1(x))


@kernel("Celu", 12)
def celu(x, *, alpha=1.0):
    return F.celu(x, alpha) if x.dtype in FLOATS else NI


@kernel("HardSigmoid", 6)
def hard_sigmoid(x, *, alpha=0.2, beta=0.5):
    return torch.clamp(x * alpha + beta, 0, 1) if x.dtype in FLOATS else NI


@kernel("HardSwish", 14)
def hard_swish(x):
    return x * torch.clamp(x * (1 / 6) + 0.5, 0, 1) if x.dtype in FLOATS else NI


@kernel("Softplus", 1)
def softplus(x):
    # log1p(exp(x)) without overflow for large x
    return torch.logaddexp(x, torch.zeros((), dtype=x.dtype, device=x.device)) \
        if x.dtype in FLOATS else NI


@kernel("Mish", 18)
def mish(x):
    return F.mish(x) if x.dtype in FLOATS else NI


@kernel("Gelu", 20)
def gelu(x, *, approximate="none"):
    return F.gelu(x, approximate=approximate) if x.dtype in FLOATS else NI


@kernel("PRelu", 9)
def prelu(x, slope):
    if x.dtype not in FLOATS or slope.dtype != x.dtype:
        return NI
    return torch.where(x < 0, x * slope, x)


@kernel("ThresholdedRelu", 10)
def thresholded_relu(x, *, alpha=1.0):
    return torch.where(x > alpha, x, torch.zeros_like(x)) if x.dtype in FLOATS else NI


@kernel("Clip", 11)
def clip(x, lo=None, hi=None):
    if x.dtype not in _SIGNED or any(t is not None and t.dtype != x.dtype for t in (lo, hi)):
        return NI
    if lo is not None:
        x = torch.maximum(x, lo)
    if hi is not None:
        x = torch.minimum(x, hi)
    return x


@kernel("Clip", 6, until=11)
def clip6(x, *, min=-3.4028234663852886e38, max=3.4028234663852886e38):  # noqa: A002
    return torch.clamp(x, min, max) if x.dtype in FLOATS else NI


@kernel("IsNaN", 9)
def isnan(x):
    return torch.isnan(x) if x.dtype in FLOATS else NI


@kernel("IsInf", 10)
def isinf(x, *, detect_negative=1, detect_positive=1):
    if x.dtype not in FLOATS:
        return NI
    if detect_negative and detect_positive:
        return torch.isinf(x)
    if detect_positive:
        return torch.isposinf(x)
    if detect_negative:
        return torch.isneginf(x)
    return torch.zeros_like(x, dtype=torch.bool)


# -- comparisons and logic ----------------------------------------------------------------

def _compare(fn):
    def run(a, b):
        return fn(a, b) if a.dtype == b.dtype else NI
    return run


kernel("Equal", 11)(_compare(torch.eq))
kernel("Less", 9)(_compare(torch.lt))
kernel("Greater", 9)(_compare(torch.gt))
kernel("LessOrEqual", 12)(_compare(torch.le))
kernel("GreaterOrEqual", 12)(_compare(torch.ge))
kernel("And", 7)(_compare(torch.logical_and))
kernel("Or", 7)(_compare(torch.logical_or))
kernel("Xor", 7)(_compare(torch.logical_xor))


@kernel("Not", 1)
def not_(x):
    return torch.logical_not(x)


@kernel("Where", 9)
def where(cond, x, y):
    if x.dtype != y.dtype or cond.dtype != torch.bool:
        return NI
    return torch.where(cond, x, y)


# -- casts --------------------------------------------------------------------------------

@kernel("Cast", 6, prepare=True)
def cast(site):
    to = TORCH_OF.get(DType(int(site.attr("to", 0))))
    if to is None:
        return None  # strings, uint16+, float8...: NumPy kernel

    def run(x):
        if x.dtype == to:
            return x
        if x.dtype.is_complex:
            return NI
        if x.dtype in FLOATS and to not in FLOATS and to != torch.bool \
                and not torch.isfinite(x).all():
            return NI  # NaN/inf to int is platform-defined: leave it to NumPy
        return x.to(to)
    return run


@kernel("CastLike", 15)
def cast_like(x, like):
    if x.dtype == like.dtype:
        return x
    if x.dtype in FLOATS and like.dtype not in FLOATS and like.dtype != torch.bool:
        if not torch.isfinite(x).all():
            return NI
    return x.to(like.dtype)


# -- matrix products ----------------------------------------------------------------------

def _lowp(site):
    """The reduced compute dtype for fp32 matmul/conv, or None."""
    return site.backend.compute_dtype


@kernel("MatMul", 1, prepare=True)
def matmul(site):
    low = _lowp(site)
    wc = const_tensor(site, 1)
    wlow = wc.to(low) if low is not None and wc is not None and wc.dtype == torch.float32 \
        else None

    def run(a, b):
        if a.dtype != b.dtype or a.dtype not in FLOATS + (torch.int32, torch.int64):
            return NI
        if a.dtype.is_floating_point is False and a.is_cuda:
            return NI
        if low is not None and a.dtype == torch.float32:
            bb = wlow if wlow is not None else b.to(low)
            return torch.matmul(a.to(low), bb).to(torch.float32)
        return torch.matmul(a, b)
    if low is not None:
        site.notes.append(f"computes in {low}")
    return run


@kernel("Gemm", 7, prepare=True)
def gemm(site):
    alpha = float(site.attr("alpha", 1.0))
    beta = float(site.attr("beta", 1.0))
    ta = int(site.attr("transA", 0))
    tb = int(site.attr("transB", 0))
    low = _lowp(site)
    wc = const_tensor(site, 1)
    # Keep a constant B as the (N, K) matrix F.linear wants, cast once for low precision.
    w = None
    if wc is not None and wc.dim() == 2 and wc.dtype in FLOATS:
        w = wc if tb else wc.t().contiguous()
        if low is not None and w.dtype == torch.float32:
            w = w.to(low)

    def run(a, b, c=None):
        if a.dtype != b.dtype or a.dtype not in FLOATS or (c is not None and c.dtype != a.dtype):
            return NI
        if a.dim() != 2 or b.dim() != 2:
            return NI
        out_dtype = a.dtype
        if ta:
            a = a.t()
        wt = w if w is not None else (b if tb else b.t())
        if low is not None and out_dtype == torch.float32:
            a = a.to(low)
            wt = wt.to(low)
        if alpha != 1.0:
            a = a * alpha
        bias = None
        if c is not None and beta != 0.0:
            bias = c if beta == 1.0 else c * beta
        if bias is not None and bias.dim() == 1 and bias.shape[0] == wt.shape[0] \
                and low is None:
            return F.linear(a, wt, bias)
        y = F.linear(a, wt)
        if y.dtype != out_dtype:
            y = y.to(out_dtype)
        if bias is not None:
            y = y + bias
        return y
    if low is not None:
        site.notes.append(f"computes in {low}")
    return run
