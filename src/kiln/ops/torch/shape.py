"""Torch kernels for shape and data-movement ops.

Shape-valued results (Shape, Size) are made on the host: they are metadata, and ops that
take shapes (Reshape, Expand, Slice...) read them there without a device round trip.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kiln.ops._array import axis as norm_axis
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    axis,
    decided,
    fact,
    gated,
    ints,
    known_dim,
    known_rank,
    known_shape,
)

NI = NotImplemented


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


@kernel("Transpose", 1)  # faster than the generic kernel (permute)
def transpose(x, *, perm=None):
    if perm is None:
        perm = list(range(x.dim()))[::-1]
    return x.permute(perm)


def _squeeze(x, axes):
    if axes is None:
        return x.squeeze()
    dims = tuple(axis(a, x.dim()) for a in axes)
    return x.squeeze(dims) if dims else x


def _ones(shape, axes) -> bool | None:
    """Whether each dim of ``shape`` named by ``axes`` is 1 (else the NumPy kernel's
    error); None where a size is known only at run time (or an axis is out of range)."""
    r = len(shape)
    if any(not -r <= a < r for a in axes):
        return None
    sizes = [shape[a] for a in axes]
    if any(isinstance(d, int) and d != 1 for d in sizes):
        return False
    return True if all(isinstance(d, int) for d in sizes) else None


def _squeezer(site, axes, fed: bool):
    """Squeeze by ``axes`` (constant; None: every dim of 1) or, with ``fed``, by the axes
    input read each call."""
    shape = known_shape(site)
    fits = True if axes is None and not fed else \
        None if fed or shape is None else _ones(shape, axes)
    if fed:
        return decided(site, [fits], lambda x, a=None: _squeeze(x, None if a is None else ints(a)),
                       lambda x, a=None: a is None or bool(_ones(tuple(x.shape), ints(a))))
    return decided(site, [fits], lambda x, *rest: _squeeze(x, axes),
                   lambda x, *rest: bool(_ones(tuple(x.shape), axes)))


@kernel("Squeeze", 13, prepare=True)  # Tensor op, not array_api_compat's wrapper
def squeeze13(site):
    a = site.const(1)
    fed = site.has_input(1) and a is None
    return _squeezer(site, None if a is None else [int(v) for v in a.reshape(-1)], fed)


@kernel("Squeeze", 1, until=13, prepare=True)  # Tensor op, not array_api_compat's wrapper
def squeeze1(site):
    a = site.attr("axes")
    return _squeezer(site, None if a is None else [int(v) for v in a], False)


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


@kernel("Concat", 4, prepare=True)  # faster than the generic kernel (torch.cat, no None filtering)
def concat(site):
    ax = site.attr("axis")
    if ax is None:
        return None  # the NumPy kernel says what is wrong
    ax = int(ax)

    # inputs of one rank (else the NumPy kernel's error)
    ranks = [known_rank(site, i) for i in range(len(site.node.inputs)) if site.has_input(i)]
    known = {r for r in ranks if r is not None}
    same_rank = False if len(known) > 1 else None if None in ranks else True
    run = decided(site, [same_rank], lambda *xs: torch.cat(xs, ax),
                  lambda *xs: len({x.dim() for x in xs}) == 1)
    return run and gated(site, None, run, same=True)


@kernel("Split", 2, prepare=True)  # faster than the generic kernel (one split)
def split(site):
    ax = int(site.attr("axis", 0))
    n = site.num_outputs
    given = site.attr("split") if site.opset < 13 else site.const(1)
    # Constant sizes are read once; Tensor.split_with_sizes skips torch.split's Python
    # wrapper (half the time for three parts), BERT's merged q/k/v for example.
    fixed = None if given is None else [int(v) for v in np.asarray(given).reshape(-1)]

    def fits(d: int, sizes) -> bool:
        """Whether a dim of ``d`` splits into the outputs (else the NumPy kernel's error)."""
        if sizes:
            return sum(sizes) == d and len(sizes) == n
        if site.opset < 18 and d % n:
            return False  # an uneven split
        chunk = -(-d // n)
        return (-(-d // chunk) if chunk else 0) == n  # fewer parts than outputs at d

    def run(x, split=None):
        a = axis(ax, x.dim())
        sizes = fixed if fixed is not None or split is None else ints(split)
        if sizes:
            return tuple(x.split_with_sizes(sizes, a))
        chunk = -(-x.shape[a] // n)
        return tuple(torch.split(x, chunk, a)) if chunk else ()

    def check(x, split=None):
        sizes = fixed if fixed is not None or split is None else ints(split)
        return fits(x.shape[axis(ax, x.dim())], sizes)

    d = known_dim(site, 0, ax)
    sized = fixed is not None or not site.has_input(1) or site.opset < 13
    return decided(site, [None if d is None or not sized else fits(d, fixed)], run, check)


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
            return NI  # a zero step, read at run time: the NumPy kernel's error
        if st > 0:
            idx[a] = _forward(s, e, st)
        else:
            flips.append((a, range(*slice(s, e, st).indices(x.shape[a]))))
    y = x[tuple(idx)]
    for a, r in flips:
        y = y.index_select(a, torch.tensor(list(r), dtype=torch.int64, device=y.device))
    return y


def _slice10(x, starts, ends, axes=None, steps=None):
    return _slice(x, ints(starts), ints(ends), None if axes is None else ints(axes),
                  None if steps is None else ints(steps))


def _one_d(*bounds) -> bool:
    return all(b is None or (b.dim() if isinstance(b, torch.Tensor) else np.ndim(b)) == 1
               for b in bounds)


def _general_slice(site, steps):
    """The slice of bounds read each call: 1-D bounds and no zero step ``steps`` (constant
    ones, else None), else the NumPy kernel says what is wrong. A bound's rank the plan
    does not know is checked each call, as is a fed step."""
    facts = [fact(known_rank(site, i), lambda r: r == 1) for i in range(1, 5)
             if site.has_input(i)]
    if steps is not None and 0 in steps:
        facts.append(False)
    return decided(site, facts, _slice10, lambda x, *bounds: _one_d(*bounds))


@kernel("Slice", 10, prepare=True)  # faster than the generic kernel (one indexing)
def slice10(site):
    """Constant bounds and positive steps (a channel split, a sequence cut): the index is
    made once (``_forward``): a fifth of the time a call."""
    shape = site.node.inputs[0].shape if site.node.inputs[0] is not None else None
    rank = None if shape is None else len(shape)
    bounds = [site.const(i) for i in range(1, 5)]
    steps = None if bounds[3] is None else np.asarray(bounds[3]).reshape(-1).tolist()
    if rank is None or any(b is None and site.has_input(i + 1) for i, b in enumerate(bounds)) \
            or any(b is not None and np.ndim(b) != 1 for b in bounds):
        return _general_slice(site, steps)
    starts, ends = (np.asarray(b).reshape(-1).tolist() for b in bounds[:2])
    axes = range(len(starts)) if bounds[2] is None else np.asarray(bounds[2]).reshape(-1)
    steps = [1] * len(starts) if steps is None else steps
    idx = [slice(None)] * rank
    for a, st, en, step in zip(axes, starts, ends, steps):
        if step <= 0 or not -rank <= a < rank:
            return _general_slice(site, steps)
        idx[int(a)] = _forward(st, en, step)
    index = tuple(idx)
    return lambda x, *bounds: x[index]


@kernel("Slice", 1, until=10)  # faster than the generic kernel (one indexing)
def slice1(x, *, axes=None, ends=None, starts=None):
    return _slice(x, list(starts), list(ends), None if axes is None else list(axes), None)


@kernel("Tile", 6)  # faster than the generic kernel (Tensor.repeat)
def tile(x, repeats):
    return x.repeat(ints(repeats))




@kernel("Flatten", 1)  # Tensor op, not array_api_compat's wrapper
def flatten(x, *, axis=1):
    a = norm_axis(axis, x.dim(), high=1)
    return x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))
