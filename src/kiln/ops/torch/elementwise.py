"""Torch kernels for elementwise math, comparisons, casts and matrix products.

They cover the dtypes where torch matches ONNX exactly and return NotImplemented for the
rest (integer Div, say), which then run on the generic or NumPy kernel.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ir import DType
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import FLOATS, TORCH_OF, const_tensor
from kiln.ops.torch.nn import linear

NI = NotImplemented


# -- arithmetic ---------------------------------------------------------------------------

@kernel("Mod", 10)  # faster than the generic kernel on floats (one torch.fmod, no abs/where)
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


# the Tensor op, not array_api_compat's wrapper (gain: benchmarks/results/torch_overrides.md)
kernel("Max", 8)(_variadic(torch.maximum))
kernel("Min", 8)(_variadic(torch.minimum))


# -- unary --------------------------------------------------------------------------------

def _float_unary(fn):
    def run(x):
        return fn(x) if x.dtype in FLOATS else NI
    return run


# The plain unary ops (Exp, Log, Sqrt, trigonometry, IsNaN/IsInf...) run the generic kernel:
# since the namespace lookup is cached per array type, their torch kernels gained under
# 1.15x. Those kept gain by more than skipping it. Gains: benchmarks/results/torch_overrides.json.
for _name, _since, _fn in [
    ("Sigmoid", 6, torch.sigmoid),  # faster than the generic kernel (fused op, not 1/(1+exp(-x)))
    ("Erf", 1, torch.erf),  # the reference is NumPy-only: without this, a CPU fallback
    ("Reciprocal", 6, torch.reciprocal),  # faster than the generic kernel (no 1.0 / x, no cast)
    ("Floor", 6, torch.floor),  # Tensor op, not array_api_compat's wrapper
    ("Ceil", 6, torch.ceil),  # Tensor op, not array_api_compat's wrapper
    ("Round", 1, torch.round),  # Tensor op, not array_api_compat's wrapper
    ("Softsign", 1, F.softsign),  # faster than the generic kernel (one op, no dtype check)
]:
    kernel(_name, _since)(_float_unary(_fn))


_SIGNED = FLOATS + (torch.int8, torch.int16, torch.int32, torch.int64)


@kernel("Neg", 6)  # Tensor op, not array_api_compat's wrapper
def neg(x):
    return torch.neg(x) if x.dtype in _SIGNED else NI


@kernel("Abs", 6)  # Tensor op, not array_api_compat's wrapper
def abs_(x):
    return torch.abs(x) if x.dtype in _SIGNED or x.dtype == torch.uint8 else NI


@kernel("Sign", 9)  # faster than the generic kernel (torch.sign; the namespace's is slow)
def sign(x):
    return torch.sign(x) if x.dtype in _SIGNED else NI


@kernel("Relu", 1)  # faster than the generic kernel (torch.relu, no maximum(x, 0) + cast)
def relu(x):
    return torch.relu(x) if x.dtype in _SIGNED else NI


@kernel("LeakyRelu", 6)  # faster than the generic kernel (one fused op, no x * alpha copy)
def leaky_relu(x, *, alpha=0.01):
    return F.leaky_relu(x, alpha) if x.dtype in FLOATS else NI


# faster than the generic kernel on a 1x32x112x112 NHWC activation with one slope per channel
# (F.prelu is one pass; the generic max/min/multiply passes over an NHWC tensor broadcast
# a (C, 1, 1) slope slowly); other slope shapes run the generic kernel
@kernel("PRelu", 7)
def prelu(x, slope):
    if x.dtype not in FLOATS or slope.dtype != x.dtype:
        return NI
    if slope.dim() > x.dim():
        return NI
    if slope.numel() == 1:
        return F.prelu(x, slope.reshape(1))
    shape = list(slope.shape)
    while shape and shape[0] == 1:
        shape.pop(0)
    if x.dim() >= 2 and shape == [x.shape[1]] + [1] * (x.dim() - 2):
        return F.prelu(x, slope.reshape(-1))
    return NI


@kernel("Elu", 6)  # faster than the generic kernel (one fused op)
def elu(x, *, alpha=1.0):
    return F.elu(x, alpha) if x.dtype in FLOATS else NI


@kernel("Celu", 12)  # faster than the generic kernel (one fused op)
def celu(x, *, alpha=1.0):
    return F.celu(x, alpha) if x.dtype in FLOATS else NI


@kernel("HardSigmoid", 6)  # faster than the generic kernel (clamp, no maximum/minimum pair)
def hard_sigmoid(x, *, alpha=0.2, beta=0.5):
    return torch.clamp(x * alpha + beta, 0, 1) if x.dtype in FLOATS else NI


@kernel("HardSwish", 14)  # faster than the generic kernel (clamp, no maximum/minimum pair)
def hard_swish(x):
    return x * torch.clamp(x * (1 / 6) + 0.5, 0, 1) if x.dtype in FLOATS else NI


@kernel("Gelu", 20)
def gelu(x, *, approximate="none"):
    return F.gelu(x, approximate=approximate) if x.dtype in FLOATS else NI


# Slower than the generic kernel but kept for results: the generic x * (x > alpha)
# turns -inf into NaN where ONNX asks for 0.
@kernel("ThresholdedRelu", 10)
def thresholded_relu(x, *, alpha=1.0):
    return torch.where(x > alpha, x, torch.zeros_like(x)) if x.dtype in FLOATS else NI


def _bounds(lo, hi) -> tuple[float, float] | None:
    """Float bounds hardtanh takes (None: no bound), or None when it is not Clip's function
    (min > max clips everything to max)."""
    lo = -math.inf if lo is None or lo <= -3.4e38 else lo
    hi = math.inf if hi is None or hi >= 3.4e38 else hi
    return (lo, hi) if lo <= hi else None


def _bound(site, i: int):
    """Input ``i`` of a Clip as a float, None when absent, ``NotImplemented`` when a feed or
    a non-scalar."""
    if not site.has_input(i):
        return None
    c = site.const(i)
    return float(c) if c is not None and np.ndim(c) == 0 else NotImplemented


@kernel("Clip", 11, prepare=True)  # faster than the generic kernel (one clamp, no casts)
def clip(site):
    """Constant bounds: F.hardtanh, what torch.nn.ReLU6/Hardtanh run, so the gradient is
    theirs (one kernel; zero at the bounds); bounds fed at run time (a training module's
    0-d literals among them): torch.clamp, the same function with one backward kernel
    (its gradient is 1 at the bounds themselves)."""
    lo, hi = _bound(site, 1), _bound(site, 2)
    fixed = _bounds(lo, hi) if NotImplemented not in (lo, hi) else None

    def run(x, lo=None, hi=None):
        if x.dtype not in _SIGNED or any(t is not None and t.dtype != x.dtype
                                         for t in (lo, hi)):
            return NI
        if fixed is not None and x.dtype in FLOATS:
            return F.hardtanh(x, *fixed)
        # clamp sets everything to max when min > max, as Clip does
        return x if lo is None and hi is None else torch.clamp(x, lo, hi)
    return run


@kernel("Clip", 6, until=11)  # faster than the generic kernel (one clamp)
def clip6(x, *, min=-3.4028234663852886e38, max=3.4028234663852886e38):  # noqa: A002
    if x.dtype not in FLOATS:
        return NI
    fixed = _bounds(min, max)  # hardtanh as torch.nn.ReLU6 (see Clip-11)
    return F.hardtanh(x, *fixed) if fixed is not None else torch.clamp(x, min, max)


# -- comparisons and logic ----------------------------------------------------------------

def _compare(fn):
    def run(a, b):
        return fn(a, b) if a.dtype == b.dtype else NI
    return run


# Tensor ops, not array_api_compat's wrappers; torch's comparisons gained nothing
# and run the generic kernel
kernel("And", 7)(_compare(torch.logical_and))
kernel("Or", 7)(_compare(torch.logical_or))
kernel("Xor", 7)(_compare(torch.logical_xor))


@kernel("Not", 1)  # Tensor op, not array_api_compat's wrapper
def not_(x):
    return torch.logical_not(x)


@kernel("Where", 9)  # Tensor op, not array_api_compat's wrapper
def where(cond, x, y):
    if x.dtype != y.dtype or cond.dtype != torch.bool:
        return NI
    return torch.where(cond, x, y)


# -- casts --------------------------------------------------------------------------------

@kernel("Cast", 6, prepare=True)
def cast(site):
    to = int(site.attr("to", 0))
    to = TORCH_OF.get(DType(to)) if to in DType._value2member_map_ else None
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
    return site.target.compute_dtype


def _new_tensors_ok(site) -> bool:
    """Whether ``prepare`` may keep tensors of its own (a transposed or cast weight). Not
    while tracing for AOTInductor on the CPU: such a tensor becomes a lifted constant
    that AOTInductor with frozen weights fails on (torch 2.13: "references nonexistent
    attribute _tensor_constant0"), where the same cast inside the program folds."""
    tg = site.target
    return not (tg.tracing and tg.device.type == "cpu")


# faster than the generic kernel, and computes in bf16/fp16 when the session asks for it
@kernel("MatMul", 1, prepare=True)
def matmul(site):
    low = _lowp(site)
    wc = const_tensor(site, 1)
    wlow = wc.to(low) if low is not None and wc is not None and wc.dtype == torch.float32 \
        and _new_tensors_ok(site) else None
    lin = linear(site, wc) if wc is not None and wc.dim() == 2 \
        and wc.dtype == torch.float32 and low is None else None

    def run(a, b):
        if a.dtype != b.dtype or a.dtype not in FLOATS + (torch.int32, torch.int64):
            return NI
        if lin is not None and a.dtype == torch.float32 and a.dim() >= 2:
            return lin(a, None)
        if a.dtype.is_floating_point is False and a.is_cuda:
            return NI
        if low is not None and a.dtype == torch.float32:
            bb = wlow if wlow is not None else b.to(low)
            return torch.matmul(a.to(low), bb).to(torch.float32)
        return torch.matmul(a, b)
    if low is not None:
        site.notes.append(f"computes in {low}")
    return run


# faster than the generic kernel (F.linear with bias), computes in bf16/fp16 when asked
@kernel("Gemm", 7, prepare=True)
def gemm(site):
    alpha = float(site.attr("alpha", 1.0))
    beta = float(site.attr("beta", 1.0))
    ta = int(site.attr("transA", 0))
    tb = int(site.attr("transB", 0))
    low = _lowp(site)
    wc = const_tensor(site, 1)
    lin = None
    if wc is not None and wc.dim() == 2 and wc.dtype == torch.float32 and low is None \
            and not ta and alpha == 1.0:
        lin = linear(site, wc.t() if tb else wc)
    # Otherwise keep a constant B as the (N, K) matrix F.linear wants, cast once for low
    # precision.
    w = None
    if lin is None and wc is not None and wc.dim() == 2 and wc.dtype in FLOATS \
            and _new_tensors_ok(site):
        w = wc if tb else wc.t().contiguous()
        if low is not None and w.dtype == torch.float32:
            w = w.to(low)

    def run(a, b, c=None):
        if a.dtype != b.dtype or a.dtype not in FLOATS or (c is not None and c.dtype != a.dtype):
            return NI
        if a.dim() != 2 or b.dim() != 2:
            return NI
        if lin is not None:
            bias = None if c is None or beta == 0.0 else c if beta == 1.0 else c * beta
            if bias is None or (bias.dim() == 1 and bias.shape[0] == wc.shape[0 if tb else 1]):
                return lin(a, bias)
            return lin(a, None) + bias
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
