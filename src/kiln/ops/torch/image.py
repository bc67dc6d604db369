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
    gated,
    ints,
    scalar,
)

NI = NotImplemented


_NOT_BOOL = tuple(t for t in TORCH_OF.values() if t is not torch.bool)
_PAD_MODES = {"constant": "constant", "edge": "replicate", "reflect": "reflect", "wrap": "circular"}


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


@kernel("Pad", 11, prepare=True)
def pad(site):
    mode = site.attr("mode", "constant")
    if mode not in _PAD_MODES:
        return None

    def run(x, pads, value=None, axes=None):
        v = 0 if value is None or not value.numel() else scalar(value)
        return _pad(x, ints(pads), v, mode, None if axes is None else ints(axes))

    # (a type _pad lacks in this mode, where the plan knows it: the next kernel)
    return gated(site, _NOT_BOOL if mode == "constant" else FLOATS, run)


@kernel("Pad", 2, until=11, when=lambda site: site.attr("mode", "constant") in _PAD_MODES
        and site.attr("pads") is not None)
def pad2(x, *, mode="constant", pads=None, value=0.0):
    return _pad(x, list(pads), value, mode)
