"""Resize (opsets 10 to 19) and the older Upsample.

Interpolation is separable: each resized axis gets an (out, taps) table of source indices
and weights, and the input is gathered and weighted one tap at a time along that axis.
No loop ever runs over output elements.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.ops._array import axis as norm_axis
from kiln.ops.registry import op


def cubic_weights(t, a: float):
    """Keys' cubic convolution kernel at distances ``t``."""
    t = np.abs(t)
    t2, t3 = t * t, t * t * t
    near = (a + 2) * t3 - (a + 3) * t2 + 1
    far = a * t3 - 5 * a * t2 + 8 * a * t - 4 * a
    return np.where(t <= 1, near, np.where(t < 2, far, 0.0))


def _source_coords(out: int, size: int, scale: float, mode: str, start: float, end: float):
    """x_original for every output position along one axis. The resized length in the
    formulas is ``scale * size``, fractional when a scale does not divide evenly. Computed
    in float32 like the scales themselves, so exact halves and integers land where other
    runtimes put them (0.8 as float32 is 0.8000000119: 4 / 0.8 must still be 5)."""
    x = np.arange(out, dtype=np.float32)
    scale = np.float32(scale)
    length = scale * np.float32(size)
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        return size / 2 * (1 - out / length) + (x + 0.5) / scale - 0.5
    if mode == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if length > 1 else np.zeros(out, np.float32)
    if mode == "align_corners":
        return x * (size - 1) / (length - 1) if length > 1 else np.zeros(out, np.float32)
    if mode == "asymmetric":
        return x / scale
    if mode == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    if mode == "tf_crop_and_resize":
        if length > 1:
            return start * (size - 1) + x * (end - start) * (size - 1) / (length - 1)
        return np.full(out, 0.5 * (start + end) * (size - 1), np.float32)
    raise ValueError(f"Resize: unknown coordinate_transformation_mode {mode!r}")


def _nearest_index(x, size: int, nearest_mode: str, scale: float):
    if nearest_mode == "round_prefer_floor":
        i = np.ceil(x - 0.5)
    elif nearest_mode == "round_prefer_ceil":
        i = np.floor(x + 0.5)
    elif nearest_mode == "floor":
        i = np.floor(x)
    elif nearest_mode == "ceil":
        i = np.ceil(x)
    elif nearest_mode == "legacy":  # opsets < 11: ceil when shrinking, else truncate
        i = np.ceil(x) if scale < 1 else np.floor(x)
    else:
        raise ValueError(f"Resize: unknown nearest_mode {nearest_mode!r}")
    return np.clip(i, 0, size - 1).astype(np.int64)


def _taps(x, size: int, scale: float, mode: str, cubic_a: float, exclude_outside: int,
          antialias: int):
    """(out, taps) source indices and weights for linear or cubic interpolation. With
    antialias the kernel is stretched by 1/scale when shrinking (and renormalized)."""
    support = 1.0 if mode == "linear" else 2.0
    stretch = min(scale, 1.0) if antialias else 1.0
    lo = math.floor(-support / stretch) + 1
    offsets = np.arange(lo, 2 - lo)  # symmetric around the [floor, floor + 1] cell
    base = np.floor(x)
    dist = (offsets[None, :] - (x - base)[:, None]) * stretch
    if mode == "linear":
        w = np.clip(1.0 - np.abs(dist), 0.0, None)
    else:
        w = cubic_weights(dist, cubic_a)
    idx = base.astype(np.int64)[:, None] + offsets[None, :]
    if exclude_outside:
        w = np.where((idx < 0) | (idx >= size), 0.0, w)
    if exclude_outside or antialias:
        total = w.sum(axis=1, keepdims=True)
        w = w / np.where(total == 0, 1.0, total)
    return np.clip(idx, 0, size - 1), w


def _work_dtype(dtype):
    return np.float64 if dtype == np.float64 else np.float32


def _along(shape_len: int, axis: int, v):
    """``v`` (1-D) shaped to broadcast along ``axis`` of a rank-``shape_len`` array."""
    shape = [1] * shape_len
    shape[axis] = v.shape[0]
    return v.reshape(shape)


def _resize_axis(y, axis: int, out: int, scale: float, opts: dict, start=0.0, end=1.0):
    """Resize ``y`` along one axis; returns it and the out-of-range mask (or None)."""
    size = y.shape[axis]
    x = _source_coords(out, size, scale, opts["ctm"], start, end)
    outside = None
    if opts["ctm"] == "tf_crop_and_resize":
        outside = (x < 0) | (x > size - 1)
    if opts["mode"] == "nearest":
        return np.take(y, _nearest_index(x, size, opts["nearest_mode"], scale), axis=axis), \
            outside
    idx, w = _taps(x, size, scale, opts["mode"], opts["cubic_a"], opts["exclude_outside"],
                   opts["antialias"])
    w = w.astype(y.dtype)
    acc = None
    for t in range(idx.shape[1]):
        term = np.take(y, idx[:, t], axis=axis) * _along(y.ndim, axis, w[:, t])
        acc = term if acc is None else acc + term
    return acc, outside


