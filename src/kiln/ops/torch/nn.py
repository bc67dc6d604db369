"""Torch kernels for convolution, pooling, normalization, softmax and resize.

ONNX padding ([begins..., ends...], auto_pad) is mapped onto torch's symmetric padding,
with an explicit ``F.pad`` for asymmetric cases. On the CPU, 2-D convolutions with
constant fp32 weights run oneDNN with the weights reordered once when the plan is built
(the layout torch.compile's freezing would pick), in NHWC when ``channels_last`` is on.
Cases a kernel does not cover exactly return None at build time (or NotImplemented at
run time) and run on the NumPy kernel instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.ops._array import axis as norm_axis
from kiln.ops.conv import conv_pads, out_size
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    PerShape,
    as_uint8,
    axis,
    const_tensor,
    floats,
    from_uint8,
    integers,
    ints,
    quantized,
)

NI = NotImplemented
_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_CONVT = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
_MAXPOOL = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}
_AVGPOOL = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}
_MKLDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops, "mkldnn") \
    and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
# Weights are packed for the input shape the convolution will see: packed without it, oneDNN
# on AVX2 picks a kernel wanting another blocking and re-packs the weights on every call
# (117 ms instead of 3.2 ms for a 512x512x3x3 kernel on a 7x7 input).
PREPACK = _MKLDNN and torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))
def native_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies in ``dtype`` natively, in oneDNN's word. Without it
    torch's reference kernels run fp16 9-192x slower than fp32 on the zoo models measured
    (docs/performance.md, "Reduced precision on a CPU without it")."""
    if not _MKLDNN:
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float16 and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())


# oneDNN's bf16 weight packing needs AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT; elsewhere plain
# F.conv2d computes in bf16 instead.
PREPACK_BF16 = PREPACK and native_on_cpu(torch.bfloat16)


# oneDNN's linear primitive with a packed weight against MKL's sgemm (F.linear), measured on
# an AVX-512 AMD EPYC (Zen 5, docs/performance.md): from a megabyte of weight it is as fast
# or up to 3.5x faster at every row count, as it streams the packed weight where MKL
# re-packs it on each call; a smaller weight wins from about 2M multiply-adds and loses
# below to its ~15 us fixed cost. On an AVX2 EPYC the primitive was measured at ~40 us a
# call and no better below 32M multiply-adds, so AVX2 CPUs keep that threshold alone.
_AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
_PACKED_WEIGHT = 1 << 18 if _AVX512 else 1 << 62
_PACKED_MACS = 1 << 21 if _AVX512 else 32_000_000
# 1x1 convolutions up to this many multiply-adds run as linear layers (see conv_kernel;
# measured on the AVX-512 CPU only).
_ROWS_MACS = 24_000_000 if _AVX512 else 0


def linear(site, weight, act: Callable | None = None, post: tuple | None = None):
    """``(a, bias) -> act(a @ weight + bias)`` for a constant 2-D ``weight`` (K, N; a view
    will do), ``a`` of the weight's dtype with at least 2 dims, ``bias`` (N,) or None;
    ``post``: oneDNN's (attr, scalars, algorithm) for ``act``, applied inside the product.

    A call goes through oneDNN with the weight packed when the weight has at least
    ``_PACKED_WEIGHT`` elements or the product at least ``_PACKED_MACS`` multiply-adds; the
    pack is made at the first such call (made at session creation it would be held, with
    the model's own array, by sessions that never run: VGG-16's would add 490 MB to
    creating one) and serves every row count. Otherwise, or where oneDNN does not apply
    (another device or dtype, a reduced compute dtype, tracing for torch.compile), MKL
    multiplies the weight as it is: it reads the (K, N) layout within 7% of the transposed
    one, so no copy is kept.
    """
    tg = site.target
    k, n = weight.shape
    wt = weight.t()

    def plain(a, bias):
        y = F.linear(a, wt, bias)
        return y if act is None else act(y)
    if not (PREPACK and tg.device.type == "cpu" and not tg.tracing
            and tg.compute_dtype is None and weight.dtype == torch.float32):
        return plain
    big = k * n >= _PACKED_WEIGHT
    packs: list = []
    attr, scalars, algo = post if post is not None else ("none", [], "")

    def run(a, bias):
        if a.shape[-1] != k or not (big or a.numel() * n >= _PACKED_MACS):
            return plain(a, bias)  # raises on a mismatched k: oneDNN would not
        if not packs:  # two threads may both pack: the same result, one kept
            packs[:] = [torch.ops.mkldnn._reorder_linear_weight(wt.contiguous())]
        y = torch.ops.mkldnn._linear_pointwise(a.contiguous(), packs[0], bias, attr,
                                               scalars, algo)
        return y if act is None or post is not None else act(y)
    return run


