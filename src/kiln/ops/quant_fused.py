"""Kiln's fused quantized layers (domain ``ai.kiln``), made by the optimizer from the QDQ
pattern ``DQ(x), DQ(w) -> Conv/MatMul/Gemm [+ bias] [-> Relu/Clip] -> Q``
(``kiln.passes.fuse_quant``):

    QConv(x, x_scale, x_zero_point, w, w_scale, w_zero_point, B, y_scale, y_zero_point)
    QMatMul(x, x_scale, x_zero_point, w, w_scale, w_zero_point, B, y_scale, y_zero_point)
    QAdd(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point)
    QuantizeDequantize(x, scale, zero_point)

``x`` is 8-bit (uint8 or int8) with a per-tensor scale and zero point, ``w`` an int8
constant with a per-tensor or per-output-channel scale (QConv: axis 0 of an OIHW weight;
QMatMul: the columns of a ``[K, N]`` weight), ``B`` an optional float bias per output
channel. The integer product ``(x - x_zp) * (w - w_zp)`` is accumulated exactly, scaled
by ``x_scale * w_scale``, the bias added, the activation (``Relu``, or ``Clip`` with
``activation_params`` = [min, max]) applied, and the result quantized with ``y_scale`` /
``y_zero_point``. Without ``y_scale`` the output is that float result (a layer whose
output stays float: a model's logits, dynamic quantization), computed as the file it
came from computes it, so that the next DynamicQuantizeLinear sees the same values and
rounds the same way: float32 products of the dequantized operands (a QDQ file), or with
``integer_sum`` = 1 as onnxruntime's ConvInteger/MatMulInteger files do,
``float32(acc) * float32(x_scale * w_scale) + B``. ``QAdd`` is the
residual ``DQ(a), DQ(b) -> Add [-> Relu] -> Q`` of 8-bit tensors with per-tensor grids
(``activation`` = ``Relu`` or empty), computed exactly as those nodes compute it.
``QuantizeDequantize`` is ``DQ(Q(x))`` on one per-tensor grid: x rounded to the nearest
value the 8-bit grid holds, in float32 (a QDQ file's requantizations inside attention).

The NumPy kernels here are the reference; the torch backend runs oneDNN's and fbgemm's
integer kernels (``kiln/ops/torch/quant_fused.py``).
"""

from __future__ import annotations

import numpy as np

from kiln.ir import DType, Node, TensorType, Value
from kiln.ops import cost
from kiln.ops.conv import CONV_ATTRS, convolve
from kiln.ops.function_body import function_body
from kiln.ops.quant import _int_conv, dequantize_linear, quantize_linear, saturate_cast
from kiln.ops.registry import KILN_DOMAIN, op

ACTIVATIONS = ("", "Relu", "Clip")
"""What the fused quantized layers apply before requantizing (both clamp the result)."""

# float32 sums of integers are exact below 2**24: the product is computed in float32 when
# every partial sum provably stays below it, in float64 otherwise.
EXACT_F32 = 2.0 ** 24


def activation_bounds(activation: str, params) -> tuple[float, float]:
    """The (low, high) clamp that ``activation`` applies to the float result."""
    if activation == "Relu":
        return 0.0, np.inf
    if activation == "Clip":
        lo, hi = (list(params or []) + [-np.inf, np.inf])[:2]
        return float(lo), float(hi)
    if activation:
        raise ValueError(f"fused quantized layers apply Relu or Clip, not {activation!r}")
    return -np.inf, np.inf


def _centred(q: np.ndarray, zp, dtype) -> np.ndarray:
    v = q.astype(dtype)
    if zp is not None and np.any(zp):
        v -= np.asarray(zp).astype(dtype)
    return v


def _work_dtype(x, x_zp, w, w_zp, reduce_size: int) -> type:
    """float32 when the exact integer sum of ``reduce_size`` products fits its mantissa."""
    xm = float(np.abs(_centred(np.array([x.min(initial=0), x.max(initial=0)]), x_zp,
                               np.float64)).max(initial=0))
    wm = float(np.abs(_centred(w, w_zp, np.float64)).max(initial=0))
    return np.float32 if reduce_size * xm * wm < EXACT_F32 else np.float64


def _clamped(y: np.ndarray, activation, params) -> np.ndarray:
    lo, hi = activation_bounds(activation, params)
    if lo > -np.inf or hi < np.inf:
        np.clip(y, lo, hi, out=y)
    return y


def _float_result(acc: np.ndarray, x_scale, w_scale, b, activation, params,
                  channel_shape) -> np.ndarray:
    """The float32 output of an exact integer sum, as onnxruntime's integer ops compute
    it: float32(acc) * float32(x_scale * w_scale) + b, then the activation's clamp."""
    ws = np.asarray(w_scale, np.float32)
    scale = np.float32(np.asarray(x_scale).reshape(())) * (
        ws.reshape(channel_shape) if ws.size > 1 else ws.reshape(()))
    y = acc.astype(np.float32) * scale
    if b is not None:
        y += np.asarray(b, np.float32).reshape(channel_shape)
    return _clamped(y, activation, params)


