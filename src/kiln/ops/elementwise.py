"""Elementwise arithmetic and math: + - * / Mod Pow, unary functions, Clip, the variadic
Max/Min/Sum/Mean, IsInf/IsNaN and Erf. Written against the array API (``generic=True``)
except Erf, which the standard lacks."""

from __future__ import annotations

import functools
import operator

from kiln.ops import cost
from kiln.ops._array import NUMPY_NS, namespace, on_numpy
from kiln.ops._numeric import erf, is_float, is_int, keep_dtype, legacy_broadcast
from kiln.ops.registry import op

# -- binary arithmetic ------------------------------------------------------------------


def _int_div(xp, a, b):
    """Integer division truncating toward zero (C semantics), not NumPy's floor."""
    q = a // b
    r = a - q * b
    fix = (r != 0) & ((a < 0) != (b < 0))
    return xp.where(fix, q + xp.ones_like(q), q)


def _div(a, b):
    if is_int(a.dtype):
        return _int_div(namespace(a, b), a, b)
    return a / b


@op("Add", 1, generic=True, cost=cost.elementwise)
@op("Add", 6, generic=True, cost=cost.elementwise)
def add_legacy(a, b, *, broadcast=0, axis=None):
    return a + legacy_broadcast(b, a.ndim, broadcast, axis)


@op("Sub", 1, generic=True, cost=cost.elementwise)
@op("Sub", 6, generic=True, cost=cost.elementwise)
def sub_legacy(a, b, *, broadcast=0, axis=None):
    return a - legacy_broadcast(b, a.ndim, broadcast, axis)


@op("Mul", 1, generic=True, cost=cost.elementwise)
@op("Mul", 6, generic=True, cost=cost.elementwise)
def mul_legacy(a, b, *, broadcast=0, axis=None):
    return a * legacy_broadcast(b, a.ndim, broadcast, axis)


@op("Div", 1, generic=True, cost=cost.elementwise)
@op("Div", 6, generic=True, cost=cost.elementwise)
def div_legacy(a, b, *, broadcast=0, axis=None):
    return _div(a, legacy_broadcast(b, a.ndim, broadcast, axis))


@op("Add", 7, generic=True, cost=cost.elementwise)
def add(a, b):
    return a + b


@op("Sub", 7, generic=True, cost=cost.elementwise)
def sub(a, b):
    return a - b


@op("Mul", 7, generic=True, cost=cost.elementwise)
def mul(a, b):
    return a * b


@op("Div", 7, generic=True, cost=cost.elementwise)
def div(a, b):
    return _div(a, b)


@op("Mod", 10, generic=True, cost=cost.elementwise)
def mod(a, b, *, fmod=0):
    """fmod=0: result takes the divisor's sign (Python %); fmod=1: the dividend's (C fmod)."""
    xp = namespace(a, b)
    if not fmod:
        return xp.remainder(a, b)
    r = xp.remainder(xp.abs(a), xp.abs(b))
    return xp.where(a < 0, -r, r)


@op("Pow", 1, generic=True, cost=cost.elementwise)
def pow_(x, y, *, broadcast=0, axis=None):
    """The result has the base's type. An integer base with a float or negative exponent
    is computed in float64 and truncated back (2 ** -1 == 0, as in C)."""
    xp = namespace(x, y)
    y = legacy_broadcast(y, x.ndim, broadcast, axis)
    if not is_float(x.dtype) and (is_float(y.dtype) or bool(xp.any(y < 0))):
        return xp.astype(xp.pow(xp.astype(x, xp.float64), xp.astype(y, xp.float64)), x.dtype)
    return xp.pow(x, y if y.dtype == x.dtype else xp.astype(y, x.dtype))


# -- unary math -------------------------------------------------------------------------


def _unary(name: str):
    """The prepare function of the unary op computing the namespace's ``name``."""

    def kernel(x):
        return getattr(namespace(x), name)(x)

    direct = getattr(NUMPY_NS, name)

    def prepare(site):
        # On NumPy arrays the namespace is known now: its function is the kernel (the
        # lookup per call cost as much as the op on a small tensor)
        return direct if on_numpy(site) else kernel

    kernel.__name__ = kernel.__qualname__ = name
    prepare.attributes = frozenset()  # none, as the plain kernel
    return prepare


