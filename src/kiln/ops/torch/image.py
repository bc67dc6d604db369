"""Torch kernels for Pad."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    TORCH_OF,
    axis,
    decided,
    dtype_in,
    ints,
    known_shape,
    scalar,
)

_NOT_BOOL = tuple(t for t in TORCH_OF.values() if t is not torch.bool)
_PAD_MODES = {"constant": "constant", "edge": "replicate", "reflect": "reflect", "wrap": "circular"}


def _widths(rank: int, p: list[int], axes) -> tuple[list[int], list[int]]:
    ax = list(range(rank)) if axes is None else [axis(a, rank) for a in axes]
    n = len(ax)
    begins, ends = [0] * rank, [0] * rank
    for i, a in enumerate(ax):
        begins[a], ends[a] = p[i], p[i + n]
    return begins, ends


def _fits(shape, p: list[int], mode: str, axes) -> bool | None:
    """Whether torch pads an input of ``shape`` (ints, or names for sizes known only at
    run time) by ``p`` in ``mode`` (other than constant) as ONNX does: at most its last
    three dims, no crop, and reflect by less than a dim; None where a size decides and is
    unknown."""
    r = len(shape)
    if axes is not None and any(not -r <= a < r for a in axes):
        return None  # the shared kernel's error
    begins, ends = _widths(r, p, axes)
    padded = [a for a in range(r) if begins[a] or ends[a]]
    if padded and (r - padded[0] > 3 or min(begins + ends) < 0):
        return False
    if mode == "reflect":
        sizes = [shape[a] for a in padded]
        if not all(isinstance(d, int) for d in sizes):
            return None
        return all(max(begins[a], ends[a]) < d for a, d in zip(padded, sizes))
    return True


def _pad(x, p, value, mode: str, axes=None):
    """Pad ``x``: a constant pad of any type but bool, the other modes on floats where
    :func:`_fits` holds (the kernels below settle both before calling)."""
    r = x.dim()
    begins, ends = _widths(r, p, axes)
    if mode == "constant":
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
    if 3 <= r <= 5 and padded[0] >= 2:
        # (N, C, spatial...) as torch takes it: no reshape, so an NHWC tensor stays NHWC
        # (reshaped, it came back NCHW, and a max-pool after it ran much slower)
        fp = []
        for a in reversed(range(2, r)):
            fp += [begins[a], ends[a]]
        return F.pad(x, fp, mode=_PAD_MODES[mode])
    lead = tuple(x.shape[: r - k])
    y = x.reshape((1, math.prod(lead)) + tuple(x.shape[r - k :]))
    fp = []
    for a in reversed(range(r - k, r)):
        fp += [begins[a], ends[a]]
    y = F.pad(y, fp, mode=_PAD_MODES[mode])
    return y.reshape(lead + tuple(y.shape[2:]))


def _settled(site, mode: str, pads, axes, run, check):
    """``run`` for a Pad in ``mode`` whose pads (and axes) are ``pads``/``axes`` where
    constant (None where fed): the input's type, and for the other modes whether
    :func:`_fits`, are settled when the session is made where the plan knows them (the
    shared kernel takes the rest), else checked each call by ``check(x, *rest)`` (True
    where torch's pad applies)."""
    types = _NOT_BOOL if mode == "constant" else FLOATS
    shape = known_shape(site, 0)
    fits = True if mode == "constant" else None
    if fits is None and pads is not None and shape is not None:
        fits = _fits(shape, pads, mode, axes)
    return decided(site, [dtype_in(site, 0, types), fits], run,
                   lambda x, *rest: x.dtype in types and check(x, *rest))


@kernel("Pad", 11, prepare=True)
def pad(site):
    mode = site.attr("mode", "constant")
    if mode not in _PAD_MODES:
        return None

    def run(x, pads, value=None, axes=None):
        v = 0 if value is None or not value.numel() else scalar(value)
        return _pad(x, ints(pads), v, mode, None if axes is None else ints(axes))

    def check(x, pads, value=None, axes=None):
        return mode == "constant" or bool(
            _fits(tuple(x.shape), ints(pads), mode, None if axes is None else ints(axes)))

    p, ax = site.const(1), site.const(3)
    pads = None if p is None or (site.has_input(3) and ax is None) else \
        [int(v) for v in p.reshape(-1)]
    axes = None if ax is None else [int(a) for a in ax.reshape(-1)]
    return _settled(site, mode, pads, axes, run, check)


@kernel("Pad", 2, until=11, prepare=True)
def pad2(site):
    mode, pads = site.attr("mode", "constant"), site.attr("pads")
    if mode not in _PAD_MODES or pads is None:
        return None
    value = float(site.attr("value", 0.0))
    pads = [int(v) for v in pads]
    return _settled(site, mode, pads, None, lambda x: _pad(x, pads, value, mode),
                    lambda x: mode == "constant" or bool(_fits(tuple(x.shape), pads, mode,
                                                               None)))