def resize_nd(x, axes: list[int], out_sizes: list[int], scales: list[float], opts: dict,
              roi=None):
    """Resize ``x`` on ``axes`` to ``out_sizes``; ``scales`` feed the coordinate maps."""
    dtype = x.dtype
    interp = opts["mode"] != "nearest"
    y = x.astype(_work_dtype(dtype)) if interp else x
    mask = None
    n = len(axes)
    # shrinking axes first: every later pass then works on less data
    order = sorted(range(n), key=lambda i: out_sizes[i] / max(x.shape[axes[i]], 1))
    for i in order:
        a, out, s = axes[i], out_sizes[i], scales[i]
        start, end = (float(roi[i]), float(roi[i + n])) if roi is not None else (0.0, 1.0)
        if out == y.shape[a] and s == 1.0 and opts["ctm"] != "tf_crop_and_resize":
            continue  # every coordinate map is the identity here
        y, outside = _resize_axis(y, a, out, s, opts, start, end)
        if outside is not None and outside.any():
            m = _along(y.ndim, a, outside)
            mask = m if mask is None else mask | m
    if mask is not None:
        y = np.where(mask, np.asarray(opts["extrapolation_value"], dtype=y.dtype), y)
    if y.dtype != dtype:
        if np.dtype(dtype).kind in "iu":
            info = np.iinfo(dtype)
            y = np.clip(np.rint(y), info.min, info.max)
        y = y.astype(dtype)
    return y


def _given(v):
    """An optional input that may also be 'given' as an empty tensor."""
    return v is not None and np.asarray(v).size > 0


@op("Resize", 10, host_inputs=(1,))
def resize10(x, scales, *, mode="nearest"):
    s = [float(v) for v in np.asarray(scales).reshape(-1)]
    outs = [int(math.floor(d * f)) for d, f in zip(x.shape, s)]
    opts = dict(mode=mode, ctm="asymmetric", nearest_mode="legacy", cubic_a=-0.75,
                exclude_outside=0, antialias=0, extrapolation_value=0.0)
    return resize_nd(x, list(range(x.ndim)), outs, s, opts)


@op("Resize", 11, host_inputs=(1, 2, 3))
def resize(x, roi=None, scales=None, sizes=None, *, antialias=0, axes=None,
           coordinate_transformation_mode="half_pixel", cubic_coeff_a=-0.75,
           exclude_outside=0, extrapolation_value=0.0, keep_aspect_ratio_policy="stretch",
           mode="nearest", nearest_mode="round_prefer_floor"):
    rank = x.ndim
    axes = list(range(rank)) if axes is None else [norm_axis(a, rank) for a in axes]
    in_sizes = [x.shape[a] for a in axes]
    if _given(sizes):
        want = [int(v) for v in np.asarray(sizes).reshape(-1)]
        scl = [w / d for w, d in zip(want, in_sizes)]
        if keep_aspect_ratio_policy != "stretch":
            common = (min if keep_aspect_ratio_policy == "not_larger" else max)(scl)
            scl = [common] * len(axes)
            want = [int(math.floor(common * d + 0.5)) for d in in_sizes]
    elif _given(scales):
        scl = [float(v) for v in np.asarray(scales).reshape(-1)]
        want = [int(math.floor(d * s)) for d, s in zip(in_sizes, scl)]
    else:
        raise ValueError("Resize needs either scales or sizes")
    roi_v = np.asarray(roi, dtype=np.float64).reshape(-1) if _given(roi) else None
    if roi_v is not None and roi_v.size == 2 * rank and len(axes) < rank:
        roi_v = np.concatenate([roi_v[axes], roi_v[[a + rank for a in axes]]])
    opts = dict(mode=mode, ctm=coordinate_transformation_mode, nearest_mode=nearest_mode,
                cubic_a=cubic_coeff_a, exclude_outside=exclude_outside,
                antialias=antialias, extrapolation_value=extrapolation_value)
    return resize_nd(x, axes, want, scl, opts, roi_v)


def _upsample(x, scales: list[float], mode: str):
    mode = "linear" if mode in ("linear", "bilinear") else mode
    outs = [int(math.floor(d * s)) for d, s in zip(x.shape, scales)]
    opts = dict(mode=mode, ctm="asymmetric", nearest_mode="legacy", cubic_a=-0.75,
                exclude_outside=0, antialias=0, extrapolation_value=0.0)
    return resize_nd(x, list(range(x.ndim)), outs, scales, opts)


@op("Upsample", 1)
def upsample1(x, *, height_scale=None, width_scale=None, mode="nearest"):
    return _upsample(x, [1.0, 1.0, float(height_scale), float(width_scale)], mode)


@op("Upsample", 7)
def upsample7(x, *, scales=None, mode="nearest"):
    return _upsample(x, [float(s) for s in scales], mode)


@op("Upsample", 9, host_inputs=(1,))
def upsample(x, scales, *, mode="nearest"):
    return _upsample(x, [float(s) for s in np.asarray(scales).reshape(-1)], mode)