def _window(site, x, ks: list[int]):
    """(strides, dilations, begins, ends) of a conv/pool node for input ``x``: the shared
    geometry of kiln.ops.conv (explicit pads, or computed for auto_pad)."""
    n = x.dim() - 2
    strides = list(site.attr("strides") or [1] * n)
    dil = list(site.attr("dilations") or [1] * n)
    begins, ends = conv_pads(list(x.shape[2:]), ks, strides, dil,
                             site.attr("auto_pad", "NOTSET"), site.attr("pads"))
    return strides, dil, begins, ends


def _torch_pad(begins, ends) -> list[int]:
    """ONNX begins/ends per spatial dim -> F.pad's (last dim first) list."""
    out = []
    for b, e in zip(reversed(begins), reversed(ends)):
        out += [b, e]
    return out


# -- convolution --------------------------------------------------------------------------

_SINGLE_MACS = 1 << 18
"""Convolutions under this many multiply-adds (tens of microseconds on one core) run on one
thread: oneDNN splits even a 50k-MAC layer between every OpenMP thread and then waits for the
slowest; on the shared 2-core VM silero VAD's 1-D convs took 20 us each on one thread and
300 us-4 ms on two when the second thread was descheduled (benchmarks/real_models.py)."""


def _records_grad(args: tuple) -> bool:
    """Whether autograd records an op on ``args`` (tensors, or lists/tuples of them)."""
    if not torch.is_grad_enabled():
        return False
    flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else (x,))]
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat)


def _single_threaded(fn: Callable, *args):
    """``fn(*args)`` with torch's intra-op threads at one. The count is process-wide, so
    another thread's op running meanwhile may also run on one thread: slower, never wrong.

    Not when autograd records the op (training): oneDNN picks another algorithm on one
    thread, so the forward's rounding differs from the PyTorch module's, and train-mode
    BatchNorm over few pixels amplifies that into the gradients (MobileNetV2 at 32x32:
    Kiln's gradient went from closer to the float64 one than PyTorch's to 1.6x farther)."""
    n = torch.get_num_threads()
    if n == 1 or _records_grad(args):
        return fn(*args)
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(n)


