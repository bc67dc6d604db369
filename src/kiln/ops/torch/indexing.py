"""Torch kernels for indexing: gathers and TopK."""

from __future__ import annotations

import math

import torch

from kiln.ir import DType
from kiln.ops._array import axis as norm_axis
from kiln.ops.indexing import in_range
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    ints,
    known_dtype,
)

NI = NotImplemented
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


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
    if axis == 0:
        return _take_rows
    return lambda x, indices: _gather(x, indices, axis)


def _take_rows(x, indices):
    """Gather on axis 0 (embedding lookups) as one indexing, which counts negative indices
    from the end and raises out of range as ONNX says: half the time for 16 rows of a
    BERT table (on other axes it is slower than index_select)."""
    if (
        indices.dim() == 0
        or indices.dtype not in (torch.int32, torch.int64)
        or indices.device != x.device
    ):
        return _gather(x, indices, 0)
    return x[indices]


def _gather(x, indices, axis: int):
    if indices.dtype not in (torch.int32, torch.int64):
        return NI
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
def _int_indices(site) -> bool:
    """Whether the indices (input 1) may be int32/int64: unknown, or known to be."""
    return known_dtype(site, 1) in (None, DType.INT32, DType.INT64)


@kernel("GatherElements", 11, when=lambda site: _int_indices(site))
def gather_elements(data, indices, *, axis=0):
    if indices.dtype not in (torch.int32, torch.int64) or indices.device != data.device:
        return NI  # a type the plan did not know, or indices fed on another device
    a = norm_axis(axis, data.dim())
    # torch.gather raises on an index outside [0, n): so does ONNX after the wrap
    idx = torch.where(indices < 0, indices + data.shape[a], indices)
    return torch.gather(data, a, idx if idx.dtype == torch.int64 else idx.long())


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


@kernel("GatherND", 11, when=lambda site: _int_indices(site))
def gather_nd(data, indices, *, batch_dims=0):
    if indices.dtype not in (torch.int32, torch.int64):
        return NI  # a type the plan did not know
    b = batch_dims
    k = indices.shape[-1]
    if b + k > data.dim():
        return NI  # ranks and the index depth, read at run time: the NumPy kernel's error
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
