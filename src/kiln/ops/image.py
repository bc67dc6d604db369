"""Spatial ops: Pad, CenterCropPad, Col2Im, DepthToSpace/SpaceToDepth, AffineGrid and
GridSample."""

from __future__ import annotations

import math

import numpy as np

from kiln.ops._array import axis as norm_axis
from kiln.ops._array import namespace
from kiln.ops._numeric import int_list
from kiln.ops.registry import op
from kiln.ops.resize import cubic_weights

# -- Pad --------------------------------------------------------------------------------

_MODES = ("constant", "reflect", "edge", "wrap")  # NumPy names them alike


def _pad(x, pads: list[int], mode: str, value, axes=None):
    """Pads as [begin..., end...] for ``axes`` (default all); negative pads crop first."""
    rank = x.ndim
    axes = list(range(rank)) if axes is None else [norm_axis(a, rank) for a in axes]
    n = len(axes)
    widths = [(0, 0)] * rank
    for a, b, e in zip(axes, pads[:n], pads[n:]):
        widths[a] = (b, e)
    if any(b < 0 or e < 0 for b, e in widths):
        x = x[tuple(slice(max(-b, 0), d - max(-e, 0)) for (b, e), d in zip(widths, x.shape))]
        widths = [(max(b, 0), max(e, 0)) for b, e in widths]
    if not any(b or e for b, e in widths):
        return np.array(x, copy=True)
    if mode not in _MODES:
        raise ValueError(f"Pad: unknown mode {mode!r}")
    if mode != "constant":
        return np.pad(x, widths, mode=mode)
    if value is None:
        fill = "" if x.dtype == object else 0
    else:
        fill = np.asarray(value).reshape(-1)[0]
    out = np.full(tuple(d + b + e for d, (b, e) in zip(x.shape, widths)), fill, dtype=x.dtype)
    out[tuple(slice(b, b + d) for d, (b, _) in zip(x.shape, widths))] = x
    return out


@op("Pad", 1)
def pad1(x, *, paddings=None, mode="constant", value=0.0):
    return _pad(x, list(paddings), mode, value)


@op("Pad", 2)
def pad2(x, *, pads=None, mode="constant", value=0.0):
    return _pad(x, list(pads), mode, value)


@op("Pad", 11, host_inputs=(1, 3))
def pad(x, pads, constant_value=None, axes=None, *, mode="constant"):
    return _pad(x, int_list(pads), mode, constant_value,
                None if axes is None else int_list(axes))


