"""Torch kernels for Resize."""

from __future__ import annotations

import math

import torch.nn.functional as F

from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    floats,
    gated,
    ints,
)

NI = NotImplemented


# -- resize -------------------------------------------------------------------------------

_INTERP = {1: "linear", 2: "bilinear", 3: "trilinear"}


@kernel("Resize", 11, prepare=True)
def resize(site):
    """The coordinate conventions torch's interpolate implements exactly; others: NumPy."""
    mode = site.attr("mode", "nearest")
    ctm = site.attr("coordinate_transformation_mode", "half_pixel")
    nearest_mode = site.attr("nearest_mode", "round_prefer_floor")
    if int(site.attr("antialias", 0)) or site.attr("axes") is not None:
        return None
    if site.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        return None
    if mode == "nearest":
        if (ctm, nearest_mode) == ("asymmetric", "floor"):
            tmode, align = "nearest", None
        elif (ctm, nearest_mode) == ("half_pixel", "round_prefer_ceil"):
            tmode, align = "nearest-exact", None
        else:
            return None
    elif mode == "linear" and ctm in ("half_pixel", "pytorch_half_pixel", "align_corners"):
        tmode, align = "linear", ctm == "align_corners"
    elif (
        mode == "cubic"
        and ctm in ("half_pixel", "align_corners")
        and float(site.attr("cubic_coeff_a", -0.75)) == -0.75
        and not int(site.attr("exclude_outside", 0))
    ):
        tmode, align = "bicubic", ctm == "align_corners"
    else:
        return None

    def spatial(r: int) -> bool:
        """Whether torch's interpolate in this mode takes an input of rank ``r``."""
        n = r - 2
        return n >= 1 and (tmode != "linear" or n in _INTERP) and (tmode != "bicubic" or n == 2)

    sc_c = site.const(2) if site.has_input(2) else None
    if not site.has_input(3) and sc_c is not None and \
            (not sc_c.size or [float(v) for v in sc_c.reshape(-1)[:2]] != [1.0, 1.0]):
        return None  # no scales, or scales of the batch or channels: the NumPy kernel

    # the checks left below read sizes and scales fed at run time, or compare them with
    # the run-time shape (torch's interpolate is exact only for some)
    def run(x, roi=None, scales=None, sizes=None):
        n = x.dim() - 2
        m = _INTERP[n] if tmode == "linear" else tmode
        sz = [] if sizes is None else ints(sizes)
        if sz:
            if sz[:2] != list(x.shape[:2]):
                return NI
            if ctm == "pytorch_half_pixel" and min(sz[2:]) <= 1:
                return NI
            return F.interpolate(x, size=sz[2:], mode=m, align_corners=align)
        sc = [] if scales is None else floats(scales)
        if not sc:
            return NI
        if sc[:2] != [1.0, 1.0]:
            return NI
        out = [int(math.floor(d * s)) for d, s in zip(x.shape[2:], sc[2:])]
        if ctm == "pytorch_half_pixel" and min(out) <= 1:
            return NI
        if align:
            # ONNX maps by in*scale (unrounded), torch by the rounded output size
            if any(d * s != o for d, s, o in zip(x.shape[2:], sc[2:], out)):
                return NI
            return F.interpolate(x, size=out, mode=m, align_corners=True)
        y = F.interpolate(
            x, scale_factor=sc[2:], mode=m, align_corners=align, recompute_scale_factor=False
        )
        return y if list(y.shape[2:]) == out else NI

    # (a rank torch lacks in this mode: the NumPy kernel)
    return gated(site, FLOATS, run, rank=spatial)
