"""Shape and layout ops: Reshape, Flatten, Transpose, Squeeze/Unsqueeze, Concat, Split,
Slice, Expand, Tile, Shape, Size and Identity. Written against the array API
(``generic=True``) except Shape and Size, whose results are host-side metadata."""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import KernelError
from kiln.ops._array import axis as norm_axis
from kiln.ops._array import namespace
from kiln.ops._numeric import int_list
from kiln.ops.registry import op

# -- reshaping --------------------------------------------------------------------------


def _target_shape(in_shape, shape: list[int], allowzero: int) -> tuple[int, ...]:
    """Resolve Reshape's 0 (copy the input dim unless ``allowzero``) and -1 (inferred)."""
    out = [in_shape[i] if d == 0 and not allowzero else d for i, d in enumerate(shape)]
    if -1 in out:
        i = out.index(-1)
        known = math.prod(d for j, d in enumerate(out) if j != i)
        total = math.prod(in_shape)
        out[i] = total // known if known else 0
    return tuple(out)


@op("Reshape", 1, generic=True)
def reshape1(x, *, shape=None):
    return namespace(x).reshape(x, _target_shape(tuple(x.shape), list(shape or []), 0))


@op("Reshape", 5, generic=True, host_inputs=(1,))
def reshape(x, shape, *, allowzero=0):
    target = _target_shape(tuple(x.shape), int_list(shape), allowzero)
    return namespace(x).reshape(x, target)


@op("Flatten", 1, generic=True)
def flatten(x, *, axis=1):
    ax = norm_axis(axis, x.ndim, high=1)
    shape = tuple(x.shape)
    return namespace(x).reshape(x, (math.prod(shape[:ax]), math.prod(shape[ax:])))


@op("Transpose", 1, generic=True)
def transpose(x, *, perm=None):
    if perm is None:
        perm = list(range(x.ndim))[::-1]
    return namespace(x).permute_dims(x, tuple(perm))


def _squeeze(x, axes):
    if axes is None:
        dims = tuple(i for i, d in enumerate(x.shape) if d == 1)
    else:
        dims = tuple(sorted({norm_axis(a, x.ndim) for a in axes}))
    if not dims:
        return x
    return namespace(x).squeeze(x, axis=dims)


@op("Squeeze", 1, generic=True)
def squeeze1(x, *, axes=None):
    return _squeeze(x, axes)


@op("Squeeze", 13, generic=True, host_inputs=(1,))
def squeeze(x, axes=None):
    return _squeeze(x, None if axes is None else int_list(axes))


def _unsqueeze(x, axes):
    rank = x.ndim + len(axes)
    new = {norm_axis(a, rank) for a in axes}
    dims = iter(x.shape)
    shape = tuple(1 if i in new else next(dims) for i in range(rank))
    return namespace(x).reshape(x, shape)


@op("Unsqueeze", 1, generic=True)
def unsqueeze1(x, *, axes=None):
    return _unsqueeze(x, list(axes or []))


@op("Unsqueeze", 13, generic=True, host_inputs=(1,))
def unsqueeze(x, axes):
    return _unsqueeze(x, int_list(axes))


# -- joining and splitting --------------------------------------------------------------


@op("Concat", 1, generic=True)
def concat1(*inputs, axis=1):
    return concat(*inputs, axis=axis)


@op("Concat", 4, generic=True)
def concat(*inputs, axis=None):
    xs = [x for x in inputs if x is not None]
    if len(xs) == 1:
        return xs[0]
    return namespace(*xs).concat(xs, axis=norm_axis(axis, xs[0].ndim))


def _split(x, axis: int, sizes: list[int], outputs: int | None = None):
    ax = norm_axis(axis, x.ndim)
    if outputs is not None and len(sizes) != outputs or sum(sizes) != x.shape[ax] or \
            any(s < 0 for s in sizes):
        # onnxruntime refuses these; slicing would silently drop or invent parts
        raise KernelError(f"Split sizes {sizes} do not cut axis {axis} of size "
                          f"{x.shape[ax]} into {outputs or len(sizes)} outputs")
    head = (slice(None),) * ax
    out, start = [], 0
    for s in sizes:
        out.append(x[(*head, slice(start, start + s))])
        start += s
    return tuple(out)


