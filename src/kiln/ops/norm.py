"""Normalizations: BatchNormalization, InstanceNormalization, LayerNormalization,
GroupNormalization, RMSNormalization, LRN, MeanVarianceNormalization, LpNormalization.

Statistics are computed in float32 (or the ``stash_type``) for half-precision inputs and
the normalized result is cast back before the scale and bias, as the spec describes.
"""

from __future__ import annotations

import numpy as np
from onnx import helper

from kiln.ops import cost
from kiln.ops._array import axis as norm_axis
from kiln.ops.conv import work_dtype
from kiln.ops.registry import op


def _stash(stash_type: int, x: np.ndarray) -> np.dtype:
    """The dtype stage one computes in: ``stash_type``, but never less precise than x."""
    if x.dtype == np.float64:
        return np.dtype(np.float64)
    try:
        return np.dtype(helper.tensor_dtype_to_np_dtype(stash_type))
    except (KeyError, TypeError):
        return np.dtype(np.float32)


def _channel(v, ndim: int) -> np.ndarray:
    """A per-channel vector shaped to broadcast over (N, C, ...)."""
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _bn_apply(x, scale, b, mean, var, epsilon, spatial=True):
    wd = work_dtype(x.dtype)
    shape = (lambda v: _channel(v, x.ndim)) if spatial else (lambda v: v[None])
    a = scale.astype(wd) / np.sqrt(var.astype(wd) + wd.type(epsilon))
    shift = b.astype(wd) - mean.astype(wd) * a
    y = x.astype(wd) * shape(a)
    y += shape(shift)
    return y.astype(x.dtype, copy=False)


def _batch_stats(x, wd):
    axes = (0,) + tuple(range(2, x.ndim))
    xw = x.astype(wd, copy=False)
    mean = xw.mean(axis=axes)
    var = np.square(xw - _channel(mean, x.ndim)).mean(axis=axes)
    return mean, var


@op("BatchNormalization", 1, cost=cost.per_element(2))
def batch_norm_legacy(ctx, x, scale, b, mean, var, *, epsilon=1e-5, is_test=0, momentum=0.9,
                      spatial=1):
    """Opsets 1-13: inference, or batch statistics when the training outputs are used."""
    if ctx.num_outputs == 1 or is_test:
        return _bn_apply(x, scale, b, mean, var, epsilon, bool(spatial))
    wd = work_dtype(x.dtype)
    bm, bv = _batch_stats(x, wd)
    y = _bn_apply(x, scale, b, bm, bv, epsilon)
    run_mean = (mean * momentum + bm * (1 - momentum)).astype(mean.dtype)
    run_var = (var * momentum + bv * (1 - momentum)).astype(var.dtype)
    outs = (y, run_mean, run_var, bm.astype(mean.dtype), bv.astype(var.dtype))
    return outs[:ctx.num_outputs]


@op("BatchNormalization", 14, cost=cost.per_element(2))
def batch_norm(ctx, x, scale, b, input_mean, input_var, *, epsilon=1e-5, momentum=0.9,
               training_mode=0):
    if not training_mode:
        y = _bn_apply(x, scale, b, input_mean, input_var, epsilon)
        return y if ctx.num_outputs == 1 else (y,) + (None,) * (ctx.num_outputs - 1)
    wd = work_dtype(x.dtype)
    mean, var = _batch_stats(x, wd)
    y = _bn_apply(x, scale, b, mean, var, epsilon)
    run_mean = input_mean * momentum + mean.astype(input_mean.dtype) * (1 - momentum)
    run_var = input_var * momentum + var.astype(input_var.dtype) * (1 - momentum)
    outs = (y, run_mean.astype(input_mean.dtype), run_var.astype(input_var.dtype))
    return outs[:ctx.num_outputs] if ctx.num_outputs > 1 else y


def _standardize(x, axes, epsilon, wd):
    """(x - mean) / sqrt(var + eps) over ``axes`` in ``wd``; also mean and 1/std."""
    xw = x.astype(wd, copy=True)
    mean = xw.mean(axis=axes, keepdims=True)
    xw -= mean
    var = np.square(xw).mean(axis=axes, keepdims=True)
    inv = 1 / np.sqrt(var + wd.type(epsilon))
    xw *= inv
    return xw, mean, inv


@op("InstanceNormalization", 1, cost=cost.per_element(5))
def instance_norm(x, scale, b, *, epsilon=1e-5):
    wd = work_dtype(x.dtype)
    y, _, _ = _standardize(x, tuple(range(2, x.ndim)), epsilon, wd)
    y *= _channel(scale.astype(wd), x.ndim)
    y += _channel(b.astype(wd), x.ndim)
    return y.astype(x.dtype, copy=False)


