"""Torch kernels for Kiln's fused integer layers (QConv, QMatMul, QAdd, made by
``kiln.passes.fuse_quant``, and QuantizeDequantize) on oneDNN's and fbgemm's x86 integer
kernels.

The integer weights are packed once when the session is prepared. Activations travel
between layers as plain uint8/int8 tensors, as ONNX has them. Static convolutions and
linear layers run on oneDNN (``onednn.qconv2d_pointwise``, ``qlinear_pointwise``), which
takes those tensors as they are; residual Adds (and both layers where oneDNN's ops are
missing) on fbgemm, which takes its input wrapped as a quantized tensor
(``_make_per_tensor_quantized_tensor``) and gives back the integer representation of its
output. int8 activations are shifted to uint8 by flipping the sign bit (``x ^ 0x80`` is
``x + 128``), which leaves ``x - zero_point`` unchanged. A linear layer whose output stays
float (logits, dynamic quantization) runs on oneDNN's int8 product with a float32 result
(``onednn.qlinear_pointwise``); without oneDNN, and for such convolutions, it computes in
float32 on the dequantized input, which is what the QDQ file computes.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ops.quant_fused import activation_bounds
from kiln.ops.registry import KILN_DOMAIN
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    PerShape,
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
from kiln.ops.torch.quant import const_grid, first_item

_EIGHT = (torch.uint8, torch.int8)


class _Grid:
    """The output grid of a fused layer: scale, zero point (in uint8 terms), the integer
    clamp its activation makes, and whether the result is int8 (shifted back at the end)."""

    def __init__(self, site, scale_input: int = 7):
        ys, yz = site.const(scale_input), site.const(scale_input + 1)
        self.float_out = not site.has_input(scale_input)
        if self.float_out:
            return
        zdt = yz.dtype if yz is not None else np.dtype(np.uint8)
        self.signed = zdt == np.int8
        self.scale = float(first_item(ys))
        self.zp = int(first_item(yz) or 0) + (128 if self.signed else 0)
        lo, hi = activation_bounds(site.attr("activation", ""), site.attr("activation_params"))
        self.relu = site.attr("activation", "") == "Relu"

        def q(v: float) -> int:
            return int(np.clip(np.rint(np.float64(v) / self.scale) + self.zp, 0, 255))

        self.lo = q(lo) if lo > -np.inf else 0
        self.hi = q(hi) if hi < np.inf else 255
        if self.relu:
            self.lo = 0  # fbgemm's *_relu kernels clamp at the zero point themselves

    def finish(self, y: torch.Tensor) -> torch.Tensor:
        """A uint8 result on this grid (or fbgemm's quantized one) as the ONNX uint8/int8
        tensor."""
        if y.is_quantized:
            y = integers(y)
        if self.lo > 0 or self.hi < 255:
            y = y.clamp_(self.lo, self.hi)
        return from_uint8(y, self.signed)


def _static_grid(site, i: int = 1) -> tuple[float, int, bool] | None:
    """(scale, zero point in uint8 terms, signed) of the per-tensor constant grid whose
    scale is input ``i`` and zero point input ``i + 1``."""
    xs, xz = site.const(i), site.const(i + 1)
    if xs is None or (site.has_input(i + 1) and xz is None):
        return None
    signed = xz is not None and xz.dtype == np.int8
    return float(first_item(xs)), int(first_item(xz) or 0) + (128 if signed else 0), signed


def _as_quint8(x: torch.Tensor, scale: float, zp: int) -> torch.Tensor | None:
    u = as_uint8(x)
    return None if u is None else quantized(u, scale, zp)


def _weight_scales(site, channels: int) -> torch.Tensor:
    """The weight's float32 scales (input 4), one per output channel (a per-tensor scale
    repeated), as oneDNN's int8 kernels take them."""
    ws = np.asarray(site.const(4), np.float32).reshape(-1)
    return torch.from_numpy(np.broadcast_to(ws, (channels,)).copy())


