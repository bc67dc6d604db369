"""Torch kernels for pooling."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops.conv import conv_pads, out_size
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    as_uint8,
    decided,
    dtype_in,
    from_uint8,
    gated,
    integers,
    known_rank,
    known_shape,
    quantized,
)
from kiln.ops.torch.conv import torch_pad, window

NI = NotImplemented
_EIGHT = (torch.uint8, torch.int8)
_AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}


# -- pooling ------------------------------------------------------------------------------


def _known_pads(site, ks: list[int]) -> tuple[list[int], list[int]] | None:
    """A pool's (begins, ends) where the plan knows them before the run: explicit pads
    or VALID, or SAME_* on spatial sizes it knows; else None."""
    n = len(ks)
    auto = site.attr("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    spatial: list = [0] * n  # (explicit pads do not depend on it)
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        shape = known_shape(site)
        spatial = [] if shape is None else list(shape[2:])
        if len(spatial) != n or not all(isinstance(d, int) for d in spatial):
            return None
    return conv_pads(spatial, ks, list(site.attr("strides") or [1] * n),
                     list(site.attr("dilations") or [1] * n), auto, site.attr("pads"))


@kernel("MaxPool", 1, prepare=True)
def max_pool(site):
    want_idx = site.output_used(1)
    if want_idx and int(site.attr("storage_order", 0)):
        return None
    ceil = bool(site.attr("ceil_mode", 0))
    ks = list(site.attr("kernel_shape"))
    cl = site.target.channels_last
    # A kiln.to_torch module follows the PyTorch module it stands for (torch's NaN rule, no
    # host sync per call); the NumPy kernel would cut the gradient there anyway
    nan_check = not site.target.module
    pads = _known_pads(site, ks)
    if want_idx and pads is not None and not _symmetric(ks, site.attr("dilations"), *pads):
        return None  # indices of a padded copy: the NumPy kernel

    def run(x):
        n = x.dim() - 2
        if x.dtype in _EIGHT:  # (declined where indices are asked for)
            return _max_pool_8bit(site, x, ks, ceil)
        if cl and n == 2 and not want_idx:
            # torch's NCHW max-pool is much slower than its NHWC one on the CPU: the
            # copy costs far less (indices, when asked for, are NCHW positions)
            x = x.contiguous(memory_format=torch.channels_last)
        strides, dil, begins, ends = window(site, x, ks)
        want = [out_size(*g, ceil) for g in zip(x.shape[2:], ks, strides, dil, begins, ends)]
        if (
            not want_idx
            and sum(k - 1 for k in ks) <= 4
            and _VIEW_POOL_MIN <= x.numel() <= _VIEW_POOL_MAX
            and not x.requires_grad
        ):
            # (training keeps torch's pool: its gradient goes to one element of a tie, as
            # PyTorch's own modules do)
            y = _max_pool_separable(x, ks, strides, dil, begins, want)
            if y is not None:
                return NI if nan_check and _nan_in(y) else y  # a NaN: see below
        if not _symmetric(ks, dil, begins, ends):
            if want_idx:
                return NI  # indices of a padded copy: SAME_* pads of a run-time shape
            x = F.pad(x, torch_pad(begins, ends), value=-math.inf)
            begins = [0] * n
        r = _MAXPOOL[n](x, ks, strides, begins, dil, ceil_mode=ceil, return_indices=want_idx)
        y = r[0] if want_idx else r
        if list(y.shape[2:]) != want or nan_check and _nan_in(y):
            # torch's ceil-mode rule differs here; torch spreads a NaN over each window it
            # is in, where onnx.reference skips it: NumPy kernel (a NaN-free result is
            # the same either way, so only the output is checked)
            return NI
        if not want_idx:
            return y
        # torch's indices are per (n, c) plane; ONNX's run over the whole tensor.
        plane = math.prod(x.shape[2:])
        nc = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(
            (x.shape[0], x.shape[1]) + (1,) * n
        )
        return y, r[1] + nc * plane

    # 8-bit activations: 2-D pools on the CPU, without indices (torch's quantized pool)
    eight = not want_idx and site.target.device.type == "cpu"
    r, is_eight = known_rank(site), dtype_in(site, 0, _EIGHT)
    even = pads is not None and pads[0] == pads[1]
    if eight and is_eight and pads is not None and not even:
        eight = False  # uneven padding: the shared kernel (as for another rank)
    if not eight or is_eight is False or r == 4 and even:
        eight_fits = True
    else:  # another rank is declined where the input is known to be 8-bit
        eight_fits = False if is_eight and r is not None and r != 4 else None
    run = decided(site, [eight_fits], run, lambda x: x.dtype not in _EIGHT or x.dim() == 4)
    # (a rank torch's pools lack: the NumPy kernel's error)
    return run and gated(site, FLOATS + _EIGHT if eight else FLOATS, run,
                         rank=lambda r: r - 2 in _MAXPOOL)


def _symmetric(ks, dil, begins, ends) -> bool:
    """Whether torch's max-pool takes these pads as they are (even, at most half a
    window)."""
    dil = dil or [1] * len(ks)
    return begins == ends and all(b <= ((k - 1) * d + 1) // 2
                                  for b, k, d in zip(begins, ks, dil))


def _nan_in(y) -> bool:
    """Whether a max-pool result holds a NaN (torch spreads one over its windows, where
    the reference skips it: the NumPy kernel then answers). Not asked inside
    torch.compile, where a data-dependent branch would break the graph: a compiled
    program keeps torch's NaN rule (docs/reliability.md)."""
    # A NaN anywhere makes the sum NaN: one reduction instead of isnan's mask and its
    # any(). A sum of +inf and -inf is NaN too: that rare result goes to the NumPy
    # kernel, which is right either way.
    return (
        y.dtype.is_floating_point
        and not torch.compiler.is_compiling()
        and bool(torch.isnan(y.sum()))
    )