@op("LayerNormalization", 17, cost=cost.per_element(5))
def layer_norm(ctx, x, scale, b=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    ax = norm_axis(axis, x.ndim)
    wd = _stash(stash_type, x)
    y, mean, inv = _standardize(x, tuple(range(ax, x.ndim)), epsilon, wd)
    y = y.astype(x.dtype, copy=False)
    y *= scale
    if b is not None:
        y += b
    if ctx.num_outputs == 1:
        return y
    sd = np.dtype(helper.tensor_dtype_to_np_dtype(stash_type)) if stash_type else wd
    return (y, mean.astype(sd), inv.astype(sd))[:ctx.num_outputs]


def _group_norm(x, scale, bias, num_groups, epsilon, wd, per_channel):
    n, c = x.shape[:2]
    xg = x.reshape(n, num_groups, -1)
    y, _, _ = _standardize(xg, (2,), epsilon, wd)
    y = y.reshape(x.shape).astype(x.dtype, copy=False)
    if not per_channel:
        scale, bias = np.repeat(scale, c // num_groups), np.repeat(bias, c // num_groups)
    y *= _channel(scale.astype(x.dtype, copy=False), x.ndim)
    y += _channel(bias.astype(x.dtype, copy=False), x.ndim)
    return y


@op("GroupNormalization", 18, cost=cost.per_element(5))
def group_norm_18(x, scale, bias, *, epsilon=1e-5, num_groups=None):
    """Opset 18: ``scale`` and ``bias`` hold one value per group."""
    return _group_norm(x, scale, bias, num_groups, epsilon, work_dtype(x.dtype), False)


@op("GroupNormalization", 21, cost=cost.per_element(5))
def group_norm(x, scale, bias, *, epsilon=1e-5, num_groups=None, stash_type=1):
    return _group_norm(x, scale, bias, num_groups, epsilon, _stash(stash_type, x), True)


@op("RMSNormalization", 23, cost=cost.per_element(4))
def rms_norm(x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    ax = norm_axis(axis, x.ndim)
    wd = _stash(stash_type, x)
    xw = x.astype(wd, copy=True)
    ms = np.square(xw).mean(axis=tuple(range(ax, x.ndim)), keepdims=True)
    xw /= np.sqrt(ms + wd.type(epsilon))
    y = xw.astype(x.dtype, copy=False)
    y *= scale
    return y


@op("LRN", 1, cost=cost.per_element(5))
def lrn(x, *, alpha=1e-4, beta=0.75, bias=1.0, size=None):
    wd = work_dtype(x.dtype)
    sq = np.square(x.astype(wd))
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    pad = [(0, 0)] * x.ndim
    pad[1] = (lo, hi)
    sqp = np.pad(sq, pad)
    c = x.shape[1]
    acc = np.zeros_like(sq)
    for i in range(size):
        acc += sqp[:, i:i + c]
    acc *= wd.type(alpha / size)
    acc += wd.type(bias)
    return (x.astype(wd) / acc ** wd.type(beta)).astype(x.dtype, copy=False)


@op("MeanVarianceNormalization", 9)
def mean_variance_norm(x, *, axes=(0, 2, 3)):
    wd = work_dtype(x.dtype)
    axes = tuple(norm_axis(a, x.ndim) for a in axes)
    xw = x.astype(wd, copy=True)
    xw -= xw.mean(axis=axes, keepdims=True)
    std = np.sqrt(np.square(xw).mean(axis=axes, keepdims=True))
    xw /= std + wd.type(1e-9)
    return xw.astype(x.dtype, copy=False)


@op("LpNormalization", 1)
def lp_norm(x, *, axis=-1, p=2):
    """x / ||x||_p along ``axis``; zero where the norm is zero."""
    axis = norm_axis(axis, x.ndim)  # NumPy sums axis -1 of a scalar; onnxruntime refuses it
    wd = work_dtype(x.dtype)
    xw = x.astype(wd)
    if p == 1:
        nrm = np.abs(xw).sum(axis=axis, keepdims=True)
    else:
        nrm = np.sqrt(np.square(xw).sum(axis=axis, keepdims=True))
    with np.errstate(invalid="ignore", divide="ignore"):
        y = np.where(nrm == 0, wd.type(0), xw / nrm)
    return y.astype(x.dtype, copy=False)