@op("CenterCropPad", 18, host_inputs=(1,))
def center_crop_pad(x, shape, *, axes=None):
    """Crop windows start rounded down; odd padding puts the extra element at the end."""
    rank = x.ndim
    axes = list(range(rank)) if axes is None else [norm_axis(a, rank) for a in axes]
    crop = [slice(None)] * rank
    widths = [(0, 0)] * rank
    for a, t in zip(axes, int_list(shape)):
        d = x.shape[a]
        if t < d:
            start = (d - t) // 2
            crop[a] = slice(start, start + t)
        elif t > d:
            widths[a] = ((t - d) // 2, t - d - (t - d) // 2)
    return _pad(x[tuple(crop)], [b for b, _ in widths] + [e for _, e in widths], "constant", 0)


# -- Col2Im -----------------------------------------------------------------------------


@op("Col2Im", 18, host_inputs=(1, 2))
def col2im(x, image_shape, block_shape, *, dilations=None, pads=None, strides=None):
    """Sum column blocks back into an image: one strided slice-add per kernel position
    (the positions one kernel offset reaches never overlap)."""
    img, blk = int_list(image_shape), int_list(block_shape)
    nd = len(img)
    dil = list(dilations or [1] * nd)
    st = list(strides or [1] * nd)
    pads = list(pads or [0] * (2 * nd))
    n, ck, _ = x.shape
    c = ck // math.prod(blk)
    full = [img[i] + pads[i] + pads[i + nd] for i in range(nd)]
    nblocks = [(full[i] - dil[i] * (blk[i] - 1) - 1) // st[i] + 1 for i in range(nd)]
    cols = x.reshape((n, c, *blk, *nblocks))
    out = np.zeros((n, c, *full), dtype=x.dtype)
    for kpos in np.ndindex(*blk):
        window = tuple(slice(k * d, k * d + s * (m - 1) + 1, s)
                       for k, d, s, m in zip(kpos, dil, st, nblocks))
        out[(slice(None), slice(None), *window)] += cols[(slice(None), slice(None), *kpos)]
    return out[(slice(None), slice(None),
                *(slice(pads[i], pads[i] + img[i]) for i in range(nd)))]


# -- depth <-> space --------------------------------------------------------------------


@op("DepthToSpace", 1, generic=True)
def depth_to_space(x, *, blocksize=None, mode="DCR"):
    xp = namespace(x)
    b, c, h, w = x.shape
    bs = blocksize
    if mode == "DCR":
        y = xp.reshape(x, (b, bs, bs, c // (bs * bs), h, w))
        y = xp.permute_dims(y, (0, 3, 4, 1, 5, 2))
    else:  # CRD
        y = xp.reshape(x, (b, c // (bs * bs), bs, bs, h, w))
        y = xp.permute_dims(y, (0, 1, 4, 2, 5, 3))
    return xp.reshape(y, (b, c // (bs * bs), h * bs, w * bs))


@op("SpaceToDepth", 1, generic=True)
def space_to_depth(x, *, blocksize=None, mode="DCR"):
    """The inverse of DepthToSpace in the same mode (opset 28 adds CRD)."""
    xp = namespace(x)
    b, c, h, w = x.shape
    bs = blocksize
    y = xp.reshape(x, (b, c, h // bs, bs, w // bs, bs))
    perm = (0, 3, 5, 1, 2, 4) if mode == "DCR" else (0, 1, 3, 5, 2, 4)
    y = xp.permute_dims(y, perm)
    return xp.reshape(y, (b, c * bs * bs, h // bs, w // bs))


# -- AffineGrid and GridSample ----------------------------------------------------------


def _base_coords(n: int, align_corners: int):
    """Normalized positions of ``n`` pixels on [-1, 1] (centers, or corners' extrema)."""
    if align_corners:
        return np.linspace(-1.0, 1.0, n)
    return (2.0 * np.arange(n) + 1.0) / n - 1.0


@op("AffineGrid", 20)
def affine_grid(theta, size, *, align_corners=0):
    """Output positions theta @ [x, y(, z), 1] for a regular grid, innermost axis first."""
    spatial = int_list(size)[2:]
    axes = [_base_coords(n, align_corners) for n in spatial]
    mesh = np.meshgrid(*axes, indexing="ij")  # outermost spatial axis first
    homog = np.stack([*mesh[::-1], np.ones_like(mesh[0])], axis=-1)  # (..., r + 1)
    grid = np.einsum("...k,nrk->n...r", homog, np.asarray(theta, dtype=np.float64))
    return grid.astype(theta.dtype)


def _reflect(x, lo2: float, hi2: float):
    """Reflect coordinates into [lo2 / 2, hi2 / 2] by repeated mirroring at its ends."""
    if lo2 == hi2:
        return np.zeros_like(x)
    low, span = lo2 / 2, (hi2 - lo2) / 2
    d = np.abs(x - low)
    extra = np.fmod(d, span)
    flips = np.floor(d / span)
    return np.where(flips % 2 == 0, low + extra, span - extra + low)


def _pad_coord(x, size: int, padding_mode: str, align_corners: int):
    """Apply border/reflection padding to source coordinates (zeros: unchanged)."""
    if padding_mode == "border":
        return np.clip(x, 0, size - 1)
    if padding_mode == "reflection":
        bounds = (0, 2 * (size - 1)) if align_corners else (-1, 2 * size - 1)
        return np.clip(_reflect(x, *bounds), 0, size - 1)
    return x


def _grid_taps(x, size: int, mode: str, padding_mode: str, align_corners: int):
    """Per-axis (points, taps) source indices and weights; taps outside the image get
    weight 0 (zeros padding), or are clamped/reflected per tap (cubic)."""
    if mode == "cubic":  # padding applies to each of the 4 taps, not to the coordinate
        base = np.floor(x)
        idx = base[..., None] + np.arange(-1, 3)
        w = cubic_weights(idx - x[..., None], -0.75)
        if padding_mode != "zeros":
            idx = np.rint(_pad_coord(idx, size, padding_mode, align_corners))
    else:
        x = _pad_coord(x, size, padding_mode, align_corners)
        if mode == "nearest":  # rint: halfway points go to the even index
            idx, w = np.rint(x)[..., None], np.ones(x.shape + (1,))
        else:
            base = np.floor(x)
            idx = base[..., None] + np.arange(2)
            frac = (x - base)[..., None]
            w = np.concatenate([1 - frac, frac], axis=-1)
    inside = (idx >= 0) & (idx <= size - 1)
    return np.clip(idx, 0, size - 1).astype(np.int64), np.where(inside, w, 0.0)


@op("GridSample", 16)
@op("GridSample", 20)
def grid_sample(x, grid, *, align_corners=0, mode="linear", padding_mode="zeros"):
    """Sample x at grid positions: all tap combinations (2^r linear, 4^r cubic) are
    gathered as flat indices over the spatial dims, weighted and summed."""
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(mode, mode)
    n, c, *spatial = x.shape
    r = len(spatial)
    out_shape = grid.shape[1:-1]
    g = np.asarray(grid, dtype=np.float64).reshape(n, -1, r)
    taps = []
    for j, size in enumerate(spatial):  # grid lists coordinates innermost axis first
        v = g[..., r - 1 - j]
        if align_corners:
            coord = (v + 1) / 2 * (size - 1)
        else:
            coord = ((v + 1) * size - 1) / 2
        taps.append(_grid_taps(coord, size, mode, padding_mode, align_corners))
    strides = [math.prod(spatial[j + 1:]) for j in range(r)]
    work = np.float64 if x.dtype == np.float64 else np.float32
    flat = x.reshape(n, c, -1).astype(work, copy=False)
    out = np.zeros((n, c, g.shape[1]), dtype=work)
    for combo in np.ndindex(*(t[0].shape[-1] for t in taps)):
        pos = sum(taps[j][0][..., k] * strides[j] for j, k in enumerate(combo))
        w = math.prod(taps[j][1][..., k] for j, k in enumerate(combo))
        out += np.take_along_axis(flat, pos[:, None, :], axis=2) * w[:, None, :].astype(work)
    return out.reshape((n, c, *out_shape)).astype(x.dtype)