def _finish(acc: np.ndarray, x_scale, w_scale, b, y_scale, y_zp, activation, params,
            channel_shape) -> np.ndarray:
    """acc * x_scale * w_scale + b, clamped by the activation, then quantized (or float)."""
    ws = np.asarray(w_scale, np.float64)
    mult = np.asarray(x_scale, np.float64) * (ws.reshape(channel_shape) if ws.size > 1
                                              else ws.reshape(()))
    y = acc.astype(np.float64) * mult
    if b is not None:
        y += np.asarray(b, np.float64).reshape(channel_shape)
    y = _clamped(y, activation, params)
    zp = np.zeros((), np.uint8) if y_zp is None else np.asarray(y_zp)
    return saturate_cast(np.rint(y / np.float64(y_scale)) + zp.astype(np.float64), zp.dtype)


def _out_type(ctx, float_shape):
    zp = ctx.tensor_type(8)
    if not ctx.has_input(7):
        dtype = DType.FLOAT
    elif zp is not None:
        dtype = zp.dtype
    else:
        dtype = DType.UINT8
    return [TensorType(dtype, float_shape)]


def _float_op_shape(op_type: str, inputs: list, attrs: dict | None = None):
    """The output shape the standard op ``op_type`` infers on float stand-ins of the same
    shapes as ``inputs`` (a fused quantized op's shape is its float op's)."""
    from kiln.onnxio.infer import onnx_infer

    probe = Node(op_type, [Value(f"i{k}", TensorType(DType.FLOAT, v.shape if v is not None
                                                     else None))
                           for k, v in enumerate(inputs)], [None], attrs or {})
    out = onnx_infer(probe, 21, {"": 21})[0]
    return out.shape if isinstance(out, TensorType) else None


def _infer_qconv(ctx):
    node = ctx.node
    return _out_type(ctx, _float_op_shape(
        "Conv", [node.inputs[0], node.inputs[3]],
        {k: v for k, v in node.attrs.items() if k in CONV_ATTRS}))


@op("QConv", 1, domain=KILN_DOMAIN, infer=_infer_qconv, differentiable=False,
    cost=cost.conv(3))
def qconv(x, x_scale, x_zero_point, w, w_scale, w_zero_point=None, b=None, y_scale=None,
          y_zero_point=None, *, auto_pad="NOTSET", dilations=None, group=1,
          kernel_shape=None, pads=None, strides=None, activation="",
          activation_params=None, integer_sum=0):
    """Quantize(activation(Conv(DQ(x), DQ(w)) + b)), the convolution summed exactly."""
    if y_scale is None and not integer_sum:
        xf = dequantize_linear(x, x_scale, x_zero_point)
        wf = dequantize_linear(w, w_scale, w_zero_point, axis=0)
        y = convolve(xf, wf, b, auto_pad=auto_pad, dilations=dilations, group=group,
                     pads=pads, strides=strides)
        return _clamped(np.array(y, np.float32, copy=True), activation, activation_params)
    wz = w_zero_point
    if wz is not None and wz.size > 1:
        wz = wz.reshape((-1,) + (1,) * (w.ndim - 1))
    dt = _work_dtype(x, x_zero_point, w, wz, int(np.prod(w.shape[1:])))
    acc = _int_conv(_centred(x, x_zero_point, dt), _centred(w, wz, dt), group, auto_pad,
                    dilations, pads, strides)
    chan = (1, -1) + (1,) * (acc.ndim - 2)
    if y_scale is None:
        return _float_result(acc, x_scale, w_scale, b, activation, activation_params, chan)
    return _finish(acc, x_scale, w_scale, b, y_scale, y_zero_point, activation,
                   activation_params, chan)


def _infer_qmatmul(ctx):
    x, w = ctx.tensor_type(0), ctx.tensor_type(3)
    if x is None or w is None or x.shape is None or w.shape is None:
        return _out_type(ctx, None)
    return _out_type(ctx, tuple(x.shape[:-1]) + (w.shape[-1],))


@op("QMatMul", 1, domain=KILN_DOMAIN, infer=_infer_qmatmul, differentiable=False,
    cost=cost.matmul)
def qmatmul(x, x_scale, x_zero_point, w, w_scale, w_zero_point=None, b=None, y_scale=None,
            y_zero_point=None, *, activation="", activation_params=None, integer_sum=0):
    """Quantize(activation(DQ(x) @ DQ(w) + b)) for a 2-D ``[K, N]`` weight, the product
    summed exactly."""
    if y_scale is None and not integer_sum:
        y = np.matmul(dequantize_linear(x, x_scale, x_zero_point),
                      dequantize_linear(w, w_scale, w_zero_point, axis=1))
        if b is not None:
            y = y + b
        return _clamped(np.array(y, np.float32, copy=True), activation, activation_params)
    dt = _work_dtype(x, x_zero_point, w, w_zero_point, w.shape[0])
    xc = _centred(x, x_zero_point, dt)
    acc = np.matmul(xc.reshape(-1, xc.shape[-1]), _centred(w, w_zero_point, dt))
    acc = acc.reshape(x.shape[:-1] + w.shape[-1:])
    if y_scale is None:
        return _float_result(acc, x_scale, w_scale, b, activation, activation_params, (-1,))
    return _finish(acc, x_scale, w_scale, b, y_scale, y_zero_point, activation,
                   activation_params, (-1,))


