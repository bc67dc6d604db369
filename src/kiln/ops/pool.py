"""Pooling: MaxPool (with Indices), AveragePool, LpPool, their Global forms, MaxUnpool.

Windows are reduced one spatial axis at a time (max and sum are separable), each axis as a
short loop over kernel offsets with a vectorized ufunc over the whole tensor; padding is
never materialized, each offset just covers the outputs whose window reaches the input.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.ops import cost
from kiln.ops._array import ints
from kiln.ops.conv import conv_pads, out_size, pad_spatial, scratch, spatial_attrs, work_dtype
from kiln.ops.registry import op


def _geometry(x, kernel_shape, strides, dilations, pads, auto_pad, ceil_mode):
    """(begin pads, end pads, extra end pads so every window fits, output shape)."""
    nd = len(kernel_shape)
    strides, dilations = spatial_attrs(nd, strides, dilations)
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad in ("SAME_UPPER", "SAME_LOWER", "VALID"):
        ceil_mode = False  # the spec's auto_pad output sizes match floor mode here
    begin, end = conv_pads(x.shape[2:], kernel_shape, strides, dilations, auto_pad, pads)
    out = [out_size(n, k, s, d, b, e, bool(ceil_mode)) for n, k, s, d, b, e in
           zip(x.shape[2:], kernel_shape, strides, dilations, begin, end)]
    extra = [max(0, (o - 1) * s + (k - 1) * d + 1 - (n + b + e)) for o, k, s, d, n, b, e in
             zip(out, kernel_shape, strides, dilations, x.shape[2:], begin, end)]
    return strides, dilations, begin, end, extra, out


def _axis_window(y, axis, i, s, d, o):
    """The elements kernel offset ``i`` sees along ``axis``, for every output position."""
    idx = [slice(None)] * y.ndim
    idx[axis] = slice(i * d, i * d + (o - 1) * s + 1, s)
    return y[tuple(idx)]


def _reduce_axis(y, axis, k, s, d, b, o, ufunc, fill, out):
    """Reduce windows along one axis of the unpadded ``y`` into ``out``; positions a
    window finds outside ``y`` (padding) count as ``fill``."""
    n = y.shape[axis]
    spans = []
    for i in range(k):
        lo = max(0, -(-(b - i * d) // s))
        hi = min(o, -(-(n + b - i * d) // s))
        if hi > lo:
            start = lo * s - b + i * d
            spans.append((lo, hi, slice(start, start + (hi - lo - 1) * s + 1, s)))
    full = next((sp for sp in spans if sp[0] == 0 and sp[1] == o), None)
    pre = (slice(None),) * axis
    if full is not None:
        np.copyto(out, y[pre + (full[2],)])
    else:
        out.fill(fill)
    for lo, hi, src in spans:
        if (lo, hi, src) != full:
            dst = out[pre + (slice(lo, hi),)]
            ufunc(dst, y[pre + (src,)], out=dst)
    return out


def _reduce_windows(x, kernel, strides, dilations, begin, out, ufunc, fill):
    """Apply ``ufunc`` (np.maximum, np.add) over every window, one axis at a time, without
    materializing the padded input."""
    y = x
    last = len(kernel) - 1
    for ax, (k, s, d, b, o) in enumerate(zip(kernel, strides, dilations, begin, out)):
        shape = y.shape[:ax + 2] + (o,) + y.shape[ax + 3:]
        dst = np.empty(shape, y.dtype) if ax == last else scratch(f"pool{ax % 2}", shape,
                                                                   y.dtype)
        y = _reduce_axis(y, ax + 2, k, s, d, b, o, ufunc, fill, dst)
    return y


def _lowest(dtype):
    return -np.inf if np.issubdtype(dtype, np.floating) or dtype.kind == "V" else \
        np.iinfo(dtype).min


def _flat_index(shape, storage_order):
    """Each input element's flat index (column-major over the spatial axes if asked)."""
    n, c = shape[:2]
    sp = shape[2:]
    if not storage_order:
        return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)
    spatial = np.arange(math.prod(sp), dtype=np.int64).reshape(sp[::-1]).T
    base = np.arange(n * c, dtype=np.int64).reshape(n, c) * math.prod(sp)
    return base.reshape((n, c) + (1,) * len(sp)) + spatial


def _argmax_windows(xp, ip, kernel, strides, dilations, out):
    """Max and the index (from ``ip``) of its first occurrence in every window."""
    y, idx = xp, ip
    for ax, (k, s, d, o) in enumerate(zip(kernel, strides, dilations, out)):
        best = np.array(_axis_window(y, ax + 2, 0, s, d, o), copy=True)
        bidx = np.array(_axis_window(idx, ax + 2, 0, s, d, o), copy=True)
        for i in range(1, k):
            v = _axis_window(y, ax + 2, i, s, d, o)
            better = (v > best) | (np.isnan(best) & ~np.isnan(v)) if y.dtype.kind == "f" \
                else v > best  # a NaN is skipped, as in the values above
            np.copyto(best, v, where=better)
            np.copyto(bidx, _axis_window(idx, ax + 2, i, s, d, o), where=better)
        y, idx = best, bidx
    return y, idx


