"""Index-driven ops: Gather/GatherElements/GatherND, Scatter/ScatterElements/ScatterND,
TensorScatter, Compress, NonZero, TopK, Unique and ReverseSequence. Negative indices
count from the back of their axis everywhere."""

from __future__ import annotations

import math

import numpy as np

from kiln.ops._array import axis as norm_axis
from kiln.ops._array import namespace
from kiln.ops._numeric import int_list
from kiln.ops.registry import op


def _wrap(idx, dim: int):
    """Negative indices count from the back; NumPy index arrays must be integers."""
    idx = np.asarray(idx)
    if idx.dtype != np.int64:
        idx = idx.astype(np.int64)
    return in_range(np, np.where(idx < 0, idx + dim, idx), dim)


def in_range(xp, idx, dim: int):
    """``idx`` (negative indices already counted from the back) when every index addresses
    one of ``dim`` entries, else IndexError: NumPy and torch indexing would wrap -11 on 10
    rows around a second time. ``xp``: the array namespace (NumPy's, torch)."""
    if bool(xp.any((idx < 0) | (idx >= dim))):
        raise IndexError(f"an index is out of range: indices must lie in [{-dim}, {dim - 1}] "
                         f"for an axis of {dim} entries")
    return idx


# -- gathers ----------------------------------------------------------------------------


@op("Gather", 1, generic=True)
def gather(data, indices, *, axis=0):
    xp = namespace(data, indices)
    ax = norm_axis(axis, data.ndim)
    dim = data.shape[ax]
    idx = in_range(xp, xp.where(indices < 0, indices + dim, indices), dim)
    flat = xp.reshape(idx, (-1,))
    out = xp.take(data, flat, axis=ax)
    shape = tuple(data.shape[:ax]) + tuple(indices.shape) + tuple(data.shape[ax + 1:])
    return xp.reshape(out, shape)


@op("GatherElements", 11, generic=True)
def gather_elements(data, indices, *, axis=0):
    xp = namespace(data, indices)
    ax = norm_axis(axis, data.ndim)
    dim = data.shape[ax]
    idx = in_range(xp, xp.where(indices < 0, indices + dim, indices), dim)
    return xp.take_along_axis(data, xp.astype(idx, xp.int64), axis=ax)


@op("GatherND", 11)
def gather_nd(data, indices, *, batch_dims=0):
    b = batch_dims
    k = indices.shape[-1]
    nb = math.prod(data.shape[:b])
    m = math.prod(indices.shape[b:-1])
    d = data.reshape((nb,) + data.shape[b:])
    ii = np.asarray(indices).reshape((nb, m, k))
    key = [np.arange(nb)[:, None]] + [_wrap(ii[..., j], d.shape[1 + j]) for j in range(k)]
    return d[tuple(key)].reshape(indices.shape[:-1] + data.shape[b + k:])


# -- scatters ---------------------------------------------------------------------------

_REDUCE = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _scatter_into(data, key, updates, reduction: str):
    out = np.array(data, copy=True)
    if reduction == "none":
        out[key] = updates
    else:  # ufunc.at applies duplicates one after the other
        _REDUCE[reduction].at(out, key, updates)
    return out


def _scatter_elements(data, indices, updates, axis: int, reduction: str):
    ax = norm_axis(axis, data.ndim)
    key = list(np.indices(indices.shape, sparse=True))
    key[ax] = _wrap(indices, data.shape[ax])
    return _scatter_into(data, tuple(key), updates, reduction)


@op("Scatter", 9)
@op("ScatterElements", 11)
def scatter_elements(data, indices, updates, *, axis=0, reduction="none"):
    return _scatter_elements(data, indices, updates, axis, reduction)


@op("ScatterND", 11)
def scatter_nd(data, indices, updates, *, reduction="none"):
    k = indices.shape[-1]
    key = tuple(_wrap(indices[..., j], data.shape[j]) for j in range(k))
    return _scatter_into(data, key, updates, reduction)


@op("TensorScatter", 24)
def tensor_scatter(past_cache, update, write_indices=None, *, axis=-2, mode="linear"):
    """Write ``update`` into a copy of the cache at each batch row's write index."""
    ax = norm_axis(axis, past_cache.ndim)
    batch, seq, cap = past_cache.shape[0], update.shape[ax], past_cache.shape[ax]
    start = np.zeros(batch, np.int64) if write_indices is None else write_indices
    pos = np.asarray(start, np.int64).reshape(-1, 1) + np.arange(seq)
    if mode == "circular":
        pos %= cap
    out = np.array(past_cache, copy=True)
    # axis 1 holds the sequence in both views; the views write through to out
    np.moveaxis(out, ax, 1)[np.arange(batch)[:, None], pos] = np.moveaxis(update, ax, 1)
    return out