def _symmetric_int8(w: np.ndarray, wz: np.ndarray | None) -> bool:
    """Whether the integer kernels take weight ``w``: int8 with no zero point but 0."""
    return w.dtype == np.int8 and (wz is None or not np.any(wz))


def _static_int8_layer(site, w: np.ndarray) -> tuple[float, int, torch.Tensor | None] | None:
    """The input grid (scale, zero point) and float bias of a fused int8 layer (QConv, QMatMul)
    whose input grid and bias are constants and whose weights are symmetric int8; None when
    the layer is not one the integer kernels take."""
    xin = _static_grid(site)
    if (
        xin is None
        or not _symmetric_int8(w, site.const(5))
        or (site.has_input(6) and site.const(6) is None)
    ):
        return None
    bc = site.const(6)
    return xin[0], xin[1], None if bc is None else torch.from_numpy(bc.astype(np.float32))


def _qweight(w: np.ndarray, ws: np.ndarray, axis: int):
    """The int8 weight as torch's quantized tensor for fbgemm (per channel along ``axis``,
    or per tensor)."""
    t = torch.from_numpy(np.ascontiguousarray(w))
    if ws.size == 1:
        return torch._make_per_tensor_quantized_tensor(t, float(ws.reshape(-1)[0]), 0)
    return torch._make_per_channel_quantized_tensor(
        t,
        torch.from_numpy(ws.reshape(-1).astype(np.float64)),
        torch.zeros(ws.size, dtype=torch.int64),
        axis,
    )


def _centred_weight(w, wz, axis: int, dtype) -> np.ndarray:
    shape = [1] * w.ndim
    shape[axis] = -1
    v = w.astype(dtype)
    if wz is not None:
        v -= np.asarray(wz, dtype).reshape(shape if wz.size > 1 else ())
    return v


def _float_layer(site, weight_axis: int, compute):
    """run() for a layer with a float output where oneDNN's int8 kernels do not apply (a
    weight zero point): float32 on the dequantized input and the once-dequantized weight;
    with ``integer_sum`` the exact sum in float64, then float32(sum) * float32(x_scale *
    w_scale), as onnxruntime's integer ops compute it. Then the bias and the clamp."""
    w, ws, wz = site.const(3), site.const(4), site.const(5)
    if w is None or ws is None or (site.has_input(5) and wz is None):
        return None
    integer = bool(site.attr("integer_sum", 0))
    shape = [1] * w.ndim
    shape[weight_axis] = -1
    wsc = torch.from_numpy(np.asarray(ws, np.float32).reshape(shape if ws.size > 1 else ()))
    wc = torch.from_numpy(
        _centred_weight(w, wz, weight_axis, np.float64 if integer else np.float32)
    )
    wf = wc if integer else wc * wsc
    chan = (-1,) + (1,) * (w.ndim - 2)  # the output's channel axis, before spatial ones
    out_scale = wsc.reshape(chan if ws.size > 1 else ())
    bc = site.const(6)
    b = None if bc is None else torch.from_numpy(bc.astype(np.float32))
    b_out = None if b is None else b.reshape(chan)
    lo, hi = activation_bounds(site.attr("activation", ""), site.attr("activation_params"))
    clamp = (None if lo == -np.inf else lo, None if hi == np.inf else hi)

    def run(x, x_scale, x_zero_point=None, *rest):
        v = x.to(wf.dtype)
        if x_zero_point is not None:
            v -= x_zero_point.to(wf.dtype)
        if integer:
            y = compute(v, wf, None).to(torch.float32)
            y *= x_scale.reshape(()) * out_scale
            if b_out is not None:
                y += b_out
        else:
            v *= x_scale.to(torch.float32)
            y = compute(v, wf, b)
        if clamp != (None, None):
            y = y.clamp_(*clamp)
        return y

    site.notes.append(
        "float output: float64 exact sum"
        if integer
        else "float output: float32 on the dequantized input, weight dequantized once"
    )
    return gated(site, _EIGHT, run)


