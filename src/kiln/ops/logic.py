"""Comparisons, boolean logic, bitwise ops, BitShift and Where (array-API kernels)."""

from __future__ import annotations

from kiln.ops import cost
from kiln.ops._array import namespace
from kiln.ops._numeric import legacy_broadcast
from kiln.ops.registry import op

# -- comparisons ------------------------------------------------------------------------


@op("Equal", 1, generic=True, differentiable=False, cost=cost.elementwise)
def equal_legacy(a, b, *, broadcast=0, axis=None):
    return a == legacy_broadcast(b, a.ndim, broadcast, axis)


@op("Greater", 1, generic=True, differentiable=False, cost=cost.elementwise)
def greater_legacy(a, b, *, broadcast=0, axis=None):
    return a > legacy_broadcast(b, a.ndim, broadcast, axis)


@op("Less", 1, generic=True, differentiable=False, cost=cost.elementwise)
def less_legacy(a, b, *, broadcast=0, axis=None):
    return a < legacy_broadcast(b, a.ndim, broadcast, axis)


@op("Equal", 7, generic=True, differentiable=False, cost=cost.elementwise)
def equal(a, b):
    return a == b


@op("Greater", 7, generic=True, differentiable=False, cost=cost.elementwise)
def greater(a, b):
    return a > b


@op("Less", 7, generic=True, differentiable=False, cost=cost.elementwise)
def less(a, b):
    return a < b


@op("GreaterOrEqual", 12, generic=True, differentiable=False, cost=cost.elementwise)
def greater_or_equal(a, b):
    return a >= b


@op("LessOrEqual", 12, generic=True, differentiable=False, cost=cost.elementwise)
def less_or_equal(a, b):
    return a <= b


# -- boolean logic ----------------------------------------------------------------------


@op("And", 1, generic=True, differentiable=False, cost=cost.elementwise)
def and_legacy(a, b, *, broadcast=0, axis=None):
    return namespace(a, b).logical_and(a, legacy_broadcast(b, a.ndim, broadcast, axis))


@op("Or", 1, generic=True, differentiable=False, cost=cost.elementwise)
def or_legacy(a, b, *, broadcast=0, axis=None):
    return namespace(a, b).logical_or(a, legacy_broadcast(b, a.ndim, broadcast, axis))


@op("Xor", 1, generic=True, differentiable=False, cost=cost.elementwise)
def xor_legacy(a, b, *, broadcast=0, axis=None):
    return namespace(a, b).logical_xor(a, legacy_broadcast(b, a.ndim, broadcast, axis))


@op("And", 7, generic=True, differentiable=False, cost=cost.elementwise)
def and_(a, b):
    return namespace(a, b).logical_and(a, b)


@op("Or", 7, generic=True, differentiable=False, cost=cost.elementwise)
def or_(a, b):
    return namespace(a, b).logical_or(a, b)


@op("Xor", 7, generic=True, differentiable=False, cost=cost.elementwise)
def xor(a, b):
    return namespace(a, b).logical_xor(a, b)


@op("Not", 1, generic=True, differentiable=False, cost=cost.elementwise)
def not_(x):
    return namespace(x).logical_not(x)


# -- bitwise ----------------------------------------------------------------------------


@op("BitwiseAnd", 18, generic=True, differentiable=False)
def bitwise_and(a, b):
    return namespace(a, b).bitwise_and(a, b)


@op("BitwiseOr", 18, generic=True, differentiable=False)
def bitwise_or(a, b):
    return namespace(a, b).bitwise_or(a, b)


@op("BitwiseXor", 18, generic=True, differentiable=False)
def bitwise_xor(a, b):
    return namespace(a, b).bitwise_xor(a, b)


@op("BitwiseNot", 18, generic=True, differentiable=False)
def bitwise_not(x):
    return namespace(x).bitwise_invert(x)


@op("BitShift", 11, generic=True, differentiable=False, cost=cost.elementwise)
def bit_shift(x, y, *, direction=None):
    """Shift amounts outside [0, bits) give what sign extension alone would: -1 for a
    right shift of a negative value, else 0 (C leaves them undefined)."""
    xp = namespace(x, y)
    x, y = xp.broadcast_arrays(x, y)
    bits = x.dtype.itemsize * 8
    ok = (y >= 0) & (y < bits)
    safe = xp.where(ok, y, xp.zeros_like(y))
    right = str(direction).upper() == "RIGHT"
    z = xp.bitwise_right_shift(x, safe) if right else xp.bitwise_left_shift(x, safe)
    if bool(xp.all(ok)):
        return z
    fill = xp.zeros_like(x)
    if right:
        fill = xp.where(x < 0, fill - 1, fill)
    return xp.where(ok, z, fill)


# -- selection --------------------------------------------------------------------------


@op("Where", 9, generic=True, cost=cost.elementwise)
def where(cond, x, y):
    return namespace(x, y).where(cond, x, y)