@op("MaxPool", 1, cost=cost.pool)
def max_pool(ctx, x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None,
             pads=None, storage_order=0, strides=None):
    kernel = list(kernel_shape)
    strides, dilations, begin, end, extra, out = _geometry(
        x, kernel, strides, dilations, pads, auto_pad, ceil_mode)
    low = _lowest(x.dtype)
    if ctx.num_outputs < 2:
        # fmax: a NaN in a window is skipped (its maximum is NaN only where every tap is),
        # as onnx.reference does; np.maximum would spread it to every window it touches
        return _reduce_windows(x, kernel, strides, dilations, begin, out, np.fmax, low)
    xp = pad_spatial(x, begin, [e + a for e, a in zip(end, extra)], low)
    ip = pad_spatial(_flat_index(x.shape, storage_order), begin,
                     [e + a for e, a in zip(end, extra)], -1)
    y, idx = _argmax_windows(xp, ip, kernel, strides, dilations, out)
    return y, idx


def _pool_sum(x, kernel, strides, dilations, begin, out, wd):
    return _reduce_windows(x.astype(wd, copy=False), kernel, strides, dilations, begin, out,
                           np.add, 0)


def _counts(shape, kernel, strides, dilations, begin, end, out, include_pad, wd):
    """How many elements each window averages: real ones, plus explicit pads if asked."""
    sp = shape[2:]
    if include_pad:
        ones = np.ones((1, 1) + tuple(n + b + e for n, b, e in zip(sp, begin, end)), wd)
        return _reduce_windows(ones, kernel, strides, dilations, [0] * len(sp), out, np.add, 0)
    ones = np.ones((1, 1) + tuple(sp), wd)
    return _reduce_windows(ones, kernel, strides, dilations, begin, out, np.add, 0)


@op("AveragePool", 1, cost=cost.pool)
def average_pool(x, *, auto_pad="NOTSET", ceil_mode=0, count_include_pad=0, dilations=None,
                 kernel_shape=None, pads=None, strides=None):
    kernel = list(kernel_shape)
    strides, dilations, begin, end, extra, out = _geometry(
        x, kernel, strides, dilations, pads, auto_pad, ceil_mode)
    wd = work_dtype(x.dtype)
    y = _pool_sum(x, kernel, strides, dilations, begin, out, wd)
    if count_include_pad and not any(extra):
        y /= wd.type(math.prod(kernel))
    else:
        with np.errstate(invalid="ignore", divide="ignore"):
            y /= _counts(x.shape, kernel, strides, dilations, begin, end, out,
                         count_include_pad, wd)
    return y.astype(x.dtype, copy=False)


@op("LpPool", 1, cost=cost.pool)
def lp_pool(x, *, auto_pad="NOTSET", ceil_mode=0, dilations=None, kernel_shape=None, p=2,
            pads=None, strides=None):
    kernel = list(kernel_shape)
    strides, dilations, begin, end, extra, out = _geometry(
        x, kernel, strides, dilations, pads, auto_pad, ceil_mode)
    wd = work_dtype(x.dtype)
    xa = np.abs(x.astype(wd, copy=False))
    y = _pool_sum(xa if p == 1 else xa ** wd.type(p), kernel, strides, dilations, begin,
                  out, wd)
    return (y if p == 1 else y ** wd.type(1.0 / p)).astype(x.dtype, copy=False)


def _spatial_axes(x):
    return tuple(range(2, x.ndim))


@op("GlobalAveragePool", 1, cost=cost.reduce)
def global_average_pool(x):
    wd = work_dtype(x.dtype)
    y = x.astype(wd, copy=False).mean(axis=_spatial_axes(x), keepdims=True)
    return y.astype(x.dtype, copy=False)


@op("GlobalMaxPool", 1, cost=cost.reduce)
def global_max_pool(x):
    return x.max(axis=_spatial_axes(x), keepdims=True)


@op("GlobalLpPool", 1, cost=cost.reduce)
def global_lp_pool(x, *, p=2):
    wd = work_dtype(x.dtype)
    xa = np.abs(x.astype(wd, copy=False))
    y = (xa ** wd.type(p)).sum(axis=_spatial_axes(x), keepdims=True) ** wd.type(1.0 / p)
    return y.astype(x.dtype, copy=False)


@op("MaxUnpool", 9, host_inputs=(2,))
def max_unpool(x, indices, output_shape=None, *, kernel_shape=None, pads=None,
               strides=None):
    """Scatter ``x`` to the flat positions ``indices`` of a zero tensor. The indices
    address the shape the pooling attributes imply; an ``output_shape`` then pads or
    crops that at the end (as ONNX's tests expect; onnxruntime reads them in the frame of
    ``output_shape`` instead)."""
    nd = x.ndim - 2
    strides = list(strides or [1] * nd)
    pads = list(pads or [0] * (2 * nd))
    shape = x.shape[:2] + tuple((n - 1) * s + k - pads[i] - pads[i + nd] for i, (n, s, k)
                                in enumerate(zip(x.shape[2:], strides, kernel_shape)))
    y = np.zeros(math.prod(shape), dtype=x.dtype)
    y[indices.reshape(-1)] = x.reshape(-1)
    y = y.reshape(shape)
    if output_shape is not None:
        target = ints(output_shape)[2:]
        y = pad_spatial(y, [0] * nd, [t - n for t, n in zip(target, shape[2:])])
    return y
