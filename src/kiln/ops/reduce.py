"""Reductions (ReduceSum & co., ArgMax/ArgMin) as array-API kernels, and CumSum/CumProd.

Old opsets take ``axes`` as an attribute, new ones as an optional input, with
``noop_with_empty_axes``; both share one implementation per reduction."""

from __future__ import annotations

import math

import numpy as np

from kiln.ops import cost
from kiln.ops._array import axis as norm_axis
from kiln.ops._array import namespace
from kiln.ops._numeric import int_list, int_scalar, is_float, is_int
from kiln.ops.registry import op


def _acc(xp, x):
    """The dtype to sum in: float32 for 16-bit (and narrower) floats, else the input's."""
    if is_float(x.dtype) and x.dtype.itemsize < 4:
        return xp.float32
    return x.dtype


def _sum(xp, x, axes, keepdims):
    acc = _acc(xp, x)
    s = xp.sum(x, axis=axes, keepdims=keepdims, dtype=acc)
    return s if acc == x.dtype else xp.astype(s, x.dtype)


def _extreme(xp, x, axes, keepdims, fn, fill):
    if any(x.shape[a] == 0 for a in axes):  # empty set: the reduction's identity
        shape = tuple(1 if a in axes else d for a, d in enumerate(x.shape) if keepdims
                      or a not in axes)
        return xp.full(shape, fill(x.dtype), dtype=x.dtype, device=x.device)
    return fn(x, axis=axes, keepdims=keepdims)


def _int_info(dtype):
    # NumPy and torch dtypes print as "int32" / "torch.int32".
    return np.iinfo(np.dtype(str(dtype).removeprefix("torch.")))


def _lowest(dtype):
    """The identity of max: -inf, the type's minimum, or False."""
    if str(dtype).endswith("bool"):
        return False
    return -math.inf if is_float(dtype) else int(_int_info(dtype).min)


def _highest(dtype):
    """The identity of min: +inf, the type's maximum, or True."""
    if str(dtype).endswith("bool"):
        return True
    return math.inf if is_float(dtype) else int(_int_info(dtype).max)


def _mean(xp, x, axes, keepdims):
    n = math.prod(x.shape[a] for a in axes)
    if is_int(x.dtype):  # integer mean truncates, like a cast of the exact mean
        s = xp.sum(x, axis=axes, keepdims=keepdims, dtype=xp.float64)
        return xp.astype(s / n, x.dtype)
    acc = _acc(xp, x)
    s = xp.sum(x, axis=axes, keepdims=keepdims, dtype=acc) / n  # n == 0 gives NaN
    return s if s.dtype == x.dtype else xp.astype(s, x.dtype)


def _float_result(xp, fn, x):
    """Apply ``fn`` in floating point and cast back (L2/log of integer tensors)."""
    if is_float(x.dtype):
        return fn(x)
    return xp.astype(fn(xp.astype(x, xp.float64)), x.dtype)


def _log_sum_exp(xp, x, axes, keepdims):
    if not is_float(x.dtype):
        return _float_result(xp, lambda v: _log_sum_exp(xp, v, axes, keepdims), x)
    if any(x.shape[a] == 0 for a in axes):
        return _extreme(xp, x, axes, keepdims, None, lambda _: -math.inf)
    m = xp.max(x, axis=axes, keepdims=True)
    m = xp.where(xp.isinf(m), xp.zeros_like(m), m)
    s = xp.log(xp.sum(xp.exp(x - m), axis=axes, keepdims=True)) + m
    return s if keepdims else xp.squeeze(s, axis=axes)


# name -> (reduce(xp, x, axes, keepdims), elementwise(xp, x) for noop on empty axes)
_REDUCTIONS = {
    "ReduceSum": (_sum, None),
    "ReduceMean": (_mean, None),
    "ReduceMax": (lambda xp, x, a, k: _extreme(xp, x, a, k, xp.max, _lowest), None),
    "ReduceMin": (lambda xp, x, a, k: _extreme(xp, x, a, k, xp.min, _highest), None),
    "ReduceProd": (lambda xp, x, a, k: xp.prod(x, axis=a, keepdims=k, dtype=x.dtype), None),
    "ReduceSumSquare": (lambda xp, x, a, k: _sum(xp, x * x, a, k), lambda xp, x: x * x),
    "ReduceL1": (lambda xp, x, a, k: _sum(xp, xp.abs(x), a, k), lambda xp, x: xp.abs(x)),
    "ReduceL2": (lambda xp, x, a, k: _float_result(
        xp, lambda v: xp.sqrt(_sum(xp, v * v, a, k)), x), lambda xp, x: xp.abs(x)),
    "ReduceLogSum": (lambda xp, x, a, k: _float_result(
        xp, lambda v: xp.log(_sum(xp, v, a, k)), x),
        lambda xp, x: _float_result(xp, xp.log, x)),
    "ReduceLogSumExp": (_log_sum_exp, None),
}