def _eight_bit(site, run, rank: int = 0):
    """``run`` for a layer whose input (input 0) is uint8 or int8 and has at least ``rank``
    dims: where the plan knows otherwise the node is declined when the session is made
    (the shared kernel runs it); where it does not, each call checks."""
    r = known_rank(site, 0)
    return decided(site, [dtype_in(site, 0, _EIGHT), None if r is None else r >= rank], run,
                   lambda x, *rest: x.dtype in _EIGHT and x.dim() >= rank)


def _cpu(site) -> bool:
    tg = site.target
    return tg.device.type == "cpu" and not tg.tracing


_ONEDNN_QCONV = (
    hasattr(torch.ops.onednn, "qconv2d_pointwise") and torch.backends.mkldnn.is_available()
)


def _onednn_qconv(
    site, w: np.ndarray, xs: float, xz: int, b, strides, pads, dil, group: int, grid: _Grid,
    lift: bool = False,
):
    """run() for a static QConv as oneDNN's int8 convolution on plain uint8 tensors: the
    same integers as fbgemm's (checked on ResNet-18's and MobileNetV2's shapes), without
    wrapping the input as a quantized tensor or copying out its integer representation,
    and faster on ResNet-18's 3x3 layers and on a stride-2 depthwise one."""
    scales = _weight_scales(site, w.shape[0])
    zeros = torch.zeros(w.shape[0], dtype=torch.int64)
    packs = _qconv_packs(site, w, scales, xs, xz, strides, pads, dil, group, lift)
    post = "relu" if grid.relu else "none"

    def run(x, *rest):
        u = as_uint8(x).contiguous(memory_format=torch.channels_last)
        return grid.finish(
            torch.ops.onednn.qconv2d_pointwise(
                u,
                xs,
                xz,
                packs(tuple(u.shape)),
                scales,
                zeros,
                b,
                strides,
                pads,
                dil,
                group,
                grid.scale,
                grid.zp,
                torch.uint8,
                post,
                [],
                "",
            )
        )

    site.notes.append("oneDNN int8 convolution, weights packed once per input shape")
    return _eight_bit(site, run)


def _qconv_packs(
    site, w: np.ndarray, scales, xs: float, xz: int, strides, pads, dil, group: int,
    lift: bool = False,
) -> PerShape:
    """oneDNN's int8 weight packs by input shape. One is made now, for the input's shape
    when the model fixes it: it raises here, not in a run, on a CPU oneDNN's int8
    kernels skip. ``lift``: a 1-D convolution run as a 2-D one of height 1 (its input
    shape gets the unit axis)."""
    wt = torch.from_numpy(np.ascontiguousarray(w))

    def pack(shape):
        return torch.ops.onednn.qconv_prepack(
            wt, scales, xs, xz, strides, pads, dil, group, None if shape is None else list(shape)
        )

    packs = PerShape(pack)
    v = site.node.inputs[0]
    shape = v.shape if v is not None else None
    known = shape is not None and all(isinstance(d, int) for d in shape)
    if known and lift:
        shape = (*shape[:2], 1, *shape[2:])
    first = pack(tuple(shape) if known else None)
    if known:
        packs.seed(tuple(shape), first)
    return packs


def _conv_geometry(site, w: np.ndarray):
    """(strides, pads, dilations) of a 2-D or 1-D QConv as the 2-D integer kernels take
    them (a 1-D one as height 1: unit stride and dilation, no padding on that axis), or
    None for padding they cannot express (auto_pad SAME, unequal begin and end)."""
    k = w.ndim - 2
    strides = list(site.attr("strides") or [1] * k)
    dil = list(site.attr("dilations") or [1] * k)
    pads = list(site.attr("pads") or [0] * (2 * k))
    if site.attr("auto_pad", "NOTSET") not in ("NOTSET", "VALID") or pads[:k] != pads[k:]:
        return None
    if k == 1:
        return [1, *strides], [0, pads[0]], [1, *dil]
    return strides, pads[:2], dil


