"""Torch kernels for shape and data-movement ops, constants and reductions.

Shape-valued results (Shape, Size) are made on the host: they are metadata, and ops that
take shapes (Reshape, Expand, Slice...) read them there without a device round trip.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ops._array import axis as norm_axis
from kiln.ops.indexing import in_range
from kiln.ops.registry import KILN_DOMAIN
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import FLOATS, axis, ints, scalar, to_torch

NI = NotImplemented
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _out_device(site):
    """Where a node that creates a tensor from nothing puts it."""
    node = site.node
    outs = [v for v in node.outputs if v is not None]
    if outs and all(v.meta.get("host") for v in outs):
        return torch.device("cpu")
    return site.target.device


# -- shapes -------------------------------------------------------------------------------

@kernel("Shape", 1)
def shape(x, *, start=0, end=None):
    if torch.compiler.is_compiling():
        return torch.tensor(x.shape[start:end], dtype=torch.int64)
    # via NumPy: a third of torch.tensor's cost for a handful of ints
    return torch.from_numpy(np.array(x.shape[start:end], np.int64))


@kernel("Size", 1)
def size(x):
    if torch.compiler.is_compiling():
        return torch.tensor(x.numel(), dtype=torch.int64)
    return torch.from_numpy(np.array(x.numel(), np.int64))


@kernel("Reshape", 5)  # faster than the generic kernel (Tensor.reshape, no NumPy shape)
def reshape(x, shape, *, allowzero=0):
    s = ints(shape)
    if not allowzero:
        s = [x.shape[i] if d == 0 else d for i, d in enumerate(s)]
    if -1 in s and x.numel() == 0:
        return NI  # -1 is ambiguous with zero elements
    return x.reshape(s)


@kernel("ChannelShuffle", 1, domain=KILN_DOMAIN)  # 4x the three ops; NHWC stays NHWC
def channel_shuffle(x, *, group=1):
    if x.dim() < 3 or x.shape[1] % group:
        return NI
    return torch.channel_shuffle(x, group)


@kernel("Transpose", 1)  # faster than the generic kernel (permute)
def transpose(x, *, perm=None):
    if perm is None:
        perm = list(range(x.dim()))[::-1]
    return x.permute(perm)


def _squeeze(x, axes):
    if axes is None:
        return x.squeeze()
    dims = tuple(axis(a, x.dim()) for a in axes)
    if any(x.shape[d] != 1 for d in dims):
        return NI
    return x.squeeze(dims) if dims else x


@kernel("Squeeze", 13)  # Tensor op, not array_api_compat's wrapper
def squeeze13(x, axes=None):
    return _squeeze(x, None if axes is None else ints(axes))


@kernel("Squeeze", 1, until=13)  # Tensor op, not array_api_compat's wrapper
def squeeze1(x, *, axes=None):
    return _squeeze(x, axes)


def _unsqueeze(x, axes):
    rank = x.dim() + len(axes)
    for a in sorted(axis(a, rank) for a in axes):
        x = x.unsqueeze(a)
    return x


@kernel("Unsqueeze", 13)  # Tensor op, not array_api_compat's wrapper
def unsqueeze13(x, axes):
    return _unsqueeze(x, ints(axes))


@kernel("Unsqueeze", 1, until=13)  # Tensor op, not array_api_compat's wrapper
def unsqueeze1(x, *, axes=None):
    return _unsqueeze(x, list(axes or []))


@kernel("Concat", 4)  # faster than the generic kernel (torch.cat, no None filtering)
def concat(*xs, axis=None):
    if axis is None or len({x.dtype for x in xs}) != 1:
        return NI
    if len({x.dim() for x in xs}) != 1:
        return NI
    return torch.cat(xs, axis)


@kernel("Split", 2, prepare=True)  # faster than the generic kernel (one split)
def split(site):
    ax = int(site.attr("axis", 0))
    n = site.num_outputs
    given = site.attr("split") if site.opset < 13 else site.const(1)
    # Constant sizes are read once; Tensor.split_with_sizes skips torch.split's Python
    # wrapper (half the time for three parts), BERT's merged q/k/v for example.
    fixed = None if given is None else [int(v) for v in np.asarray(given).reshape(-1)]

    def run(x, split=None):
        a = axis(ax, x.dim())
        sizes = fixed if fixed is not None or split is None else ints(split)
        if sizes:
            return tuple(x.split_with_sizes(sizes, a)) if sum(sizes) == x.shape[a] and \
                len(sizes) == n else NI  # the NumPy kernel says what is wrong
        d = x.shape[a]
        if site.opset < 18 and d % n:
            return NI
        chunk = -(-d // n)
        parts = tuple(torch.split(x, chunk, a)) if chunk else ()
        return parts if len(parts) == n else NI
    return run


_BOUND = 2 ** 62


def _forward(start, end, step) -> slice:
    """A positive-step ONNX slice as Python's, which wraps and clamps the same way; bounds
    beyond int64 are clamped first (torch warns about INT64_MIN)."""
    return slice(max(-_BOUND, min(_BOUND, int(start))), max(-_BOUND, min(_BOUND, int(end))),
                 int(step))


def _slice(x, starts, ends, axes, steps):
    idx = [slice(None)] * x.dim()
    flips = []
    for i, (s, e) in enumerate(zip(starts, ends)):
        a = axis(axes[i], x.dim()) if axes is not None else i
        st = steps[i] if steps is not None else 1
        if st == 0:
            return NI
        if st > 0:
            idx[a] = _forward(s, e, st)
        else:
            flips.append((a, range(*slice(s, e, st).indices(x.shape[a]))))
    y = x[tuple(idx)]
    for a, r in flips:
        y = y.index_select(a, torch.tensor(list(r), dtype=torch.int64, device=y.device))
    return y


def _slice10(x, starts, ends, axes=None, steps=None):
    if any(b is not None and (b.dim() if isinstance(b, torch.Tensor) else np.ndim(b)) != 1
           for b in (starts, ends, axes, steps)):
        return NI  # the NumPy kernel says what is wrong: bounds must be 1-D
    return _slice(x, ints(starts), ints(ends), None if axes is None else ints(axes),
                  None if steps is None else ints(steps))


@kernel("Slice", 10, prepare=True)  # faster than the generic kernel (one indexing)
def slice10(site):
    """Constant bounds and positive steps (a channel split, a sequence cut): the index is
    made once (``_forward``): a fifth of the time a call."""
    shape = site.node.inputs[0].shape if site.node.inputs[0] is not None else None
    rank = None if shape is None else len(shape)
    bounds = [site.const(i) for i in range(1, 5)]
    if rank is None or any(b is None and site.has_input(i + 1) for i, b in enumerate(bounds)) \
            or any(b is not None and np.ndim(b) != 1 for b in bounds):
        return _slice10  # which checks them (bounds must be 1-D)
    starts, ends = (np.asarray(b).reshape(-1).tolist() for b in bounds[:2])
    axes = range(len(starts)) if bounds[2] is None else np.asarray(bounds[2]).reshape(-1)
    steps = [1] * len(starts) if bounds[3] is None else np.asarray(bounds[3]).reshape(-1)
    idx = [slice(None)] * rank
    for a, st, en, step in zip(axes, starts, ends, steps):
        if step <= 0 or not -rank <= a < rank:
            return _slice10
        idx[int(a)] = _forward(st, en, step)
    index = tuple(idx)
    return lambda x, *bounds: x[index]


@kernel("Slice", 1, until=10)  # faster than the generic kernel (one indexing)
def slice1(x, *, axes=None, ends=None, starts=None):
    return _slice(x, list(starts), list(ends), None if axes is None else list(axes), None)


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
    if indices.dim() == 0 or indices.dtype not in (torch.int32, torch.int64) or \
            indices.device != x.device:
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
    return y.reshape(tuple(x.shape[:a]) + tuple(indices.shape) + tuple(x.shape[a + 1:]))


@kernel("GatherElements", 11)  # traceable: the generic kernel's range check reads a value
def gather_elements(data, indices, *, axis=0):  # on the host, which stops torch.compile
    if indices.dtype not in (torch.int32, torch.int64) or indices.device != data.device:
        return NI
    a = norm_axis(axis, data.dim())
    # torch.gather raises on an index outside [0, n): so does ONNX after the wrap
    idx = torch.where(indices < 0, indices + data.shape[a], indices)
    return torch.gather(data, a, idx if idx.dtype == torch.int64 else idx.long())


@kernel("Tile", 6)  # faster than the generic kernel (Tensor.repeat)
def tile(x, repeats):
    return x.repeat(ints(repeats))


_PAD_MODES = {"constant": "constant", "edge": "replicate", "reflect": "reflect",
              "wrap": "circular"}


def _pad(x, p, value, mode: str, axes=None):
    r = x.dim()
    ax = list(range(r)) if axes is None else [axis(a, r) for a in axes]
    n = len(ax)
    begins, ends = [0] * r, [0] * r
    for i, a in enumerate(ax):
        begins[a], ends[a] = p[i], p[i + n]
    if mode == "constant":
        if x.dtype == torch.bool:
            return NI
        fp = []
        for a in reversed(range(r)):
            fp += [begins[a], ends[a]]
        return F.pad(x, fp, value=value)
    # torch pads the last 1-3 dims of an (N, C, ...) tensor in these modes: fold the
    # leading dims into C
    padded = [a for a in range(r) if begins[a] or ends[a]]
    if not padded:
        return x
    k = r - padded[0]
    if k > 3 or min(begins + ends) < 0 or x.dtype not in FLOATS:
        return NI
    if mode == "reflect" and any(max(begins[a], ends[a]) >= x.shape[a] for a in padded):
        return NI
    if 3 <= r <= 5 and padded[0] >= 2:
        # (N, C, spatial...) as torch takes it: no reshape, so an NHWC tensor stays NHWC
        # (reshaped, it came back NCHW, and a max-pool after it ran 10x slower)
        fp = []
        for a in reversed(range(2, r)):
            fp += [begins[a], ends[a]]
        return F.pad(x, fp, mode=_PAD_MODES[mode])
    lead = tuple(x.shape[:r - k])
    y = x.reshape((1, math.prod(lead)) + tuple(x.shape[r - k:]))
    fp = []
    for a in reversed(range(r - k, r)):
        fp += [begins[a], ends[a]]
    y = F.pad(y, fp, mode=_PAD_MODES[mode])
    return y.reshape(lead + tuple(y.shape[2:]))


@kernel("Pad", 11, prepare=True)
def pad(site):
    mode = site.attr("mode", "constant")
    if mode not in _PAD_MODES:
        return None

    def run(x, pads, value=None, axes=None):
        v = 0 if value is None or not value.numel() else scalar(value)
        return _pad(x, ints(pads), v, mode, None if axes is None else ints(axes))
    return run


@kernel("Pad", 2, until=11)
def pad2(x, *, mode="constant", pads=None, value=0.0):
    if mode not in _PAD_MODES or pads is None:
        return NI
    return _pad(x, list(pads), value, mode)


def _in_range(idx, n: int):
    """``idx`` when every index lies in [0, n), else an error (indexing would wrap a
    negative one around). While torch.compile traces, the check is an assertion inside the
    program: reading its result on the host would stop the trace."""
    if torch.compiler.is_compiling():
        torch._assert_async(((idx >= 0) & (idx < n)).all(),
                            f"an index is out of range: indices must lie in [{-n}, {n - 1}]")
        return idx
    return in_range(torch, idx, n)


@kernel("GatherND", 11)
def gather_nd(data, indices, *, batch_dims=0):
    if indices.dtype not in (torch.int32, torch.int64):
        return NI
    b = batch_dims
    k = indices.shape[-1]
    if b + k > data.dim():
        return NI
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
    return y.reshape(tuple(indices.shape[:-1]) + tuple(data.shape[b + k:]))


# -- constants ----------------------------------------------------------------------------

@kernel("Constant", 1, prepare=True)
def constant(site):
    a = site.attrs
    if "value" in a:
        val = np.asarray(a["value"])
    elif "value_float" in a:
        val = np.array(a["value_float"], dtype=np.float32)
    elif "value_floats" in a:
        val = np.array(a["value_floats"], dtype=np.float32)
    elif "value_int" in a:
        val = np.array(a["value_int"], dtype=np.int64)
    elif "value_ints" in a:
        val = np.array(a["value_ints"], dtype=np.int64)
    else:
        return None  # strings, sparse: NumPy kernel
    t = to_torch(val)
    if t is None:
        return None
    t = t.to(_out_device(site))

    def run():
        return t
    return run


@kernel("ConstantOfShape", 9, prepare=True)
def constant_of_shape(site):
    v = site.attr("value")
    val = np.zeros(1, np.float32) if v is None else np.asarray(v).reshape(-1)
    t = to_torch(val)
    if t is None:
        return None
    fill = val[0].item()
    dt = t.dtype
    dev = _out_device(site)

    def run(shape):
        return torch.full(ints(shape), fill, dtype=dt, device=dev)
    return run


@kernel("Range", 11, prepare=True)
def range_(site):
    dev = _out_device(site)
    consts = [site.const(i) for i in range(3)]
    if any(c is not None and c.dtype.kind not in "iu" for c in consts):
        return None  # float ranges: the shared kernel's rounding is ONNX's
    # Constant bounds arrive as Python numbers (host parameters): their dtype is the
    # constant's, known now.
    fixed = next((to_torch(c).dtype for c in consts if c is not None), None)

    def run(start, limit, delta):
        dtype = fixed if fixed is not None else start.dtype
        if dtype not in _INTS:
            return NI
        s, lim, d = scalar(start), scalar(limit), scalar(delta)
        if d == 0:
            return NI
        n = max(math.ceil((lim - s) / d), 0)
        return torch.arange(s, s + n * d, d, dtype=dtype, device=dev)  # integers: exact
    return run


# -- reductions ---------------------------------------------------------------------------

def _reduce_kernel(fn, floats_only: bool, empty_ok: bool):
    def build(site):
        axes_attr = site.opset < (13 if site.node.op_type == "ReduceSum" else 18)
        keep = bool(int(site.attr("keepdims", 1)))
        noop = bool(int(site.attr("noop_with_empty_axes", 0)))

        def run(x, axes=None):
            if x.dtype == torch.bool or (floats_only and x.dtype not in FLOATS) \
                    or x.dtype.is_complex:
                return NI
            if not empty_ok and x.numel() == 0:
                return NI
            ax = site.attr("axes") if axes_attr else (None if axes is None else ints(axes))
            if not ax:
                if noop and not axes_attr:
                    return x
                ax = list(range(x.dim()))
            dims = tuple(sorted({axis(a, x.dim()) for a in ax}))
            if not dims:
                return x
            return fn(x, dims, keep)
        return run
    return build


def _sum(x, d, k):
    return torch.sum(x, dim=d, keepdim=k, dtype=x.dtype)


def _prod(x, d, k):
    for a in sorted(d, reverse=True):
        x = torch.prod(x, dim=a, keepdim=k, dtype=x.dtype)
    return x


_REDUCE = {
    "ReduceSum": (_sum, False, True),
    "ReduceMean": (lambda x, d, k: torch.mean(x, dim=d, keepdim=k), True, False),
    "ReduceMax": (lambda x, d, k: torch.amax(x, dim=d, keepdim=k), False, False),
    "ReduceMin": (lambda x, d, k: torch.amin(x, dim=d, keepdim=k), False, False),
    "ReduceProd": (_prod, False, True),
    "ReduceL1": (lambda x, d, k: torch.sum(x.abs(), dim=d, keepdim=k), True, True),
    "ReduceL2": (lambda x, d, k: torch.sqrt(torch.sum(x * x, dim=d, keepdim=k)), True, True),
    "ReduceSumSquare": (lambda x, d, k: torch.sum(x * x, dim=d, keepdim=k), True, True),
    "ReduceLogSum": (lambda x, d, k: torch.log(torch.sum(x, dim=d, keepdim=k)), True, False),
    "ReduceLogSumExp": (lambda x, d, k: torch.logsumexp(x, dim=d, keepdim=k), True, False),
}
# faster than the generic kernels (one torch reduction each, axes resolved once per node)
for _op, (_fn, _floats, _empty) in _REDUCE.items():
    kernel(_op, 1, prepare=True)(_reduce_kernel(_fn, _floats, _empty))


def _arg_kernel(fn):
    def run(x, *, axis=0, keepdims=1, select_last_index=0):
        if x.dtype == torch.bool or x.dtype.is_complex or x.numel() == 0:
            return NI
        a = norm_axis(axis, x.dim())
        if select_last_index:
            r = x.shape[a] - 1 - fn(torch.flip(x, (a,)), dim=a, keepdim=bool(keepdims))
            return r
        return fn(x, dim=a, keepdim=bool(keepdims))
    return run


# faster than the generic kernel (no int64 cast)
kernel("ArgMax", 11)(_arg_kernel(torch.argmax))
kernel("ArgMin", 11)(_arg_kernel(torch.argmin))


@kernel("TopK", 11)
def topk(x, k, *, axis=-1, largest=1, sorted=1):  # noqa: A002
    if x.dtype not in FLOATS + _INTS:
        return NI
    kk = ints(k)[0]
    a = norm_axis(axis, x.dim())
    # a stable sort keeps equal values in index order, as ONNX asks
    vals, idx = torch.sort(x, dim=a, descending=bool(largest), stable=True)
    return vals.narrow(a, 0, kk), idx.narrow(a, 0, kk)


@kernel("Einsum", 12)
def einsum(*xs, equation=None):
    if equation is None or len({x.dtype for x in xs}) != 1 or xs[0].dtype not in FLOATS:
        return NI
    return torch.einsum(equation, *xs)
