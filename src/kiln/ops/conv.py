"""Conv, and the convolution geometry shared by the other convolutions and the pools.

Conv builds im2col columns from the stride phases of the input and does one batched BLAS
matmul over all groups; 1x1 convolutions skip im2col and depthwise ones accumulate over
kernel offsets. ConvTranspose, DeformConv and CausalConvWithState are in conv_variants.py;
ConvInteger and QLinearConv (quant.py) reuse :func:`conv_core`.
"""

from __future__ import annotations

import itertools
import math
import threading

import numpy as np

from kiln.errors import KernelError
from kiln.ops import cost, winograd
from kiln.ops.registry import op

# Keep one im2col buffer under this many elements: larger batches go in chunks.
_COLS_BUDGET = 1 << 24
# Scratch buffers larger than this many bytes are not kept between calls.
_SCRATCH_KEEP = 1 << 26

_scratch_local = threading.local()


def scratch(name: str, shape, dtype) -> np.ndarray:
    """A per-thread reusable work buffer (contents undefined). Large temporaries that
    are allocated fresh on every call cost page faults comparable to the BLAS call."""
    pool = getattr(_scratch_local, "pool", None)
    if pool is None:
        pool = _scratch_local.pool = {}
    size = math.prod(shape)
    dtype = np.dtype(dtype)
    if size * dtype.itemsize > _SCRATCH_KEEP:
        return np.empty(shape, dtype)
    buf = pool.get((name, dtype))
    if buf is None or buf.size < size:
        buf = pool[(name, dtype)] = np.empty(size, dtype)
    return buf[:size].reshape(shape)


# ---------------------------------------------------------------- shared geometry

def spatial_attrs(nd: int, strides, dilations) -> tuple[list[int], list[int]]:
    """Strides and dilations with their defaults of 1 per spatial axis."""
    return list(strides or [1] * nd), list(dilations or [1] * nd)