_UNARY = dict(generic=True, prepare=True, cost=cost.elementwise)
# rounding, signs and tests have no useful gradient
_DISCRETE = dict(_UNARY, differentiable=False)
op("Abs", 1, **_UNARY)(_unary("abs"))
op("Neg", 1, **_UNARY)(_unary("negative"))
op("Ceil", 1, **_DISCRETE)(_unary("ceil"))
op("Floor", 1, **_DISCRETE)(_unary("floor"))
op("Round", 11, **_DISCRETE)(_unary("round"))
op("Sign", 9, **_DISCRETE)(_unary("sign"))
op("Sqrt", 1, **_UNARY)(_unary("sqrt"))
op("Exp", 1, **_UNARY)(_unary("exp"))
op("Log", 1, **_UNARY)(_unary("log"))
op("Sin", 7, **_UNARY)(_unary("sin"))
op("Cos", 7, **_UNARY)(_unary("cos"))
op("Tan", 7, **_UNARY)(_unary("tan"))
op("Asin", 7, **_UNARY)(_unary("asin"))
op("Acos", 7, **_UNARY)(_unary("acos"))
op("Atan", 7, **_UNARY)(_unary("atan"))
op("Sinh", 9, **_UNARY)(_unary("sinh"))
op("Cosh", 9, **_UNARY)(_unary("cosh"))
op("Tanh", 1, **_UNARY)(_unary("tanh"))
op("Asinh", 9, **_UNARY)(_unary("asinh"))
op("Acosh", 9, **_UNARY)(_unary("acosh"))
op("Atanh", 9, **_UNARY)(_unary("atanh"))
op("IsNaN", 9, **_DISCRETE)(_unary("isnan"))


@op("Reciprocal", 1, generic=True, cost=cost.elementwise)
@keep_dtype
def reciprocal(x):
    return 1.0 / x


@op("IsInf", 10, generic=True, differentiable=False, cost=cost.elementwise)
def isinf(x, *, detect_negative=1, detect_positive=1):
    xp = namespace(x)
    inf = xp.isinf(x)
    if detect_negative and detect_positive:
        return inf
    if detect_positive:
        return inf & (x > 0)
    if detect_negative:
        return inf & (x < 0)
    return xp.zeros_like(inf)


@op("Erf", 9, cost=cost.elementwise)
def erf_(x):
    return erf(x)


# -- clip and the variadic ops ----------------------------------------------------------


@op("Clip", 1, generic=True, cost=cost.elementwise)
@op("Clip", 6, generic=True, cost=cost.elementwise)
def clip_attrs(x, *, min=None, max=None):
    # Bounds at or beyond float32's range are "no bound" (opset 6's defaults are +-FLT_MAX).
    lo = None if min is None or abs(min) >= 3.4e38 else min
    hi = None if max is None or abs(max) >= 3.4e38 else max
    xp = namespace(x)
    if lo is not None:
        x = xp.maximum(x, lo)
    return x if hi is None else xp.minimum(x, hi)


@op("Clip", 11, generic=True, cost=cost.elementwise)
def clip(x, min=None, max=None):
    """min > max clips everything to max, as the spec asks (max applied last)."""
    xp = namespace(x)
    if min is not None:
        x = xp.maximum(x, xp.astype(min, x.dtype))
    if max is not None:
        x = xp.minimum(x, xp.astype(max, x.dtype))
    return x


@op("Max", 1, generic=True, cost=cost.elementwise)
def max_(*xs):
    xp = namespace(*xs)
    return functools.reduce(xp.maximum, xs)


@op("Min", 1, generic=True, cost=cost.elementwise)
def min_(*xs):
    xp = namespace(*xs)
    return functools.reduce(xp.minimum, xs)


@op("Sum", 1, generic=True, cost=cost.elementwise)
def sum_(*xs):
    return functools.reduce(operator.add, xs)


@op("Mean", 1, generic=True, cost=cost.elementwise)
@keep_dtype
def mean(*xs):
    return functools.reduce(operator.add, xs) / len(xs)