def _even_sizes(dim: int, parts: int, ceil: bool) -> list[int]:
    """Split ``dim`` in ``parts`` equal chunks; opset 18's ``num_outputs`` lets the last be
    smaller (chunk = ceil(dim / parts))."""
    if not ceil:
        return [dim // parts] * parts
    chunk = -(-dim // parts)
    return [max(0, min(chunk, dim - i * chunk)) for i in range(parts)]


@op("Split", 1, generic=True, host_inputs=(1,))
def split1(ctx, x, split_input=None, *, axis=0, split=None):
    sizes = int_list(split_input) if split_input is not None else split
    return _split(x, axis, sizes or _even_sizes(x.shape[norm_axis(axis, x.ndim)],
                                                ctx.num_outputs, False), ctx.num_outputs)


@op("Split", 2, generic=True)
def split2(ctx, x, *, axis=0, split=None):
    if split:
        return _split(x, axis, list(split), ctx.num_outputs)
    return _split(x, axis, _even_sizes(x.shape[norm_axis(axis, x.ndim)], ctx.num_outputs,
                                       False))


@op("Split", 13, generic=True, host_inputs=(1,))
@op("Split", 18, generic=True, host_inputs=(1,))
def split(ctx, x, split=None, *, axis=0, num_outputs=None):
    if split is not None and tuple(split.shape) != (0,):
        return _split(x, axis, int_list(split), ctx.num_outputs)
    parts = num_outputs if num_outputs is not None else ctx.num_outputs
    dim = x.shape[norm_axis(axis, x.ndim)]
    return _split(x, axis, _even_sizes(dim, parts, num_outputs is not None))


# -- slicing ----------------------------------------------------------------------------


def _slice_axis(start: int, end: int, step: int, dim: int) -> tuple[slice, bool]:
    """One axis of Slice as a positive-step Python slice plus whether to flip it (torch
    has no negative steps), with ONNX's clamping of out-of-range bounds."""
    if step == 0:
        raise ValueError("Slice: steps must not be 0")
    start += dim if start < 0 else 0
    end += dim if end < 0 else 0
    if step > 0:
        start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        return slice(start, max(start, end), step), False
    start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
    n = max(0, -(-(start - end) // -step))
    if n == 0:
        return slice(0, 0), False
    return slice(start + step * (n - 1), start + 1, -step), True


def _slice(x, starts, ends, axes, steps):
    rank = x.ndim
    axes = list(range(len(starts))) if axes is None else [norm_axis(a, rank) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * rank
    flips = []
    for s, e, a, k in zip(starts, ends, axes, steps):
        index[a], flip = _slice_axis(s, e, k, x.shape[a])
        if flip:
            flips.append(a)
    y = x[tuple(index)]
    if flips:
        y = namespace(x).flip(y, axis=tuple(flips))
    return y


@op("Slice", 1, generic=True)
def slice1(x, *, starts=None, ends=None, axes=None):
    return _slice(x, starts, ends, axes, None)


@op("Slice", 10, generic=True, host_inputs=(1, 2, 3, 4))
def slice_(x, starts, ends, axes=None, steps=None):
    for name, t in (("starts", starts), ("ends", ends), ("axes", axes), ("steps", steps)):
        if t is not None and len(getattr(t, "shape", (0,))) != 1:
            raise KernelError(f"Slice's {name} must be a 1-D tensor, not of shape "
                              f"{tuple(t.shape)} (onnxruntime refuses it too)")
    return _slice(x, int_list(starts), int_list(ends),
                  None if axes is None else int_list(axes),
                  None if steps is None else int_list(steps))


# -- broadcasting and repetition --------------------------------------------------------


@op("Expand", 8, generic=True, host_inputs=(1,))
def expand(x, shape):
    target = np.broadcast_shapes(tuple(x.shape), tuple(int_list(shape)))
    return namespace(x).broadcast_to(x, target)


@op("Tile", 1, generic=True, host_inputs=(1,))
def tile1(x, tiles, axis):
    reps = [1] * x.ndim
    reps[norm_axis(int_list(axis)[0], x.ndim)] = int_list(tiles)[0]
    return namespace(x).tile(x, tuple(reps))


@op("Tile", 6, generic=True, host_inputs=(1,))
def tile(x, repeats):
    return namespace(x).tile(x, tuple(int_list(repeats)))


# -- metadata and pass-through ----------------------------------------------------------


@op("Shape", 1, differentiable=False)
@op("Shape", 15, differentiable=False)
def shape(x, *, start=0, end=None):
    return np.array(tuple(x.shape)[slice(start, end)], dtype=np.int64)


@op("Size", 1, differentiable=False)
def size(x):
    return np.array(math.prod(x.shape), dtype=np.int64)


@op("Identity", 1, generic=True)
def identity(x):
    """Tensors, sequences and optionals alike pass through: values are never mutated."""
    return x