def conv_pads(in_shape, kernel, strides, dilations, auto_pad="NOTSET", pads=None,
              ceil_mode=False) -> tuple[list[int], list[int]]:
    """Begin and end pads per spatial axis from ``pads`` or ``auto_pad``."""
    nd = len(in_shape)
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        begin, end = [], []
        for n, k, s, d in zip(in_shape, kernel, strides, dilations):
            out = -(-n // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - n)
            small = total // 2
            begin.append(small if auto_pad == "SAME_UPPER" else total - small)
            end.append(total - begin[-1])
        return begin, end
    if auto_pad == "VALID" or not pads:
        return [0] * nd, [0] * nd
    return list(pads[:nd]), list(pads[nd:])


def out_size(n: int, k: int, s: int, d: int, pb: int, pe: int, ceil_mode=False) -> int:
    """Output length of a sliding window; with ``ceil_mode`` a last window that would
    start in the end padding is dropped."""
    span = n + pb + pe - ((k - 1) * d + 1)
    if not ceil_mode:
        return span // s + 1
    out = -(-span // s) + 1
    if (out - 1) * s >= n + pb:
        out -= 1
    return out


def pad_spatial(x: np.ndarray, begin, end, value=0) -> np.ndarray:
    """``x`` padded on its spatial axes (negative pads crop)."""
    if not any(begin) and not any(end):
        return x
    if min(list(begin) + list(end)) < 0:
        crop = tuple(slice(max(-b, 0), n - max(-e, 0))
                     for n, b, e in zip(x.shape[2:], begin, end))
        x = x[(slice(None), slice(None)) + crop]
        begin = [max(b, 0) for b in begin]
        end = [max(e, 0) for e in end]
    shape = x.shape[:2] + tuple(n + b + e for n, b, e in zip(x.shape[2:], begin, end))
    y = np.full(shape, value, dtype=x.dtype)
    y[(slice(None), slice(None)) + tuple(slice(b, b + n) for n, b in
                                         zip(x.shape[2:], begin))] = x
    return y


def offset_slices(offset, strides, dilations, out) -> tuple:
    """Index of the input elements kernel position ``offset`` sees, for every output."""
    return (slice(None), slice(None)) + tuple(
        slice(i * d, i * d + (o - 1) * s + 1, s)
        for i, s, d, o in zip(offset, strides, dilations, out))


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype BLAS computes in: float32 for the half types NumPy has no BLAS for."""
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


# ---------------------------------------------------------------- Conv core
#
# A strided convolution reads, for kernel offset i along an axis, padded positions
# o*s + i*d: phase (i*d) % s of the input, shifted by (i*d) // s. Splitting the padded
# input into its stride phases and flattening each phase's spatial axes turns every
# kernel offset into one contiguous run of the flat phase: the im2col rows become long
# contiguous copies and depthwise convs long multiply-adds. Outputs are computed over
# whole phase rows (a few columns past the output width) and cropped at the end.

class _Phases:
    """The padded input split into stride phases, each flattened, plus per-offset reads."""

    def __init__(self, x, kernel, strides, dilations, begin, out):
        n, c = x.shape[:2]
        self.out = list(out)
        maxbase = [((k - 1) * d) // s for k, s, d in zip(kernel, strides, dilations)]
        self.m = [o + b for o, b in zip(out, maxbase)]
        pstr = [math.prod(self.m[a + 1:]) for a in range(len(self.m))]
        self.length = out[0] * pstr[0]
        size = math.prod(self.m)
        phases = list(itertools.product(*(range(s) for s in strides)))
        buf = scratch("phases", (n, len(phases), c,
                                 size + sum(b * p for b, p in zip(maxbase, pstr))), x.dtype)
        buf.fill(0)
        view = buf[..., :size].reshape((n, len(phases), c) + tuple(self.m))
        for pi, r in enumerate(phases):
            dst, src = [], []
            for ri, s, b, n_in, mm in zip(r, strides, begin, x.shape[2:], self.m):
                j0 = max(0, -(-(b - ri) // s))
                j1 = min(mm, -(-(n_in + b - ri) // s))
                j1 = max(j1, j0)
                dst.append(slice(j0, j1))
                start = j0 * s + ri - b
                src.append(slice(start, start + (j1 - j0 - 1) * s + 1 if j1 > j0 else start, s))
            view[(slice(None), pi, slice(None)) + tuple(dst)] = x[
                (slice(None), slice(None)) + tuple(src)]
        self.buf = buf
        self.view = view
        self.reads = []
        for offset in itertools.product(*(range(k) for k in kernel)):
            pos = [i * d for i, d in zip(offset, dilations)]
            phase = phases.index(tuple(q % s for q, s in zip(pos, strides)))
            bases = [q // s for q, s in zip(pos, strides)]
            self.reads.append((phase, sum(b * p for b, p in zip(bases, pstr)), bases))
        # Whole phase rows waste (m - out) / out of the work along the last axis.
        self.rows_pay = len(out) == 1 or 8 * (self.m[-1] - out[-1]) <= out[-1]

    def read(self, k: int, c0: int = 0, c1: int | None = None) -> np.ndarray:
        """(N, C, L) input values kernel offset ``k`` meets at every output (channels
        c0:c1)."""
        phase, shift, _ = self.reads[k]
        return self.buf[:, phase, c0:c1, shift:shift + self.length]

    def read_exact(self, k: int) -> np.ndarray:
        """(N, C, *out) input values kernel offset ``k`` meets at every output."""
        phase, _, bases = self.reads[k]
        return self.view[(slice(None), phase, slice(None)) + tuple(
            slice(b, b + o) for b, o in zip(bases, self.out))]

    def crop(self, y: np.ndarray) -> np.ndarray:
        """(N, M, L) full-row outputs to (N, M, *out)."""
        y = y.reshape(y.shape[:2] + (self.out[0],) + tuple(self.m[1:]))
        return y[(slice(None), slice(None), slice(None)) + tuple(slice(o) for o in self.out[1:])]


def _finish(y_full, ph, y, b):
    """Crop full-row outputs into ``y``, adding the bias on the way."""
    src = ph.crop(y_full)
    if b is None:
        np.copyto(y, src)
    else:
        np.add(src, b.astype(y.dtype, copy=False).reshape((1, -1) + (1,) * (y.ndim - 2)),
               out=y)
    return y


def conv_core(x, w, b, group, strides, dilations, begin, end, wino=None) -> np.ndarray:
    """Convolution plus bias of float ``x`` by ``w`` (both in the working dtype);
    ``wino``: ``w`` already transformed for Winograd (:func:`winograd.transform`)."""
    kernel = w.shape[2:]
    out = [out_size(n, k, s, d, bg, e) for n, k, s, d, bg, e in
           zip(x.shape[2:], kernel, strides, dilations, begin, end)]
    n, c = x.shape[:2]
    m = w.shape[0]
    out_shape = (n, m) + tuple(out)
    if group > 1 and w.shape[1] == 1 and group == c:
        return _depthwise(x, w, b, strides, dilations, begin, out)
    if wino is not None and winograd.applies(x, w, group, strides, dilations, begin, end):
        return add_bias(winograd.conv3x3(x, wino, begin, end), b)
    if all(k == 1 for k in kernel) and not any(begin) and not any(end):
        xs = x[(slice(None), slice(None)) + tuple(slice(None, None, s) for s in strides)]
        xs = xs.reshape(n, group, c // group, -1)
        y = np.matmul(w.reshape(group, m // group, c // group), xs)
        return add_bias(y.reshape(out_shape), b)
    wm = w.reshape(group, m // group, -1)
    kprod = math.prod(kernel)
    if len(kernel) == 1 and (kprod >= 16 or strides[0] >= 4):
        return add_bias(_wide_1d(x, wm, kernel[0], strides[0], dilations[0], begin[0],
                                 end[0]).reshape(out_shape), b)
    per_item = c * kprod * math.prod(o + 2 for o in out)
    step = max(1, _COLS_BUDGET // max(per_item, 1))
    y = np.empty(out_shape, dtype=x.dtype)
    for i in range(0, n, step):
        ph = _Phases(x[i:i + step], kernel, strides, dilations, begin, out)
        nb = ph.buf.shape[0]
        yi = y[i:i + step]
        if ph.rows_pay:
            cols = scratch("cols", (nb, c, kprod, ph.length), x.dtype)
            for k in range(kprod):
                cols[:, :, k] = ph.read(k)
            full = np.matmul(wm, cols.reshape(nb, group, -1, ph.length),
                             out=scratch("gemm", (nb, group, m // group, ph.length), x.dtype))
            _finish(full.reshape(nb, m, -1), ph, yi, b)
        else:  # small outputs: exact columns, the product lands in y directly
            cols = scratch("cols", (nb, c, kprod) + tuple(out), x.dtype)
            for k in range(kprod):
                cols[:, :, k] = ph.read_exact(k)
            np.matmul(wm, cols.reshape(nb, group, -1, math.prod(out)),
                      out=yi.reshape(nb, group, m // group, -1))
            add_bias(yi, b)
    return y


def _wide_1d(x, wm, k: int, s: int, d: int, begin: int, end: int) -> np.ndarray:
    """A 1-D convolution with a wide kernel or a long stride (an STFT written as a Conv:
    k=256, stride 128): the phase split below would make one Python step per kernel offset
    and per stride phase (256 and 128 of them), where one strided window view and one
    matmul are a small fraction of that time."""
    n, c = x.shape[:2]
    if begin or end:
        x = np.pad(x, ((0, 0), (0, 0), (begin, end)))
    win = np.lib.stride_tricks.sliding_window_view(x, (k - 1) * d + 1, axis=2)[:, :, ::s, ::d]
    g = wm.shape[0]
    # (n, c, L, k) -> (n, g, c/g * k, L): each group's columns, channel-major like wm
    cols = np.ascontiguousarray(win.transpose(0, 1, 3, 2)).reshape(n, g, -1, win.shape[2])
    return np.matmul(wm, cols)


def _depthwise(x, w, b, strides, dilations, begin, out):
    """Depthwise conv (one input channel per group): a multiply-add per kernel offset,
    over a block of channels at a time so the accumulator stays in cache."""
    mult = w.shape[0] // x.shape[1]
    if mult > 1:
        x = np.repeat(x, mult, axis=1)
    ph = _Phases(x, w.shape[2:], strides, dilations, begin, out)
    n, c = x.shape[:2]
    wk = w.reshape(c, -1)
    acc = scratch("gemm", (n, c, ph.length), x.dtype)
    block = max(1, (1 << 16) // max(n * ph.length, 1))
    tmp = scratch("cols", (n, min(block, c), ph.length), x.dtype)
    for c0 in range(0, c, block):
        c1 = min(c, c0 + block)
        a, t = acc[:, c0:c1], tmp[:, :c1 - c0]
        np.multiply(ph.read(0, c0, c1), wk[c0:c1, 0:1], out=a)
        for k in range(1, wk.shape[1]):
            np.multiply(ph.read(k, c0, c1), wk[c0:c1, k:k + 1], out=t)
            a += t
    return _finish(acc, ph, np.empty(x.shape[:2] + tuple(out), x.dtype), b)


def add_bias(y: np.ndarray, b) -> np.ndarray:
    if b is not None:
        y += b.astype(y.dtype, copy=False).reshape((1, -1) + (1,) * (y.ndim - 2))
    return y


def check_kernel_shape(kernel_shape, w) -> None:
    """Refuse a ``kernel_shape`` other than the weights' spatial dims (load refuses it
    where the weights' shape is known; this is for fed weights): the spec infers the
    kernel from the weights, onnxruntime refuses a different one."""
    if kernel_shape is not None and list(kernel_shape) != list(w.shape[2:]):
        raise KernelError(f"kernel_shape {list(kernel_shape)} differs from the weights' "
                          f"spatial dims {list(w.shape[2:])}; drop the attribute or fix it")


CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")


def convolve(x, w, b=None, *, auto_pad="NOTSET", dilations=None, group=1, kernel_shape=None,
             pads=None, strides=None, wino=None) -> np.ndarray:
    """ONNX Conv of ``x`` by ``w`` plus ``b``, computed in float32/64, in ``x``'s dtype."""
    nd = x.ndim - 2
    check_kernel_shape(kernel_shape, w)
    strides, dilations = spatial_attrs(nd, strides, dilations)
    begin, end = conv_pads(x.shape[2:], w.shape[2:], strides, dilations, auto_pad, pads)
    wd = work_dtype(x.dtype)
    y = conv_core(x.astype(wd, copy=False), w.astype(wd, copy=False), b, group, strides,
                  dilations, begin, end, wino)
    return y.astype(x.dtype, copy=False)


def prepare_winograd(site) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(constant weights, their Winograd transform) for a Conv-like node, or Nones."""
    w = site.const(1)
    if w is None:
        return None, None
    nd = w.ndim - 2
    strides, dilations = spatial_attrs(nd, site.attr("strides"), site.attr("dilations"))
    u = winograd.transform(w, int(site.attr("group", 1)), strides, dilations)
    return (w, u) if u is not None else (None, None)


@op("Conv", 1, prepare=True, cost=cost.conv())
def conv(site):
    """Prepared once per node: constant 3x3 weights wide enough for Winograd are
    transformed here, not on every run."""
    attrs = {k: site.attrs[k] for k in CONV_ATTRS if k in site.attrs}
    wc, u = prepare_winograd(site)

    def run(x, w, b=None):
        return convolve(x, w, b, wino=u if w is wc else None, **attrs)
    return run