def _max_pool_8bit(site, x, ks, ceil: bool):
    """A 2-D max-pool of a quantized model's 8-bit activations (fuse_quant moves pools
    there) as torch's quantized NHWC pool, faster than its uint8 NCHW pool and than the
    float32 one it replaces."""
    strides, dil, begins, ends = window(site, x, ks)
    if begins != ends:
        return NI  # uneven SAME_* padding of a run-time shape (a known one is declined)
    q = quantized(as_uint8(x).contiguous(memory_format=torch.channels_last), 1.0, 0)
    y = integers(F.max_pool2d(q, ks, strides, begins, dil, ceil_mode=ceil))
    want = [out_size(*g, ceil) for g in zip(x.shape[2:], ks, strides, dil, begins, ends)]
    if list(y.shape[2:]) != want:
        return NI  # torch's ceil-mode size differs at this run-time shape
    return from_uint8(y, x.dtype == torch.int8)


_VIEW_POOL_MIN = 2**19
"""Inputs from this many elements pool as maxima over views. Below it torch's pool wins:
a few small ops cost more than its index writes (NHWC, batch 1; from 64x104x104 the views
take less time than torch's pool)."""
_VIEW_POOL_MAX = 2**21
"""Inputs over this many elements pool with torch's pool again: past the caches each of
the views' passes reads the input from memory (ResNet-18's first pool at batch 4 and 8;
docs/performance.md)."""


def _max_pool_separable(x, ks, strides, dil, begins, sizes):
    """Max-pool as running maxima over strided views of ``x``, one spatial axis at a time
    (a window's maximum is the maximum over its rows of the maxima along them), or None
    where some output would see only padding along an axis.

    torch's CPU max-pool computes int64 indices even when they are not asked for: twice
    the output's bytes written (fresh pages for every call once they pass 32 MB). A k x k
    window is 2(k - 1) elementwise maxima this way, each over contiguous NHWC rows, faster
    than torch's pool and than nine views of the whole window (docs/performance.md).
    Padding, dilation and ceil mode clip each tap's range, so no padded copy is made.
    """
    out = x
    for dim, (k, s, d, b, o) in enumerate(zip(ks, strides, dil, begins, sizes), start=2):
        n = out.shape[dim]
        whole, part = [], []  # taps reaching every output / a range [lo, hi) of them
        for j in range(k):
            start = j * d - b
            lo, hi = max(0, -(start // s)), min(o, (n - 1 - start) // s + 1)
            if lo < hi:
                first = start + lo * s
                step = (slice(None),) * dim + (slice(first, first + (hi - lo - 1) * s + 1, s),)
                (whole if hi - lo == o else part).append((lo, hi, out[step]))
        if not whole:
            return None
        acc = torch.maximum(whole[0][2], whole[1][2]) if len(whole) > 1 else whole[0][2].clone()
        for lo, hi, view in whole[2:] + part:
            seg = acc.narrow(dim, lo, hi - lo)
            torch.maximum(seg, view, out=seg)
        out = acc
    return out


@kernel("AveragePool", 7, prepare=True)
def average_pool(site):
    ceil = bool(site.attr("ceil_mode", 0))
    include = bool(site.attr("count_include_pad", 0))
    ks = list(site.attr("kernel_shape"))
    if ceil and include:
        return None  # torch divides hanging-off windows differently
    if any(d != 1 for d in site.attr("dilations") or ()):
        return None  # torch's average pool has no dilation
    pads = _known_pads(site, ks)
    if pads is not None and _padded_first(ks, *pads) and _no_pad_first(ceil, ks, *pads):
        return None  # padding torch cannot take, and too much to pad first

    def run(x):
        n = x.dim() - 2
        strides, dil, begins, ends = window(site, x, ks)
        if _padded_first(ks, begins, ends):
            # padding torch's pooling cannot take (uneven, or over half the window), as
            # Inception v1's last pool has: pad first, and without count_include_pad
            # divide by how much of each window lies inside the input
            if _no_pad_first(ceil, ks, begins, ends):
                return NI  # SAME_* pads of a run-time shape (known ones are declined)
            pad = torch_pad(begins, ends)
            y = _AVGPOOL[n](F.pad(x, pad), ks, strides)
            if not include:
                inside = F.pad(x.new_ones((1, 1, *x.shape[2:])), pad)
                y = y / _AVGPOOL[n](inside, ks, strides)
            return y
        want = [out_size(*g, ceil) for g in zip(x.shape[2:], ks, strides, dil, begins, ends)]
        y = _AVGPOOL[n](x, ks, strides, begins, ceil_mode=ceil, count_include_pad=include)
        return y if list(y.shape[2:]) == want else NI  # torch's ceil-mode size differs here

    # (a rank torch's pools lack: the NumPy kernel's error)
    return gated(site, FLOATS, run, rank=lambda r: r - 2 in _AVGPOOL)


def _padded_first(ks, begins, ends) -> bool:
    """Whether torch's average pool cannot take these pads (uneven, or over half the
    window): the input is padded first."""
    return begins != ends or any(b > k // 2 for b, k in zip(begins, ks))


def _no_pad_first(ceil: bool, ks, begins, ends) -> bool:
    """Whether padding first does not give ONNX's average either (ceil mode, or a pad as
    wide as the window)."""
    return ceil or any(p >= k for p, k in zip(begins + ends, ks * 2))


@kernel("GlobalAveragePool", 1, dtypes=FLOATS)
def global_average_pool(x):
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@kernel("GlobalMaxPool", 1, dtypes=FLOATS)
def global_max_pool(x):
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)
