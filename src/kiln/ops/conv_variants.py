"""Convolution variants: ConvTranspose, DeformConv, CausalConvWithState."""

from __future__ import annotations

import itertools
import math

import numpy as np

from kiln.ops import cost
from kiln.ops.conv import (
    add_bias,
    check_kernel_shape,
    conv_pads,
    offset_slices,
    pad_spatial,
    spatial_attrs,
    work_dtype,
)
from kiln.ops.registry import op

# ---------------------------------------------------------------- ConvTranspose

def _transpose_pads(in_shape, kernel, strides, dilations, out_pad, auto_pad, pads,
                    output_shape):
    nd = len(in_shape)
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    full = [s * (n - 1) + op_ + (k - 1) * d + 1 for n, k, s, d, op_ in
            zip(in_shape, kernel, strides, dilations, out_pad)]
    if output_shape:
        target = list(output_shape)[-nd:]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = [n * s for n, s in zip(in_shape, strides)]
    else:
        if auto_pad == "VALID" or not pads:
            return [0] * nd, [0] * nd
        return list(pads[:nd]), list(pads[nd:])
    begin, end = [], []
    for f, t in zip(full, target):
        total = f - t
        if total < 0:  # a larger output than computed: zeros at the end
            begin.append(0)
            end.append(total)
            continue
        small = total // 2
        begin.append(small if auto_pad == "SAME_UPPER" else total - small)
        end.append(total - begin[-1])
    return begin, end


@op("ConvTranspose", 1, cost=cost.conv_transpose)
def conv_transpose(x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1,
                   kernel_shape=None, output_padding=None, output_shape=None, pads=None,
                   strides=None):
    """Matmul to per-kernel-offset columns, then a strided scatter-add per offset."""
    check_kernel_shape(kernel_shape, w)
    nd = x.ndim - 2
    strides, dilations = spatial_attrs(nd, strides, dilations)
    out_pad = list(output_padding or [0] * nd)
    kernel = w.shape[2:]
    begin, end = _transpose_pads(x.shape[2:], kernel, strides, dilations, out_pad,
                                 auto_pad, pads, output_shape)
    wd = work_dtype(x.dtype)
    n, c = x.shape[:2]
    mg = w.shape[1]
    in_sp = x.shape[2:]
    wt = w.astype(wd, copy=False).reshape(group, c // group, -1).transpose(0, 2, 1)
    cols = np.matmul(wt, x.astype(wd, copy=False).reshape(n, group, c // group, -1))
    cols = cols.reshape((n, group * mg) + tuple(kernel) + tuple(in_sp))
    full = [s * (i - 1) + (k - 1) * d + 1 + p for i, k, s, d, p in
            zip(in_sp, kernel, strides, dilations, out_pad)]
    y = np.zeros((n, group * mg) + tuple(full), dtype=wd)
    for offset in itertools.product(*(range(k) for k in kernel)):
        y[offset_slices(offset, strides, dilations, in_sp)] += cols[
            (slice(None), slice(None)) + offset]
    y = pad_spatial(y, [-p for p in begin], [-p for p in end])
    return np.ascontiguousarray(add_bias(y, b).astype(x.dtype, copy=False))


# ---------------------------------------------------------------- DeformConv

def _sample(x, pos):
    """Multilinear samples of ``x`` (N, C, *in) at positions ``pos`` (nd, N, Q), zero
    outside: (N, C, Q)."""
    n, c = x.shape[:2]
    in_sp = x.shape[2:]
    flat = x.reshape(n, c, -1)
    lo = np.floor(pos)
    frac = pos - lo
    lo = lo.astype(np.int64)
    res = np.zeros((n, c, pos.shape[-1]), dtype=x.dtype)
    for corner in itertools.product((0, 1), repeat=len(in_sp)):
        weight = np.ones(pos.shape[1:], dtype=x.dtype)
        index = np.zeros(pos.shape[1:], dtype=np.int64)
        valid = np.ones(pos.shape[1:], dtype=bool)
        for a, (bit, size) in enumerate(zip(corner, in_sp)):
            i = lo[a] + bit
            weight *= frac[a] if bit else 1 - frac[a]
            valid &= (i >= 0) & (i < size)
            index = index * size + np.clip(i, 0, size - 1)
        vals = np.take_along_axis(flat, index[:, None, :], axis=2)
        res += vals * (weight * valid)[:, None, :]
    return res


@op("DeformConv", 19)
def deform_conv(x, w, offset, b=None, mask=None, *, dilations=None, group=1,
                kernel_shape=None, offset_group=1, pads=None, strides=None):
    check_kernel_shape(kernel_shape, w)
    nd = x.ndim - 2
    strides, dilations = spatial_attrs(nd, strides, dilations)
    begin, end = conv_pads(x.shape[2:], w.shape[2:], strides, dilations, "NOTSET", pads)
    kernel = w.shape[2:]
    kprod = math.prod(kernel)
    n, c = x.shape[:2]
    m = w.shape[0]
    out = offset.shape[2:]
    p = math.prod(out)
    off = offset.reshape(n, offset_group, kprod, nd, p)
    msk = None if mask is None else mask.reshape(n, offset_group, kprod, p)
    # Position of every (kernel offset, output) pair without the learned offsets.
    grids = np.meshgrid(*[np.arange(o) * s - bg for o, s, bg in zip(out, strides, begin)],
                        indexing="ij")
    kgrid = np.meshgrid(*[np.arange(k) * d for k, d in zip(kernel, dilations)],
                        indexing="ij")
    base = np.stack([kg.reshape(-1, 1) + g.reshape(1, -1) for kg, g in zip(kgrid, grids)])
    cg = c // offset_group
    cols = np.empty((n, c, kprod, p), dtype=x.dtype)
    for g in range(offset_group):
        pos = base[:, None] + np.moveaxis(off[:, g], 2, 0)  # (nd, N, K, P)
        vals = _sample(x[:, g * cg:(g + 1) * cg], pos.reshape(nd, n, -1))
        vals = vals.reshape(n, cg, kprod, p)
        if msk is not None:
            vals *= msk[:, g][:, None]
        cols[:, g * cg:(g + 1) * cg] = vals
    cols = cols.reshape(n, group, (c // group) * kprod, p)
    y = np.matmul(w.reshape(group, m // group, -1), cols).reshape((n, m) + tuple(out))
    return add_bias(y, b).astype(x.dtype, copy=False)


# ---------------------------------------------------------------- CausalConvWithState

@op("CausalConvWithState", 27)
def causal_conv_with_state(x, w, b=None, past_state=None, *, activation="none"):
    """Depthwise causal 1-D conv over [past_state, x]; returns (y, last k-1 steps)."""
    wd = work_dtype(x.dtype)
    k = w.shape[-1]
    n, c, length = x.shape
    if past_state is None:
        past_state = np.zeros((n, c, k - 1), dtype=x.dtype)
    seq = np.concatenate([past_state.astype(wd), x.astype(wd)], axis=2)
    y = np.zeros((n, c, length), dtype=wd)
    wk = w.astype(wd).reshape(c, k)
    for j in range(k):
        y += seq[:, :, j:j + length] * wk[:, j:j + 1]
    add_bias(y, b)
    if activation in ("silu", "swish"):
        y *= 1 / (1 + np.exp(-y))
    present = seq[:, :, seq.shape[2] - (k - 1):]
    return y.astype(x.dtype), present.astype(x.dtype)
