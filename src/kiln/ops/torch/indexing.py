"""Torch kernels for indexing: gathers and TopK."""

from __future__ import annotations

import math

import torch

from kiln.ops._array import axis as norm_axis
from kiln.ops.indexing import in_range
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    decided,
    dtype_in,
    ints,
    known_dim,
    known_rank,
)

_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


_INDEX = (torch.int32, torch.int64)


@kernel("Gather", 1, prepare=True)  # faster than the generic kernel (index_select)
def gather(site):
    axis = int(site.attr("axis", 0))
    k = site.const(1)
    if k is not None and k.ndim == 0 and k.dtype.kind in "iu":
        # A constant scalar index (Shape -> Gather in every exported transformer): one
        # select, which counts negative indices from the end and raises out of range, as
        # ONNX says; the general path below is four torch calls.
        k = int(k)
        return lambda x, indices: x.select(axis, k)
    # other index types (and a node whose indices' type is unknown: checked each call)
    # take the shared kernel
    ok = dtype_in(site, 1, _INDEX)
    if axis == 0 and known_rank(site, 1) != 0:
        run = _take_rows
    else:
        run = lambda x, indices: _gather(x, indices, axis)  # noqa: E731
    return decided(site, [ok], run, lambda x, indices: indices.dtype in _INDEX)


def _take_rows(x, indices):
    """Gather on axis 0 (embedding lookups) as one indexing, which counts negative indices
    from the end and raises out of range as ONNX says: half the time for 16 rows of a
    BERT table (on other axes it is slower than index_select)."""
    if indices.dim() == 0 or indices.device != x.device:
        return _gather(x, indices, 0)  # x[0-d tensor] would read it on the host
    return x[indices]


def _gather(x, indices, axis: int):
    a = norm_axis(axis, x.dim())
    if indices.device != x.device:
        indices = indices.to(x.device)
    # index_select on the flattened indices: any index rank, and traceable (a 0-d tensor
    # index would read its value on the host)
    flat = indices.reshape(-1)
    flat = torch.where(flat < 0, flat + x.shape[a], flat)
    y = x.index_select(a, flat)
    return y.reshape(tuple(x.shape[:a]) + tuple(indices.shape) + tuple(x.shape[a + 1 :]))


# traceable: the generic kernel's range check reads a value on the host, which stops
# torch.compile
@kernel("GatherElements", 11, prepare=True)
def gather_elements(site):
    axis = int(site.attr("axis", 0))

    def run(data, indices):
        if indices.device != data.device:
            indices = indices.to(data.device)  # indices fed on another device
        a = norm_axis(axis, data.dim())
        # torch.gather raises on an index outside [0, n): so does ONNX after the wrap
        idx = torch.where(indices < 0, indices + data.shape[a], indices)
        return torch.gather(data, a, idx if idx.dtype == torch.int64 else idx.long())

    return decided(site, [dtype_in(site, 1, _INDEX)], run,
                   lambda data, indices: indices.dtype in _INDEX)


def _in_range(idx, n: int):
    """``idx`` when every index lies in [0, n), else an error (indexing would wrap a
    negative one around). While torch.compile traces, the check is an assertion inside the
    program: reading its result on the host would stop the trace."""
    if torch.compiler.is_compiling():
        torch._assert_async(
            ((idx >= 0) & (idx < n)).all(),
            f"an index is out of range: indices must lie in [{-n}, {n - 1}]",
        )
        return idx
    return in_range(torch, idx, n)


@kernel("GatherND", 11, prepare=True)
def gather_nd(site):
    b = int(site.attr("batch_dims", 0))
    depth, rank = known_dim(site, 1, -1), known_rank(site, 0)
    # the index depth and ranks: past the data's rank is the shared kernel's error
    fits = None if depth is None or rank is None else b + depth <= rank
    return decided(site, [dtype_in(site, 1, _INDEX), fits],
                   lambda data, indices: _gather_nd(data, indices, b),
                   lambda data, indices: indices.dtype in _INDEX
                   and b + indices.shape[-1] <= data.dim())


def _gather_nd(data, indices, b: int):
    k = indices.shape[-1]
    bshape = tuple(data.shape[:b])
    nb = math.prod(bshape)
    d = data.reshape((nb,) + tuple(data.shape[b:]))
    idx = indices.to(torch.int64).reshape(nb, -1, k)
    if idx.device != d.device:
        idx = idx.to(d.device)
    cols = []
    for i in range(k):
        n = d.shape[1 + i]
        c = idx[..., i]
        cols.append(_in_range(torch.where(c < 0, c + n, c), n))
    bidx = torch.arange(nb, device=d.device).reshape(nb, 1)
    y = d[(bidx, *cols)]
    return y.reshape(tuple(indices.shape[:-1]) + tuple(data.shape[b + k :]))


@kernel("TopK", 11, dtypes=FLOATS + _INTS)
def topk(x, k, *, axis=-1, largest=1, sorted=1):  # noqa: A002
    kk = ints(k)[0]
    a = norm_axis(axis, x.dim())
    # a stable sort keeps equal values in index order, as ONNX asks
    vals, idx = torch.sort(x, dim=a, descending=bool(largest), stable=True)
    return vals.narrow(a, 0, kk), idx.narrow(a, 0, kk)