def _infer_qadd(ctx):
    zp = ctx.tensor_type(7)
    return [TensorType(zp.dtype if zp is not None else DType.UINT8,
                       _float_op_shape("Add", [ctx.node.inputs[0], ctx.node.inputs[3]]))]


@op("QAdd", 1, domain=KILN_DOMAIN, infer=_infer_qadd, differentiable=False,
    cost=cost.elementwise)
def qadd(a, a_scale, a_zero_point, b, b_scale, b_zero_point, y_scale, y_zero_point=None, *,
         activation=""):
    """Quantize(activation(DQ(a) + DQ(b))): a residual Add between 8-bit tensors (and
    its Relu), computed as the QDQ nodes it replaces compute it."""
    y = dequantize_linear(a, a_scale, a_zero_point) + dequantize_linear(b, b_scale,
                                                                        b_zero_point)
    return quantize_linear(_clamped(y, activation, None), y_scale, y_zero_point)


def _infer_round_trip(ctx):
    return [TensorType(DType.FLOAT, ctx.node.inputs[0].shape)]


@op("QuantizeDequantize", 1, domain=KILN_DOMAIN, infer=_infer_round_trip,
    differentiable=False, cost=cost.elementwise)
def quantize_dequantize(x, scale, zero_point=None):
    """DQ(Q(x)) on one per-tensor grid: ``x`` rounded to the grid's nearest value (ties to
    even), saturating at its ends, as the two nodes it replaces compute it."""
    return dequantize_linear(quantize_linear(x, scale, zero_point), scale, zero_point)


# ---------------------------------------------------------------- function bodies
# The same layers in standard ONNX ops (DequantizeLinear, Conv/MatMul, Add, Clip,
# QuantizeLinear), so that a saved optimized model runs in other runtimes.

def _body(b, compute, integer) -> None:
    conv = b.node.op_type == "QConv"
    channels = [-1] + [1] * (b.need_rank(0) - 2) if conv else [-1]
    axis = {"axis": 0 if conv else 1}
    ws = b.node.inputs[4]
    per_tensor = ws is None or ws.shape is None or len(ws.shape) == 0
    if per_tensor:
        axis = {}
    if b.attrs.get("integer_sum", 0) and b.input(7) is None:
        # onnxruntime's integer form, which this layer's float32 values come from
        acc = b.op("Cast", integer(b.input(0), b.input(3), b.input(2), b.input(5)), to=1)
        scale = b.op("Mul", b.input(1), b.input(4))
        y = b.op("Mul", acc, scale if per_tensor else b.op("Reshape", scale, b.ints(channels)))
    else:
        x = b.op("DequantizeLinear", b.input(0), b.input(1), b.input(2))
        y = compute(x, b.op("DequantizeLinear", b.input(3), b.input(4), b.input(5), **axis))
    if b.input(6) is not None:
        bias = b.input(6)
        if conv:
            bias = b.op("Reshape", bias, b.ints(channels))
        y = b.op("Add", y, bias)
    lo, hi = activation_bounds(b.attrs.get("activation", ""), b.attrs.get("activation_params"))
    if lo > -np.inf or hi < np.inf:
        y = b.op("Clip", y, b.const(lo, np.float32) if lo > -np.inf else None,
                 b.const(hi, np.float32) if hi < np.inf else None)
    if b.input(7) is not None:
        y = b.op("QuantizeLinear", y, b.input(7), b.input(8))
    b.finish(y)


@function_body("QConv")
def _qconv_body(b):
    conv = {k: v for k, v in b.attrs.items() if k in CONV_ATTRS}
    _body(b, lambda x, w: b.op("Conv", x, w, **conv),
          lambda *xw: b.op("ConvInteger", *xw, **conv))


@function_body("QMatMul")
def _qmatmul_body(b):
    _body(b, lambda x, w: b.op("MatMul", x, w), lambda *xw: b.op("MatMulInteger", *xw))


@function_body("QAdd")
def _qadd_body(b):
    y = b.op("Add", b.op("DequantizeLinear", b.input(0), b.input(1), b.input(2)),
             b.op("DequantizeLinear", b.input(3), b.input(4), b.input(5)))
    if b.attrs.get("activation", ""):
        y = b.op("Relu", y)
    b.finish(b.op("QuantizeLinear", y, b.input(6), b.input(7)))


@function_body("QuantizeDequantize")
def _round_trip_body(b):
    q = b.op("QuantizeLinear", b.input(0), b.input(1), b.input(2))
    b.finish(b.op("DequantizeLinear", q, b.input(1), b.input(2)))