def _unlifted(run):
    """run() of a 1-D convolution from that of its 2-D form of height 1: the input gets
    the unit axis and the result loses it (views: a channels-last result stays
    channels-last for the next such layer)."""

    def run1d(x, *rest):
        y = run(x.unsqueeze(2), *rest)
        return y if y is NotImplemented else y.squeeze(2)

    return run1d


@kernel("QConv", 1, domain=KILN_DOMAIN, prepare=True)
def qconv(site):
    w = site.const(3)
    if not _cpu(site) or w is None or w.ndim not in (3, 4):
        return None
    geometry = _conv_geometry(site, w)
    if geometry is None:
        return None
    strides, pads, dil = geometry
    group = int(site.attr("group", 1))
    # 1-D convolutions (silero VAD's, Magika's) have no integer kernel of their own in
    # torch: they run as 2-D ones of height 1 rather than on the NumPy fallback.
    lift = w.ndim == 3
    w4 = w[:, :, None, :] if lift else w
    grid = _Grid(site)
    if grid.float_out:

        def prepack(scales):
            return _qconv_packs(site, w4, scales, 1.0, 0, strides, pads, dil, group, lift)

        def product(u, xs, xz, packs, scales, zeros, b):
            if lift:
                u = u.unsqueeze(2)
            u = u.contiguous(memory_format=torch.channels_last)
            y = torch.ops.onednn.qconv2d_pointwise(
                u,
                xs,
                xz,
                packs(tuple(u.shape)),
                scales,
                zeros,
                b,
                strides,
                pads,
                dil,
                group,
                1.0,
                0,
                torch.float32,
                "none",
                [],
                "",
            )
            return y.squeeze(2) if lift else y

        def conv(x, wf, b):
            if lift:
                return F.conv1d(x, wf, b, strides[1:], pads[1:], dil[1:], group)
            return F.conv2d(x, wf, b, strides, pads, dil, group)

        return (_ONEDNN_QCONV and _int_float(site, w4, w.shape[0], prepack, product)) or (
            _float_layer(site, 0, conv)
        )
    static = _static_int8_layer(site, w)
    if static is None:
        return None
    xs, xz, b = static
    run = None
    if _ONEDNN_QCONV:
        with contextlib.suppress(RuntimeError):  # a CPU oneDNN's int8 kernels skip: fbgemm
            run = _onednn_qconv(site, w4, xs, xz, b, strides, pads, dil, group, grid, lift)
    if run is None:
        run = _fbgemm_qconv(site, w4, xs, xz, b, strides, pads, dil, group, grid)
    return _unlifted(run) if lift and run is not None else run


def _fbgemm_qconv(site, w: np.ndarray, xs: float, xz: int, b, strides, pads, dil,
                  group: int, grid: _Grid):
    """run() for a static QConv on fbgemm's int8 convolution (no oneDNN int8 kernels)."""
    packed = torch.ops.quantized.conv2d_prepack(
        _qweight(w, site.const(4), 0), b, strides, pads, dil, group
    )
    conv = torch.ops.quantized.conv2d_relu if grid.relu else torch.ops.quantized.conv2d

    def run(x, *rest):
        qx = _as_quint8(x, xs, xz)
        return grid.finish(
            conv(qx.contiguous(memory_format=torch.channels_last), packed, grid.scale, grid.zp)
        )

    site.notes.append("fbgemm int8 convolution, weights packed once")
    return _eight_bit(site, run)


_ONEDNN_QLINEAR = (
    hasattr(torch.ops.onednn, "qlinear_pointwise") and torch.backends.mkldnn.is_available()
)


