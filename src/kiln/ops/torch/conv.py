"""Torch kernels for convolution, and the oneDNN helpers other families share (packed
linear layers, window padding).

ONNX padding ([begins..., ends...], auto_pad) is mapped onto torch's symmetric padding,
with an explicit ``F.pad`` for asymmetric cases. On the CPU, 2-D convolutions with
constant fp32 weights run oneDNN with the weights reordered once when the plan is built
(the layout torch.compile's freezing would pick), in NHWC when ``channels_last`` is on.
Cases a kernel does not cover exactly return None at build time (or NotImplemented at
run time) and run on the NumPy kernel instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.ops.conv import conv_pads, out_size
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    PerShape,
    const_tensor,
    decided,
    fact,
    gated,
    known_rank,
    known_shape,
)

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
_MKLDNN = (
    torch.backends.mkldnn.is_available()
    and hasattr(torch.ops, "mkldnn")
    and hasattr(torch.ops.mkldnn, "_convolution_pointwise")
)
# Weights are packed for the input shape the convolution will see: packed without it, oneDNN
# on AVX2 picks a kernel wanting another blocking and re-packs the weights on every call
# (many times the convolution's own time for a 512x512x3x3 kernel on a 7x7 input).
PREPACK = _MKLDNN and torch.backends.cpu.get_cpu_capability().startswith(("AVX2", "AVX512"))


def native_on_cpu(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies in ``dtype`` natively, in oneDNN's word. Without it
    torch's reference kernels run fp16 many times slower than fp32 on the zoo models
    measured (docs/performance.md, "Reduced precision on a CPU without it")."""
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
# or faster at every row count, as it streams the packed weight where MKL re-packs it on
# each call; a smaller weight wins from about 2M multiply-adds and loses below to its fixed
# cost. On an AVX2 EPYC the primitive's fixed cost was higher and it was no better below
# 32M multiply-adds, so AVX2 CPUs keep that threshold alone.
_AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
_PACKED_WEIGHT = 1 << 18 if _AVX512 else 1 << 62
_PACKED_MACS = 1 << 21 if _AVX512 else 32_000_000
# 1x1 convolutions up to this many multiply-adds run as linear layers (see conv_kernel;
# measured on the AVX-512 CPU only).
_ROWS_MACS = 24_000_000 if _AVX512 else 0
# ... except under this many multiply-adds (and a weight under _PACKED_WEIGHT), where the
# plain product wins, as it does for linear(): PaddleOCR's text-line classifier at batch 1
# (docs/performance.md, issue 42).
_ROWS_PLAIN_MACS = _PACKED_MACS


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

    if not (
        PREPACK
        and tg.device.type == "cpu"
        and not tg.tracing
        and tg.compute_dtype is None
        and weight.dtype == torch.float32
    ):
        return plain
    big = k * n >= _PACKED_WEIGHT
    packs: list = []
    attr, scalars, algo = post if post is not None else ("none", [], "")

    def run(a, bias):
        if a.shape[-1] != k or not (big or a.numel() * n >= _PACKED_MACS):
            return plain(a, bias)  # raises on a mismatched k: oneDNN would not
        if not packs:  # two threads may both pack: the same result, one kept
            packs[:] = [torch.ops.mkldnn._reorder_linear_weight(wt.contiguous())]
        y = torch.ops.mkldnn._linear_pointwise(a.contiguous(), packs[0], bias, attr, scalars, algo)
        return y if act is None or post is not None else act(y)

    return run


def window(site, x, ks: list[int]):
    """(strides, dilations, begins, ends) of a conv/pool node for input ``x``: the shared
    geometry of kiln.ops.conv (explicit pads, or computed for auto_pad)."""
    n = x.dim() - 2
    strides = list(site.attr("strides") or [1] * n)
    dil = list(site.attr("dilations") or [1] * n)
    begins, ends = conv_pads(
        list(x.shape[2:]), ks, strides, dil, site.attr("auto_pad", "NOTSET"), site.attr("pads")
    )
    return strides, dil, begins, ends


def torch_pad(begins, ends) -> list[int]:
    """ONNX begins/ends per spatial dim -> F.pad's (last dim first) list."""
    out = []
    for b, e in zip(reversed(begins), reversed(ends)):
        out += [b, e]
    return out


# -- convolution --------------------------------------------------------------------------


