"""Torch kernels for the convolution variants (ConvTranspose)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    decided,
    gated,
)
from kiln.ops.torch.conv import shapes_fit, torch_pad

_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@kernel("ConvTranspose", 1, prepare=True)
def conv_transpose(site):
    if site.attr("output_shape") or site.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None  # pads derived from output_shape / SAME: NumPy kernel
    group = int(site.attr("group", 1))
    low = site.target.compute_dtype
    ks = site.attr("kernel_shape")  # one other than the weights' is the NumPy kernel's error

    def run(x, w, b=None):
        n = x.dim() - 2
        strides = list(site.attr("strides") or [1] * n)
        dil = list(site.attr("dilations") or [1] * n)
        outpad = list(site.attr("output_padding") or [0] * n)
        p = list(site.attr("pads") or [0] * (2 * n))
        if site.attr("auto_pad", "NOTSET") == "VALID":
            p = [0] * (2 * n)
        begins, ends = p[:n], p[n:]
        dt = x.dtype
        if low is not None and dt == torch.float32:
            x, w, b = x.to(low), w.to(low), None if b is None else b.to(low)
        if begins == ends and all(o < max(s, d) for o, s, d in zip(outpad, strides, dil)):
            y = _CONVT[n](x, w, b, strides, begins, outpad, group, dil)
            return y if y.dtype == dt else y.to(dt)
        # Asymmetric: full transposed conv, then crop/extend to ONNX's output size.
        y = _CONVT[n](x, w, None, strides, 0, 0, group, dil)
        full = list(y.shape[2:])
        sizes = [
            s * (i - 1) + o + (k - 1) * d + 1 - bb - e
            for s, i, o, k, d, bb, e in zip(
                strides, x.shape[2:], outpad, w.shape[2:], dil, begins, ends
            )
        ]
        extra = [max(0, bb + sz - f) for bb, sz, f in zip(begins, sizes, full)]
        if any(extra):
            y = F.pad(y, torch_pad([0] * n, extra))
        idx = (slice(None), slice(None)) + tuple(
            slice(bb, bb + sz) for bb, sz in zip(begins, sizes)
        )
        y = y[idx]
        if b is not None:
            y = y + b.reshape((1, -1) + (1,) * n)
        return y if y.dtype == dt else y.to(dt)

    facts, check = shapes_fit(site, _CONVT, ks, weight_rank=False)
    run = decided(site, facts, run, check)
    return run and gated(site, FLOATS, run, same=True)