def _int_float(site, w: np.ndarray, channels: int, prepack, product):
    """run() for a QConv/QMatMul with a float output (dynamic quantization's layers,
    logits) as oneDNN's int8 kernel with a float32 result: uint8 x (its scale and zero
    point read at run time, as DynamicQuantizeLinear makes them) times the int8 weight
    packed once (``prepack(weight_scales)``), accumulated exactly, scaled and biased in float32
    (``product(u, 1.0, zero_point, packed, x_scale * scales, zeros, bias)``), faster than
    float32 on the dequantized input (16-128 rows, 256<->1024 wide). None where it does
    not apply (a weight zero point, no oneDNN)."""
    ws, wz, bc = site.const(4), site.const(5), site.const(6)
    if (
        not _symmetric_int8(w, wz)
        or ws is None
        or (site.has_input(5) and wz is None)
        or (site.has_input(6) and bc is None)
    ):
        return None
    scales = _weight_scales(site, channels)
    try:
        packed = prepack(scales)
    except RuntimeError:  # a CPU oneDNN's int8 kernels skip: the float32 path
        return None
    zeros = torch.zeros(channels, dtype=torch.int64)
    bias = None if bc is None else torch.from_numpy(bc.astype(np.float32))
    lo, hi = activation_bounds(site.attr("activation", ""), site.attr("activation_params"))
    clamp = (None if lo == -np.inf else lo, None if hi == np.inf else hi)

    # x_scale * w_scale first, as onnxruntime's integer files multiply: oneDNN then gives
    # their float32 values bit for bit (with x_scale apart it rounds twice). A constant
    # input grid (a static file's logits layer) is multiplied in once, here.
    xs_c, xz_c = site.const(1), site.const(2)
    fixed = (
        xs_c is not None
        and xs_c.size == 1
        and (not site.has_input(2) or (xz_c is not None and xz_c.size == 1))
    )
    if fixed:
        out_scales = torch.from_numpy(np.float32(xs_c.reshape(())) * scales.numpy())
        zp_fixed = int(first_item(xz_c) or 0)

    def run(x, x_scale, x_zero_point=None, *rest):
        u = as_uint8(x)
        if fixed:
            zp, s = zp_fixed, out_scales
        else:
            zp = 0 if x_zero_point is None else int(x_zero_point.reshape(()))
            s = x_scale.reshape(()) * scales
        zp += 128 if x.dtype == torch.int8 else 0
        y = product(u, 1.0, zp, packed, s, zeros, bias)
        return y.clamp_(*clamp) if clamp != (None, None) else y

    site.notes.append(
        "oneDNN int8 kernel with a float32 result, weights packed once"
        + (", output scales once" if fixed else "")
    )
    return _eight_bit(site, run, rank=2)


def _onednn_qlinear(site, w: np.ndarray, xs: float, xz: int, b, grid: _Grid):
    """run() for a static QMatMul as oneDNN's int8 product with a uint8 result, on plain
    tensors. Against fbgemm's ``quantized.linear``: faster from 128 rows (BERT at batch 8,
    sequence 128), slower a call at 16 rows; the integers agree but for ties in
    requantizing (1 in 100,000 outputs, one step)."""
    scales = _weight_scales(site, w.shape[1])
    zeros = torch.zeros(w.shape[1], dtype=torch.int32)
    packed = torch.ops.onednn.qlinear_prepack(torch.from_numpy(np.ascontiguousarray(w.T)), None)
    post = "relu" if grid.relu else "none"

    def run(x, *rest):
        return grid.finish(
            torch.ops.onednn.qlinear_pointwise(
                as_uint8(x).contiguous(),
                xs,
                xz,
                packed,
                scales,
                zeros,
                b,
                grid.scale,
                grid.zp,
                torch.uint8,
                post,
                [],
                "",
            )
        )

    site.notes.append("oneDNN int8 linear, weights packed once")
    return _eight_bit(site, run, rank=2)