def _reduce(name, x, axes, keepdims, noop):
    xp = namespace(x)
    fn, elementwise = _REDUCTIONS[name]
    if not axes:
        if noop:  # reducing over no axes: each element is its own set
            return x if elementwise is None else elementwise(xp, x)
        axes = range(x.ndim)
    axes = tuple(sorted({a + x.ndim if a < 0 else a for a in axes}))
    return fn(xp, x, axes, bool(keepdims))


def _with_attr(name: str):
    """The kernel of reduction ``name`` up to its opset with axes as an input."""

    def with_attr(data, *, axes=None, keepdims=1):
        return _reduce(name, data, axes, keepdims, 0)

    with_attr.__name__ = with_attr.__qualname__ = f"reduce_{name[6:].lower()}_attr"
    return with_attr


def _with_input(name: str):
    """The kernel of reduction ``name`` from its opset with axes as an input."""

    def with_input(data, axes=None, *, keepdims=1, noop_with_empty_axes=0):
        return _reduce(name, data, int_list(axes), keepdims, noop_with_empty_axes)

    with_input.__name__ = with_input.__qualname__ = f"reduce_{name[6:].lower()}"
    return with_input


_RED = dict(generic=True, cost=cost.reduce)
_RED_INPUT = dict(_RED, host_inputs=(1,))  # axes read on the host
op("ReduceSum", 1, **_RED)(_with_attr("ReduceSum"))
op("ReduceSum", 13, **_RED_INPUT)(_with_input("ReduceSum"))
op("ReduceMean", 1, **_RED)(_with_attr("ReduceMean"))
op("ReduceMean", 18, **_RED_INPUT)(_with_input("ReduceMean"))
op("ReduceMax", 1, **_RED)(_with_attr("ReduceMax"))
op("ReduceMax", 18, **_RED_INPUT)(_with_input("ReduceMax"))
op("ReduceMin", 1, **_RED)(_with_attr("ReduceMin"))
op("ReduceMin", 18, **_RED_INPUT)(_with_input("ReduceMin"))
op("ReduceProd", 1, **_RED)(_with_attr("ReduceProd"))
op("ReduceProd", 18, **_RED_INPUT)(_with_input("ReduceProd"))
op("ReduceL1", 1, **_RED)(_with_attr("ReduceL1"))
op("ReduceL1", 18, **_RED_INPUT)(_with_input("ReduceL1"))
op("ReduceL2", 1, **_RED)(_with_attr("ReduceL2"))
op("ReduceL2", 18, **_RED_INPUT)(_with_input("ReduceL2"))
op("ReduceLogSum", 1, **_RED)(_with_attr("ReduceLogSum"))
op("ReduceLogSum", 18, **_RED_INPUT)(_with_input("ReduceLogSum"))
op("ReduceLogSumExp", 1, **_RED)(_with_attr("ReduceLogSumExp"))
op("ReduceLogSumExp", 18, **_RED_INPUT)(_with_input("ReduceLogSumExp"))
op("ReduceSumSquare", 1, **_RED)(_with_attr("ReduceSumSquare"))
op("ReduceSumSquare", 18, **_RED_INPUT)(_with_input("ReduceSumSquare"))


# -- arg reductions ---------------------------------------------------------------------


def _arg(fn, x, axis, keepdims, select_last_index):
    xp = namespace(x)
    axis = norm_axis(axis, x.ndim)
    if select_last_index:  # search the flipped axis, then map indices back
        idx = fn(xp.flip(x, axis=axis), axis=axis, keepdims=bool(keepdims))
        idx = (x.shape[axis] - 1) - idx
    else:
        idx = fn(x, axis=axis, keepdims=bool(keepdims))
    return xp.astype(idx, xp.int64)


@op("ArgMax", 1, generic=True, differentiable=False, cost=cost.reduce)
def argmax(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg(namespace(data).argmax, data, axis, keepdims, select_last_index)


@op("ArgMin", 1, generic=True, differentiable=False, cost=cost.reduce)
def argmin(data, *, axis=0, keepdims=1, select_last_index=0):
    return _arg(namespace(data).argmin, data, axis, keepdims, select_last_index)


# -- cumulative -------------------------------------------------------------------------


def _cumulative(name: str, x, axis, exclusive, reverse):
    """cumulative_sum / cumulative_prod along ``axis``; ``exclusive`` starts from the
    identity (the array API's include_initial, last entry dropped)."""
    xp = namespace(x)
    ax = norm_axis(int_scalar(axis), x.ndim)
    if reverse:
        x = xp.flip(x, axis=ax)
    y = getattr(xp, name)(x, axis=ax, dtype=x.dtype, include_initial=bool(exclusive))
    if exclusive:
        y = y[(slice(None),) * ax + (slice(0, x.shape[ax]),)]
    return xp.flip(y, axis=ax) if reverse else y


@op("CumSum", 11, generic=True, host_inputs=(1,))
def cumsum(x, axis, *, exclusive=0, reverse=0):
    return _cumulative("cumulative_sum", x, axis, exclusive, reverse)


@op("CumProd", 26, generic=True)
def cumprod(x, axis, *, exclusive=0, reverse=0):
    return _cumulative("cumulative_prod", x, axis, exclusive, reverse)