# -- selections -------------------------------------------------------------------------


@op("Compress", 9)
def compress(x, condition, *, axis=None):
    cond = np.asarray(condition).reshape(-1).astype(bool)
    if axis is None:
        return np.compress(cond, x.reshape(-1))
    return np.compress(cond, x, axis=norm_axis(axis, x.ndim))


@op("NonZero", 9, differentiable=False)
def nonzero(x):
    """Indices of non-zero elements, shape (rank, count); a scalar gives (0, count)."""
    x = np.asarray(x)
    if x.ndim == 0:
        return np.zeros((0, int(bool(x))), dtype=np.int64)
    return np.array(np.nonzero(x), dtype=np.int64).reshape(x.ndim, -1)


def _sorted_order(xm, largest: int):
    """Full stable order along the last axis; ties keep the lower index first in both
    directions (descending = a stable ascending sort of the reversed axis, read back)."""
    n = xm.shape[-1]
    if largest:
        return (n - 1) - np.argsort(xm[..., ::-1], axis=-1, kind="stable")[..., ::-1]
    return np.argsort(xm, axis=-1, kind="stable")


def _partial_order(xm, k: int, largest: int):
    """The k best along the last axis in O(n): partition for the k-th value, keep what
    beats it plus the lowest-index ties, then sort only those k."""
    n = xm.shape[-1]
    kth = n - k if largest else k - 1
    thr = np.partition(xm, kth, axis=-1)[..., kth:kth + 1]
    better = xm > thr if largest else xm < thr
    tie = xm == thr
    need = k - better.sum(axis=-1, keepdims=True)
    keep = better | (tie & (np.cumsum(tie, axis=-1) <= need))
    cand = np.nonzero(keep.reshape(-1, n))[1].reshape(xm.shape[:-1] + (k,))
    return np.take_along_axis(cand, _sorted_order(np.take_along_axis(xm, cand, -1), largest),
                              axis=-1)


def _topk(x, k: int, axis: int, largest: int):
    ax = norm_axis(axis, x.ndim)
    xm = np.moveaxis(x, ax, -1)
    n = xm.shape[-1]
    fast = 0 < 4 * k < n and xm.dtype.kind in "iuf" and not (
        xm.dtype.kind == "f" and np.isnan(xm).any())  # NaN breaks the counting
    idx = _partial_order(xm, k, largest) if fast else _sorted_order(xm, largest)[..., :k]
    vals = np.take_along_axis(xm, idx, axis=-1)
    return np.moveaxis(vals, -1, ax), np.moveaxis(idx, -1, ax).astype(np.int64)


@op("TopK", 1)
def topk1(x, *, k=None, axis=-1):
    return _topk(x, k, axis, 1)


@op("TopK", 10, host_inputs=(1,))
def topk(x, k, *, axis=-1, largest=1, sorted=1):
    return _topk(x, int_list(k)[0], axis, largest)


@op("Unique", 11, differentiable=False)
def unique(ctx, x, *, axis=None, sorted=1):
    """np.unique, reordered by first occurrence when ``sorted`` is 0."""
    src = x.reshape(-1) if axis is None else x
    ax = None if axis is None else norm_axis(axis, x.ndim)
    y, first, inverse, counts = np.unique(src, return_index=True, return_inverse=True,
                                          return_counts=True, axis=ax)
    inverse = inverse.reshape(-1)
    if not sorted:
        order = np.argsort(first, kind="stable")
        rank = np.empty_like(order)
        rank[order] = np.arange(order.size)
        y = np.take(y, order, axis=0 if ax is None else ax)
        first, counts, inverse = first[order], counts[order], rank[inverse]
    outs = (y, first.astype(np.int64), inverse.astype(np.int64), counts.astype(np.int64))
    return outs[:max(ctx.num_outputs, 1)]


@op("ReverseSequence", 10)
def reverse_sequence(x, sequence_lens, *, batch_axis=1, time_axis=0):
    """Reverse the first ``sequence_lens[b]`` time steps of each batch entry."""
    steps = x.shape[time_axis]
    t = np.arange(steps)
    lens = np.asarray(sequence_lens).astype(np.int64).reshape(-1, 1)
    src = np.where(t < lens, lens - 1 - t, t)  # (batch, time)
    if batch_axis > time_axis:
        src = src.T
    shape = [1] * x.ndim
    shape[batch_axis], shape[time_axis] = x.shape[batch_axis], steps
    return np.take_along_axis(x, src.reshape(shape), axis=time_axis)