def _wide_conv1d(x, w, b, stride: int, dil: int, begin: int, end: int, group: int):
    """A 1-D convolution with a wide kernel or long stride (an STFT written as a Conv: 258
    filters of 256 taps at stride 128) as one strided window view and a matmul: oneDNN took
    0.3-4 ms for silero VAD's, the matmul about 25 us."""
    if begin or end:
        x = F.pad(x, [begin, end])
    k = w.shape[2]
    win = x.unfold(2, (k - 1) * dil + 1, stride)[..., ::dil]  # (n, c, L, k)
    n, c, length = win.shape[:3]
    cols = win.reshape(n, group, c // group, length, k).permute(0, 1, 3, 2, 4) \
        .reshape(n, group, length, -1)
    y = torch.matmul(cols, w.reshape(group, w.shape[0] // group, -1).transpose(1, 2))
    y = y.permute(0, 1, 3, 2).reshape(n, w.shape[0], length)
    return y if b is None else y + b[:, None]

@kernel("Conv", 1, prepare=True)
def conv(site):
    return conv_kernel(site)


def conv_kernel(site, act: Callable | None = None, post: tuple | None = ("none", [], "")):
    """Conv's prepared kernel, followed by the residual ``z`` and ``act`` for FusedConv.

    On an x86 CPU with constant fp32 weights: one oneDNN convolution, the weights
    reordered once per input shape, ``post`` (oneDNN's (attr, scalars, algorithm) for
    ``act``; None when it has none) and a same-shape residual applied inside it.
    """
    tg = site.target
    group = int(site.attr("group", 1))
    wc = site.const(1)
    bc = const_tensor(site, 2)
    low = tg.compute_dtype
    # A depthwise convolution is bound by memory, not arithmetic: on the CPU, casting its
    # activations to bf16 and back made MobileNetV2's 17 of them 1.6x slower (7.7 against 4.7 ms
    # at batch 8 kept in fp32; docs/performance.md), so they stay fp32 there.
    depthwise_fp32 = low is not None and tg.device.type == "cpu" and wc is not None \
        and group > 1 and wc.ndim >= 3 and wc.shape[1] == 1
    if depthwise_fp32:
        low = None
    cl = tg.channels_last
    packable = (PREPACK and tg.device.type == "cpu" and not tg.tracing and wc is not None
                and post is not None and wc.ndim == 4 and wc.dtype.name == "float32"
                and (low is None or (low == torch.bfloat16 and PREPACK_BF16)))
    # A 1x1 convolution over NHWC rows is a linear layer, and on the AVX-512 EPYC oneDNN's
    # linear primitive costs about 15 us a call before any arithmetic where its convolution
    # costs 23: the depthwise nets' small pointwise layers take 0.7-0.95x the time that way
    # (docs/performance.md). Layers over _ROWS_MACS, not measured, keep the convolution.
    rows_ok = packable and cl and low is None and group == 1 and wc.shape[2:] == (1, 1)
    rows_pack: list = []
    # Reduced precision outside oneDNN: the constant weight and bias cast at the first such
    # call (layers that always take oneDNN's packed path never hold the copy); not while
    # tracing for torch.compile, where the cast is part of the program
    keep_low = low is not None and wc is not None and wc.dtype.name == "float32" \
        and not tg.tracing
    lows: list = []

    def as_rows(x, z, b):
        """The 1x1 convolution through oneDNN's linear primitive, or None."""
        n, c, h, w_ = x.shape
        cout = wc.shape[0]
        attr, scalars, algo = post
        if c != wc.shape[1] or n * h * w_ * c * cout > _ROWS_MACS or z is not None and (
                attr != "none" or tuple(z.shape) != (n, cout, h, w_) or z.dtype != x.dtype):
            return None
        if not rows_pack:  # two threads may both pack: the same result, one kept
            rows_pack[:] = [torch.ops.mkldnn._reorder_linear_weight(
                torch.from_numpy(wc.reshape(cout, c).copy()))]
        rows = x.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1) \
            .reshape(-1, c)
        if z is None:
            y = torch.ops.mkldnn._linear_pointwise(rows, rows_pack[0], b, attr, scalars, algo)
        else:
            zr = z.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1) \
                .reshape(-1, cout)
            y = torch.ops.mkldnn._linear_pointwise.binary(rows, zr, rows_pack[0], b, "add")
        return y.view(n, h, w_, cout).permute(0, 3, 1, 2)

    def pack(key):
        pad, strides, dil, shape = key
        w = torch.from_numpy(wc.copy())
        b = bc
        if low is not None:
            w = w.to(low)
            b = None if b is None else b.to(low)
        pw = torch.ops.mkldnn._reorder_convolution_weight(
            w, list(pad), list(strides), list(dil), group, list(shape))
        return pw, b
    packs = PerShape(pack)

    def packed(pad, strides, dil, x):
        return packs((tuple(pad), tuple(strides), tuple(dil), tuple(x.shape)))

    def onednn(x, b, z, strides, dil, begins):
        """The convolution through the packed weights, or None where it cannot run."""
        pw, pb = packed(begins, strides, dil, x)
        if b is not None and b is not bc:
            pb = b if low is None else b.to(low)
        xx = x if low is None else x.to(low)
        if cl:
            xx = xx.contiguous(memory_format=torch.channels_last)
        attr, scalars, algo = post
        if z is None:
            y = torch.ops.mkldnn._convolution_pointwise(xx, pw, pb, begins, strides, dil,
                                                        group, attr, scalars, algo)
            return y if low is None else y.to(torch.float32)
        out = [x.shape[0], pw.shape[0]] + [out_size(*g) for g in zip(
            x.shape[2:], pw.shape[2:], strides, dil, begins, begins)]
        if low is not None or list(z.shape) != out or z.dtype != x.dtype \
                or attr not in ("none", "relu"):
            return None
        if cl:
            z = z.contiguous(memory_format=torch.channels_last)
        return torch.ops.mkldnn._convolution_pointwise(
            xx, z, pw, pb, begins, strides, dil, group, "add", None,
            None if attr == "none" else attr, [], None)

    # fed weights: a kernel_shape that differs from theirs is the NumPy kernel's error
    ks = site.attr("kernel_shape") if wc is None else None

    # Not while tracing for torch.compile (the thread count is no tensor operation to trace)
    # nor on a GPU, where torch's CPU threads do not run the convolution
    one_thread_ok = tg.device.type == "cpu" and not tg.tracing

    def run(x, w, b=None, z=None):
        if x.dtype not in FLOATS or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
            return NI
        n = x.dim() - 2
        if n not in _CONV or w.dim() != n + 2 or ks and list(w.shape[2:]) != list(ks):
            return NI
        if one_thread_ok and x.numel() * w.shape[0] * math.prod(w.shape[2:]) \
                < _SINGLE_MACS * group * math.prod(site.attr("strides") or [1]):
            return _single_threaded(convolve, x, w, b, z)
        return convolve(x, w, b, z)

    def convolve(x, w, b, z):
        n = x.dim() - 2
        strides, dil, begins, ends = _window(site, x, list(w.shape[2:]))
        if n == 1 and low is None and (w.shape[2] >= 16 or strides[0] >= 4):
            y = _wide_conv1d(x, w, b, strides[0], dil[0], begins[0], ends[0], group)
            if z is not None:
                y = y + z
            return y if act is None else act(y)
        if begins != ends:
            x = F.pad(x, _torch_pad(begins, ends))
            begins = [0] * n
        if packable and n == 2 and x.dtype == torch.float32:
            y = None
            if rows_ok and strides == [1, 1] and not any(begins):
                y = as_rows(x, z, b)
            if y is None:
                y = onednn(x, b, z, strides, dil, begins)
            if y is not None:
                return y
        if cl and n == 2:  # NHWC convolutions, and NHWC outputs make the next pooling fast
            x = x.contiguous(memory_format=torch.channels_last)
        if low is not None and x.dtype == torch.float32:
            if keep_low:
                if not lows:  # two threads may both cast: the same result, one kept
                    lows[:] = [w.to(low), None if bc is None else bc.to(low)]
                ww = lows[0]
                bb = None if b is None else lows[1] if bc is not None else b.to(low)
            else:
                ww, bb = w.to(low), None if b is None else b.to(low)
            y = _CONV[n](x.to(low), ww, bb, strides, begins, dil, group).to(torch.float32)
        else:
            y = _CONV[n](x, w, b, strides, begins, dil, group)
        if z is not None:
            y = y + z
        return y if act is None else act(y)

    if packable:
        site.notes.append("oneDNN, weights reordered once" + (", NHWC" if cl else "")
                          + (f", post-op {post[0]}" if post[0] != "none" else ""))
    if low is not None:
        site.notes.append(f"computes in {low}")
    elif depthwise_fp32:
        site.notes.append("depthwise: computes in float32 (faster than a reduced type here)")
    return run


@kernel("ConvTranspose", 1, prepare=True)
def conv_transpose(site):
    if site.attr("output_shape") or site.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID"):
        return None  # pads derived from output_shape / SAME: NumPy kernel
    group = int(site.attr("group", 1))
    low = site.target.compute_dtype
    ks = site.attr("kernel_shape")  # one other than the weights' is the NumPy kernel's error

    def run(x, w, b=None):
        if x.dtype not in FLOATS or w.dtype != x.dtype or (b is not None and b.dtype != x.dtype):
            return NI
        n = x.dim() - 2
        if n not in _CONVT or ks and list(w.shape[2:]) != list(ks):
            return NI
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
        sizes = [s * (i - 1) + o + (k - 1) * d + 1 - bb - e for s, i, o, k, d, bb, e in zip(
            strides, x.shape[2:], outpad, w.shape[2:], dil, begins, ends)]
        extra = [max(0, bb + sz - f) for bb, sz, f in zip(begins, sizes, full)]
        if any(extra):
            y = F.pad(y, _torch_pad([0] * n, extra))
        idx = (slice(None), slice(None)) + tuple(slice(bb, bb + sz) for bb, sz in
                                                 zip(begins, sizes))
        y = y[idx]
        if b is not None:
            y = y + b.reshape((1, -1) + (1,) * n)
        return y if y.dtype == dt else y.to(dt)
    return run


# -- pooling ------------------------------------------------------------------------------

@kernel("MaxPool", 1, prepare=True)
def max_pool(site):
    want_idx = site.output_used(1)
    if want_idx and int(site.attr("storage_order", 0)):
        return None
    ceil = bool(site.attr("ceil_mode", 0))
    ks = list(site.attr("kernel_shape"))
    cl = site.target.channels_last

    def run(x):
        n = x.dim() - 2
        if x.dtype in (torch.uint8, torch.int8) and n == 2 and not want_idx:
            return _max_pool_8bit(site, x, ks, ceil)
        if x.dtype not in FLOATS or n not in _MAXPOOL:
            return NI
        if cl and n == 2 and not want_idx:
            # torch's NCHW max-pool is about 10x slower than its NHWC one on the CPU: the
            # copy costs far less (indices, when asked for, are NCHW positions)
            x = x.contiguous(memory_format=torch.channels_last)
        strides, dil, begins, ends = _window(site, x, ks)
        want = [out_size(*g, ceil) for g in zip(x.shape[2:], ks, strides, dil, begins, ends)]
        if not want_idx and sum(k - 1 for k in ks) <= 4 and x.numel() >= _VIEW_POOL_MIN \
                and not x.requires_grad:
            # (training keeps torch's pool: its gradient goes to one element of a tie, as
            # PyTorch's own modules do)
            y = _max_pool_separable(x, ks, strides, dil, begins, want)
            if y is not None:
                return NI if _nan_in(y) else y
        sym = begins == ends and all(b <= ((k - 1) * d + 1) // 2 for b, k, d in
                                     zip(begins, ks, dil))
        if not sym:
            if want_idx:
                return NI
            x = F.pad(x, _torch_pad(begins, ends), value=-math.inf)
            begins = [0] * n
        r = _MAXPOOL[n](x, ks, strides, begins, dil, ceil_mode=ceil, return_indices=want_idx)
        y = r[0] if want_idx else r
        if list(y.shape[2:]) != want or _nan_in(y):
            # torch's ceil-mode rule differs here; torch spreads a NaN over each window it
            # is in, where onnx.reference skips it: NumPy kernel (a NaN-free result is
            # the same either way, so only the output is checked)
            return NI
        if not want_idx:
            return y
        # torch's indices are per (n, c) plane; ONNX's run over the whole tensor.
        plane = math.prod(x.shape[2:])
        nc = torch.arange(x.shape[0] * x.shape[1], device=x.device).reshape(
            (x.shape[0], x.shape[1]) + (1,) * n)
        return y, r[1] + nc * plane
    return run


def _nan_in(y) -> bool:
    """Whether a max-pool result holds a NaN (torch spreads one over its windows, where
    the reference skips it: the NumPy kernel then answers). Not asked inside
    torch.compile, where a data-dependent branch would break the graph: a compiled
    program keeps torch's NaN rule (docs/reliability.md)."""
    return y.dtype.is_floating_point and not torch.compiler.is_compiling() and \
        bool(torch.isnan(y).any())


def _max_pool_8bit(site, x, ks, ceil: bool):
    """A 2-D max-pool of a quantized model's 8-bit activations (fuse_quant moves pools
    there) as torch's quantized NHWC pool: 0.31 ms for 8x64x112x112, against 19 ms for
    its uint8 NCHW pool and 1.4 ms for the float32 one it replaces."""
    if x.device.type != "cpu":
        return NI
    strides, dil, begins, ends = _window(site, x, ks)
    if begins != ends:
        return NI
    q = quantized(as_uint8(x).contiguous(memory_format=torch.channels_last), 1.0, 0)
    y = integers(F.max_pool2d(q, ks, strides, begins, dil, ceil_mode=ceil))
    want = [out_size(*g, ceil) for g in zip(x.shape[2:], ks, strides, dil, begins, ends)]
    if list(y.shape[2:]) != want:
        return NI
    return from_uint8(y, x.dtype == torch.int8)


_VIEW_POOL_MIN = 2**19
"""Inputs from this many elements pool as maxima over views. Below it torch's pool wins:
a few small ops cost more than its index writes (NHWC, batch 1: 2x2 on 128x32x32 14 against
34 us, 3x3 stride 2 on 64x56x56 41 against 49 us; from 64x104x104 the views are 0.45-0.9x
its time)."""


def _max_pool_separable(x, ks, strides, dil, begins, sizes):
    """Max-pool as running maxima over strided views of ``x``, one spatial axis at a time
    (a window's maximum is the maximum over its rows of the maxima along them), or None
    where some output would see only padding along an axis.

    torch's CPU max-pool computes int64 indices even when they are not asked for: 2x the
    output's bytes written (fresh pages for every call once they pass 32 MB). A k x k
    window is 2(k - 1) elementwise maxima this way, each over contiguous NHWC rows: 2x2
    stride 2 on 8x16x416x416 2.7 against 16 ms (nine views of the whole window: 3.5 ms),
    3x3 stride 2 pad 1 on 1x64x112x112 0.10 against 0.17 ms (docs/performance.md).
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

    def run(x):
        n = x.dim() - 2
        if x.dtype not in FLOATS or n not in _AVGPOOL:
            return NI
        strides, dil, begins, ends = _window(site, x, ks)
        if any(d != 1 for d in dil):
            return NI
        if begins != ends or any(b > k // 2 for b, k in zip(begins, ks)):
            # padding torch's pooling cannot take (uneven, or over half the window), as
            # Inception v1's last pool has: pad first, and without count_include_pad
            # divide by how much of each window lies inside the input
            if ceil or any(p >= k for p, k in zip(begins + ends, ks * 2)):
                return NI
            pad = _torch_pad(begins, ends)
            y = _AVGPOOL[n](F.pad(x, pad), ks, strides)
            if not include:
                inside = F.pad(x.new_ones((1, 1, *x.shape[2:])), pad)
                y = y / _AVGPOOL[n](inside, ks, strides)
            return y
        want = [out_size(*g, ceil) for g in zip(x.shape[2:], ks, strides, dil, begins, ends)]
        y = _AVGPOOL[n](x, ks, strides, begins, ceil_mode=ceil, count_include_pad=include)
        return y if list(y.shape[2:]) == want else NI
    return run


@kernel("GlobalAveragePool", 1)
def global_average_pool(x):
    if x.dtype not in FLOATS:
        return NI
    return x.mean(dim=tuple(range(2, x.dim())), keepdim=True)


@kernel("GlobalMaxPool", 1)
def global_max_pool(x):
    if x.dtype not in FLOATS:
        return NI
    return x.amax(dim=tuple(range(2, x.dim())), keepdim=True)


# -- normalization ------------------------------------------------------------------------

@kernel("BatchNormalization", 7, prepare=True)
def batch_norm(site):
    """Inference with the running statistics; in a training module (:func:`kiln.to_torch`)
    the module's train()/eval() flag decides, whatever ``training_mode`` says: batch
    statistics that update the running ones (module buffers) in place as torch.nn.BatchNorm
    does, and the running statistics as the node's extra outputs."""
    tg = site.target
    if not int(site.attr("spatial", 1)) or not tg.module and (
            int(site.attr("training_mode", 0)) or site.num_outputs > 1):
        return None  # training statistics outside a module, per-position params: NumPy kernel
    eps = float(site.attr("epsilon", 1e-5))
    momentum = 1.0 - float(site.attr("momentum", 0.9))  # torch weighs the batch's share
    extra = _read(site, 1) or _read(site, 2)
    n_out = site.num_outputs

    def run(x, scale, bias, mean, var):
        if x.dtype not in FLOATS or x.dim() < 2:
            return NI
        if any(t.dim() != 1 for t in (scale, bias, mean, var)):
            return NI
        if tg.mode.training:  # batch statistics; updates mean and var (module buffers) in place
            y = F.batch_norm(x, mean, var, scale, bias, True, momentum, eps)
        else:
            dt = x.dtype
            if not all(t.dtype == dt for t in (scale, bias, mean, var)):
                return NI
            y = F.batch_norm(x, mean, var, scale, bias, False, 0.0, eps)
        if extra:
            return y, mean.detach().clone(), var.detach().clone()
        return y if n_out == 1 else (y,) + (None,) * (n_out - 1)
    return run


def _read(site, i: int) -> bool:
    """Whether output ``i`` exists and a node or the graph reads it (exporters leave the
    extra outputs of training-mode BatchNormalization and Dropout unread)."""
    outs = site.node.outputs
    return i < len(outs) and outs[i] is not None and outs[i].is_used()


@kernel("InstanceNormalization", 6)
def instance_norm(x, scale, bias, *, epsilon=1e-5):
    if x.dtype not in FLOATS or x.dim() < 3 or scale.dtype != x.dtype:
        return NI
    return F.instance_norm(x, weight=scale, bias=bias, eps=epsilon)


@kernel("LayerNormalization", 17, prepare=True)
def layer_norm(site):
    ax = int(site.attr("axis", -1))
    eps = float(site.attr("epsilon", 1e-5))
    stats = site.output_used(1) or site.output_used(2)
    if int(site.attr("stash_type", 1)) != 1:
        return None

    def run(x, scale, bias=None):
        if x.dtype not in FLOATS or scale.dtype != x.dtype \
                or (stats and x.dtype == torch.float64):
            return NI
        a = axis(ax, x.dim())
        shape = tuple(x.shape[a:])
        w = scale if tuple(scale.shape) == shape else scale.expand(shape)
        b = bias
        if b is not None and tuple(b.shape) != shape:
            b = b.expand(shape)
        if not stats:
            return F.layer_norm(x, shape, w, b, eps)
        dims = tuple(range(a, x.dim()))
        xf = x.float()
        mean = xf.mean(dim=dims, keepdim=True)
        inv = torch.rsqrt(((xf - mean) ** 2).mean(dim=dims, keepdim=True) + eps)
        y = ((xf - mean) * inv).to(x.dtype) * w
        if b is not None:
            y = y + b
        return y, mean, inv
    return run


@kernel("LpNormalization", 1)
def lp_norm(x, *, axis=-1, p=2):
    if x.dtype not in FLOATS or p not in (1, 2):
        return NI
    axis = norm_axis(axis, x.dim())  # torch sums dim -1 of a scalar; onnxruntime refuses it
    nrm = x.abs().sum(dim=axis, keepdim=True) if p == 1 else \
        torch.sqrt((x * x).sum(dim=axis, keepdim=True))
    return x / torch.where(nrm == 0, torch.ones_like(nrm), nrm)  # zero vectors stay zero


# -- softmax ------------------------------------------------------------------------------

def _softmax_kernel(fn):
    def build(site):
        legacy = site.opset < 13
        ax = int(site.attr("axis", 1 if legacy else -1))

        def run(x):
            if x.dtype not in FLOATS:
                return NI
            if x.dtype == torch.float16:
                # The shared kernel's steps, each rounded to fp16, are ONNX's reference:
                # torch's fused softmax rounds once, from fp32, 1-2 fp16 ulps away from it
                # (on the CPU, and on CUDA in test_attention_4d_causal_fp16_expanded).
                # Same results on both devices; fp16 files only (precision="fp16" keeps
                # softmax in fp32).
                return NI
            if not legacy:
                return fn(x, axis(ax, x.dim()))  # torch takes dim -1 of a scalar
            a = axis(ax, x.dim())
            lead = math.prod(x.shape[:a])
            return fn(x.reshape(lead, -1) if x.numel() else x.reshape(lead, 0), 1) \
                .reshape(x.shape)
        return run
    return build


# 2.9x (opset 1) and 5.0x (opset 13) the generic kernel: one fused torch.softmax
kernel("Softmax", 1, prepare=True)(_softmax_kernel(torch.softmax))
# 3.2x (opset 1) and 5.8x (opset 13) the generic kernel: one fused torch.log_softmax
kernel("LogSoftmax", 1, prepare=True)(_softmax_kernel(torch.log_softmax))


# -- dropout ------------------------------------------------------------------------------

@kernel("Dropout", 7, prepare=True)
def dropout(site):
    """Identity in inference; in a training module (:func:`kiln.to_torch`) the module's
    train()/eval() flag decides, whatever ``training_mode`` says (exporters write it as a
    constant True when exporting in train mode): torch's dropout in train mode, with the
    mask output too when something reads it (in the input's type before opset 10), the
    identity in eval mode."""
    tg = site.target
    masked = _read(site, 1)
    unread = (None,) * (site.num_outputs - 1)  # a mask output nothing reads
    input_typed_mask = site.opset < 10

    def ones(x):
        return torch.ones(x.shape, dtype=x.dtype if input_typed_mask else torch.bool,
                          device=x.device)

    def drop(x, p: float):
        if not masked:  # torch.nn.Dropout's own draw: the same mask from the same seed
            return (F.dropout(x, p, True),) + unread if unread else F.dropout(x, p, True)
        keep = torch.rand(x.shape, device=x.device) >= p
        y = x * keep / (1.0 - p) if p < 1 else torch.zeros_like(x)
        return y, keep.to(x.dtype) if input_typed_mask else keep

    if site.opset >= 12:
        def run12(x, ratio=None, training_mode=None):
            if tg.mode.training:
                return drop(x, 0.5 if ratio is None else floats(ratio)[0])
            if not tg.module and training_mode is not None \
                    and bool(training_mode.reshape(-1)[0]):
                return NI  # asked for by the graph: the NumPy kernel's seeded masks
            return (x, ones(x)) if masked else (x,) + unread if unread else x
        return run12

    ratio = float(site.attr("ratio", 0.5))

    def run(x):
        if tg.mode.training:
            return drop(x, ratio)
        return (x, ones(x)) if masked else (x,) + unread if unread else x
    return run


# -- local response normalization ---------------------------------------------------------

@kernel("LRN", 1, prepare=True)
def lrn(site):
    """torch's local_response_norm: differentiable, where the NumPy kernel is not (so
    kiln.to_torch trains through it). Its channel window leans the other way from ONNX's
    for an even ``size``: those run the NumPy kernel."""
    size = int(site.attr("size"))
    if size % 2 == 0:
        return None
    alpha, beta = float(site.attr("alpha", 1e-4)), float(site.attr("beta", 0.75))
    bias = float(site.attr("bias", 1.0))

    def run(x):
        if x.dtype not in FLOATS or x.dim() < 3:
            return NI
        return F.local_response_norm(x, size, alpha, beta, bias)
    return run


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
    elif mode == "cubic" and ctm in ("half_pixel", "align_corners") \
            and float(site.attr("cubic_coeff_a", -0.75)) == -0.75 \
            and not int(site.attr("exclude_outside", 0)):
        tmode, align = "bicubic", ctm == "align_corners"
    else:
        return None

    def run(x, roi=None, scales=None, sizes=None):
        if x.dtype not in FLOATS:
            return NI
        n = x.dim() - 2
        if n < 1:
            return NI
        m = tmode
        if m == "linear":
            if n not in _INTERP:
                return NI
            m = _INTERP[n]
        if m == "bicubic" and n != 2:
            return NI
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
        y = F.interpolate(x, scale_factor=sc[2:], mode=m, align_corners=align,
                          recompute_scale_factor=False)
        return y if list(y.shape[2:]) == out else NI
    return run


@kernel("Flatten", 1)  # Tensor op, not array_api_compat's wrapper
def flatten(x, *, axis=1):
    a = norm_axis(axis, x.dim(), high=1)
    return x.reshape(math.prod(x.shape[:a]), math.prod(x.shape[a:]))