def _wide_conv1d(x, w, b, stride: int, dil: int, begin: int, end: int, group: int):
    """A 1-D convolution with a wide kernel or long stride (an STFT written as a Conv: 258
    filters of 256 taps at stride 128) as one strided window view and a matmul, a fraction
    of oneDNN's time for silero VAD's."""
    if begin or end:
        x = F.pad(x, [begin, end])
    k = w.shape[2]
    win = x.unfold(2, (k - 1) * dil + 1, stride)[..., ::dil]  # (n, c, L, k)
    n, c, length = win.shape[:3]
    cols = (
        win.reshape(n, group, c // group, length, k)
        .permute(0, 1, 3, 2, 4)
        .reshape(n, group, length, -1)
    )
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
    # activations to bf16 and back made MobileNetV2's 17 of them slower than kept in fp32
    # (docs/performance.md), so they stay fp32 there.
    depthwise_fp32 = (
        low is not None
        and tg.device.type == "cpu"
        and wc is not None
        and group > 1
        and wc.ndim >= 3
        and wc.shape[1] == 1
    )
    if depthwise_fp32:
        low = None
    cl = tg.channels_last
    packable = (
        PREPACK
        and tg.device.type == "cpu"
        and not tg.tracing
        and wc is not None
        and post is not None
        and wc.ndim == 4
        and wc.dtype.name == "float32"
        and (low is None or (low == torch.bfloat16 and PREPACK_BF16))
    )
    # A 1x1 convolution over NHWC rows is a linear layer, and on the AVX-512 EPYC oneDNN's
    # linear primitive has a smaller fixed cost a call than its convolution: the depthwise
    # nets' small pointwise layers take less time that way (docs/performance.md). Layers
    # over _ROWS_MACS, not measured, keep the convolution.
    rows_ok = packable and cl and low is None and group == 1 and wc.shape[2:] == (1, 1)
    rows_pack: list = []
    w2d = torch.from_numpy(wc.reshape(wc.shape[0], -1)) if rows_ok else None
    # Reduced precision outside oneDNN: the constant weight and bias cast at the first such
    # call (layers that always take oneDNN's packed path never hold the copy); not while
    # tracing for torch.compile, where the cast is part of the program
    keep_low = low is not None and wc is not None and wc.dtype.name == "float32" and not tg.tracing
    lows: list = []

    def as_rows(x, z, b):
        """The 1x1 convolution through oneDNN's linear primitive, or None."""
        n, c, h, w_ = x.shape
        cout = wc.shape[0]
        attr, scalars, algo = post
        if (
            c != wc.shape[1]
            or n * h * w_ * c * cout > _ROWS_MACS
            or z is not None
            and (attr != "none" or tuple(z.shape) != (n, cout, h, w_) or z.dtype != x.dtype)
        ):
            return None
        rows = x.contiguous(memory_format=torch.channels_last).permute(0, 2, 3, 1).reshape(-1, c)
        if c * cout < _PACKED_WEIGHT and rows.shape[0] * c * cout < _ROWS_PLAIN_MACS:
            # A small layer (a squeeze-excite block's, a text line's pointwise conv) is
            # MKL's plain product, as linear() makes one under the same sizes: oneDNN's
            # primitive costs more a call in fixed overhead than such a product takes.
            y = F.linear(rows, w2d, b).view(n, h, w_, cout).permute(0, 3, 1, 2)
            if z is not None:
                y = y + z
            return y if act is None else act(y)
        if not rows_pack:  # two threads may both pack: the same result, one kept
            rows_pack[:] = [
                torch.ops.mkldnn._reorder_linear_weight(
                    torch.from_numpy(wc.reshape(cout, c).copy())
                )
            ]
        if z is None:
            y = torch.ops.mkldnn._linear_pointwise(rows, rows_pack[0], b, attr, scalars, algo)
        else:
            zr = (
                z.contiguous(memory_format=torch.channels_last)
                .permute(0, 2, 3, 1)
                .reshape(-1, cout)
            )
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
            w, list(pad), list(strides), list(dil), group, list(shape)
        )
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
            y = torch.ops.mkldnn._convolution_pointwise(
                xx, pw, pb, begins, strides, dil, group, attr, scalars, algo
            )
            return y if low is None else y.to(torch.float32)
        out = [x.shape[0], pw.shape[0]] + [
            out_size(*g) for g in zip(x.shape[2:], pw.shape[2:], strides, dil, begins, begins)
        ]
        if (
            low is not None
            or list(z.shape) != out
            or z.dtype != x.dtype
            or attr not in ("none", "relu")
        ):
            return None
        if cl:
            z = z.contiguous(memory_format=torch.channels_last)
        return torch.ops.mkldnn._convolution_pointwise(
            xx,
            z,
            pw,
            pb,
            begins,
            strides,
            dil,
            group,
            "add",
            None,
            None if attr == "none" else attr,
            [],
            None,
        )

    # fed weights: a kernel_shape that differs from theirs is the NumPy kernel's error
    ks = site.attr("kernel_shape") if wc is None else None

    def run(x, w, b=None, z=None):
        n = x.dim() - 2
        strides, dil, begins, ends = window(site, x, list(w.shape[2:]))
        if n == 1 and low is None and (w.shape[2] >= 16 or strides[0] >= 4):
            y = _wide_conv1d(x, w, b, strides[0], dil[0], begins[0], ends[0], group)
            if z is not None:
                y = y + z
            return y if act is None else act(y)
        if begins != ends:
            x = F.pad(x, torch_pad(begins, ends))
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
        site.notes.append(
            "oneDNN, weights reordered once"
            + (", NHWC" if cl else "")
            + (f", post-op {post[0]}" if post[0] != "none" else "")
        )
    if low is not None:
        site.notes.append(f"computes in {low}")
    elif depthwise_fp32:
        site.notes.append("depthwise: computes in float32 (faster than a reduced type here)")
    facts, check = shapes_fit(site, _CONV, ks, weight_rank=True)
    run = decided(site, facts, run, check)
    return run and gated(site, FLOATS, run, same=True)


def shapes_fit(site, ranks, ks, weight_rank: bool) -> tuple[list, Callable]:
    """(facts, check) for :func:`kiln.ops.torch.arrays.decided`: a convolution's input
    has 2 + n dims for an n in ``ranks``, its weights (input 1) as many with
    ``weight_rank``, and their spatial shape is ``ks`` when given (fed weights); else the
    NumPy kernel runs the node and says what is wrong."""
    xr, ws = known_rank(site, 0), known_shape(site, 1)
    facts = [fact(xr, lambda r: r - 2 in ranks)]
    if weight_rank:
        facts.append(None if xr is None or ws is None else len(ws) == xr)
    if ks:
        spatial = None if ws is None else ws[2:]
        facts.append(None if spatial is None or not all(isinstance(d, int) for d in spatial)
                     else list(spatial) == list(ks))

    def check(x, w, *rest) -> bool:
        n = x.dim() - 2
        return n in ranks and (not weight_rank or w.dim() == n + 2) and \
            not (ks and list(w.shape[2:]) != list(ks))
    return facts, check