@kernel("QMatMul", 1, domain=KILN_DOMAIN, prepare=True)
def qmatmul(site):
    w = site.const(3)
    if not _cpu(site) or w is None or w.ndim != 2:
        return None
    grid = _Grid(site)
    if grid.float_out:

        def product(u, xs, xz, packed, scales, zeros, b):
            return torch.ops.onednn.qlinear_pointwise(
                u.contiguous(),
                xs,
                xz,
                packed,
                scales,
                zeros,
                b,
                1.0,
                0,
                torch.float32,
                "none",
                [],
                "",
            )

        def prepack(scales):
            return torch.ops.onednn.qlinear_prepack(
                torch.from_numpy(np.ascontiguousarray(w.T)), None
            )

        return (
            _ONEDNN_QLINEAR and _int_float(site, w, w.shape[1], prepack, product)
        ) or _float_layer(site, 1, lambda x, wf, b: F.linear(x, wf.T, b))
    static = _static_int8_layer(site, w)
    if static is None:
        return None
    xs, xz, b = static
    if _ONEDNN_QLINEAR:
        with contextlib.suppress(RuntimeError):  # a CPU oneDNN's int8 kernels skip: fbgemm
            return _onednn_qlinear(site, w, xs, xz, b, grid)
    packed = torch.ops.quantized.linear_prepack(_qweight(w.T, site.const(4), 0), b)
    linear = torch.ops.quantized.linear_relu if grid.relu else torch.ops.quantized.linear

    def run(x, *rest):
        return grid.finish(linear(_as_quint8(x, xs, xz), packed, grid.scale, grid.zp))

    site.notes.append("fbgemm int8 linear, weights packed once")
    return _eight_bit(site, run, rank=2)


@kernel("QAdd", 1, domain=KILN_DOMAIN, prepare=True)
def qadd(site):
    grids = [_static_grid(site, i) for i in (1, 4, 6)]
    if not _cpu(site) or None in grids:
        return None
    (sa, za, _), (sb, zb, _), _ = grids
    grid = _Grid(site, 6)
    add = torch.ops.quantized.add_relu if grid.relu else torch.ops.quantized.add

    def run(a, a_scale, a_zero_point, b, *rest):
        qa, qb = _as_quint8(a, sa, za), _as_quint8(b, sb, zb)
        if qb.stride() != qa.stride():
            qb = qb.contiguous(memory_format=_layout(qa))
        return grid.finish(add(qa, qb, grid.scale, grid.zp))

    site.notes.append("fbgemm quantized add")
    # fbgemm adds tensors of one shape: a broadcast takes the shared kernel
    a_shape, b_shape = known_shape(site, 0), known_shape(site, 3)
    same = None if a_shape is None or b_shape is None or \
        not all(isinstance(d, int) for d in a_shape + b_shape) else a_shape == b_shape
    return decided(site, [dtype_in(site, 0, _EIGHT), dtype_in(site, 3, _EIGHT), same], run,
                   lambda a, a_scale, a_zero_point, b, *rest: a.dtype in _EIGHT
                   and b.dtype in _EIGHT and a.shape == b.shape)


def _layout(t: torch.Tensor) -> torch.memory_format:
    cl = t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)
    return torch.channels_last if cl else torch.contiguous_format


@kernel("QuantizeDequantize", 1, domain=KILN_DOMAIN, prepare=True)
def quantize_dequantize(site):
    """x rounded onto a constant grid in float32: Q's rounding and clamp without the
    conversions to 8 bits and back (less time than the two nodes' kernels)."""
    grid = const_grid(site)
    if grid is None or grid[2] not in (np.uint8, np.int8):
        return None
    scale, zp, zdt = grid
    lo, hi = (0, 255) if zdt == np.uint8 else (-128, 127)
    z = int(zp)

    def run(x, *rest):
        # clamp(rint(x / s), lo - zp, hi - zp) is q - zp exactly, and DQ multiplies that
        return torch.div(x, scale).round_().clamp_(lo - z, hi - z).mul_(scale)

    return gated(site, (torch.float32,), run)
