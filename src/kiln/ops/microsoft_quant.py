"""onnxruntime's quantized operators (domain ``com.microsoft``), as its quantization tools
write them: static QOperator format (QGemm, QLinearAdd/Mul/Softmax/Concat/LeakyRelu/Sigmoid/
GlobalAveragePool/AveragePool), dynamic quantization (DynamicQuantizeMatMul, MatMulIntegerToFloat,
QAttention, QEmbedLayerNormalization, DynamicQuantizeLSTM) and weight-only block
quantization (MatMulNBits). Semantics follow onnxruntime's ContribOperators documentation.

Integer products are accumulated exactly in float64 (as in :mod:`kiln.ops.quant`); the
quantized elementwise ops dequantize, compute in float32 and quantize again.
"""

from __future__ import annotations

import numpy as np

from kiln.errors import UnsupportedOpError
from kiln.ir import TensorType
from kiln.ir.symbolic import broadcast
from kiln.ir.types import DType
from kiln.ops import cost
from kiln.ops.fused import layer_norm
from kiln.ops.microsoft import (
    MS_DOMAIN,
    _same_as_first,
    _tensor,
    attend,
    embed,
    mask_index,
    no_past,
    qkv_sizes,
)
from kiln.ops.pool import average_pool
from kiln.ops.quant import dequantize_linear, dynamic_quantize_linear, quantize_linear
from kiln.ops.registry import op
from kiln.ops.rnn import lstm


def _deq(x, scale, zero_point=None) -> np.ndarray:
    """``x`` dequantized to float32 (per-tensor scale and zero point)."""
    return dequantize_linear(x, scale, zero_point).astype(np.float32, copy=False)


def _q(v, scale, zero_point, like) -> np.ndarray:
    """float ``v`` quantized with ``scale``/``zero_point`` into the zero point's type (or
    ``like``'s when there is none)."""
    if zero_point is None:
        zero_point = np.zeros((), like.dtype)
    return quantize_linear(v.astype(np.float32, copy=False), scale, zero_point)


def _minus(x, zp) -> np.ndarray:
    v = x.astype(np.float64)
    return v if zp is None else v - np.asarray(zp).astype(np.float64)


def _int_matmul(a, a_zp, b, b_zp) -> np.ndarray:
    """(A - a_zp) @ (B - b_zp), exact; a per-column B zero point is a vector of N."""
    return np.matmul(_minus(a, a_zp), _minus(b, b_zp))


def _float(t) -> DType:
    return t.dtype if isinstance(t, TensorType) else DType.FLOAT


# ---------------------------------------------------------------- elementwise, requantized

def _infer_qbinary(ctx):
    a, b = ctx.tensor_type(0), ctx.tensor_type(3)
    if a is None:
        return None
    if b is None or a.shape is None or b.shape is None:
        return [TensorType(a.dtype)]
    return [_tensor(a.dtype, broadcast(a.shape, b.shape))]


@op("QLinearAdd", 1, domain=MS_DOMAIN, infer=_infer_qbinary, differentiable=False,
    cost=cost.elementwise)
def qlinear_add(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale,
                c_zero_point=None):
    """A + B on quantized tensors, the sum quantized with C's scale and zero point."""
    return _q(_deq(a, a_scale, a_zero_point) + _deq(b, b_scale, b_zero_point), c_scale,
              c_zero_point, a)


@op("QLinearMul", 1, domain=MS_DOMAIN, infer=_infer_qbinary, differentiable=False,
    cost=cost.elementwise)
def qlinear_mul(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c_scale,
                c_zero_point=None):
    """A * B on quantized tensors, the product quantized with C's scale and zero point."""
    return _q(_deq(a, a_scale, a_zero_point) * _deq(b, b_scale, b_zero_point), c_scale,
              c_zero_point, a)


@op("QLinearLeakyRelu", 1, domain=MS_DOMAIN, infer=_same_as_first, differentiable=False,
    cost=cost.elementwise)
def qlinear_leaky_relu(x, x_scale, x_zero_point, y_scale, y_zero_point=None, *, alpha=0.01):
    """LeakyRelu on a quantized tensor."""
    v = _deq(x, x_scale, x_zero_point)
    return _q(np.where(v < 0, v * np.float32(alpha), v), y_scale, y_zero_point, x)


@op("QLinearSigmoid", 1, domain=MS_DOMAIN, infer=_same_as_first, differentiable=False,
    cost=cost.per_element(4))
def qlinear_sigmoid(x, x_scale, x_zero_point, y_scale, y_zero_point=None):
    """Sigmoid on a quantized tensor."""
    v = _deq(x, x_scale, x_zero_point)
    return _q(1 / (1 + np.exp(-v)), y_scale, y_zero_point, x)


@op("QLinearAveragePool", 1, domain=MS_DOMAIN, differentiable=False, cost=cost.pool)
def qlinear_average_pool(x, x_scale, x_zero_point, y_scale, y_zero_point=None, *,
                         auto_pad="NOTSET", ceil_mode=0, count_include_pad=0,
                         kernel_shape=None, pads=None, strides=None, channels_last=0):
    """AveragePool on a quantized NCHW (or NHWC) tensor."""
    v = _deq(x, x_scale, x_zero_point)
    if channels_last:
        v = np.moveaxis(v, -1, 1)
    y = average_pool(v, auto_pad=auto_pad, ceil_mode=ceil_mode,
                     count_include_pad=count_include_pad, kernel_shape=kernel_shape,
                     pads=pads, strides=strides)
    if channels_last:
        y = np.moveaxis(y, 1, -1)
    return _q(y, y_scale, y_zero_point, x)


@op("QLinearSoftmax", 1, domain=MS_DOMAIN, infer=_same_as_first, differentiable=False,
    cost=cost.per_element(4))
def qlinear_softmax(x, x_scale, x_zero_point, y_scale, y_zero_point, *, axis=-1, opset=13):
    """Softmax on a quantized tensor; ``opset`` < 13 means the opset-1 semantics (the input
    flattened to 2-D at ``axis``)."""
    v = _deq(x, x_scale, x_zero_point)
    shape = v.shape
    ax = axis + v.ndim if axis < 0 else axis
    if opset < 13:
        v = v.reshape(int(np.prod(shape[:ax])), -1)
        ax = 1
    v = v - v.max(axis=ax, keepdims=True)
    e = np.exp(v)
    y = (e / e.sum(axis=ax, keepdims=True)).reshape(shape)
    return _q(y, y_scale, y_zero_point, x)


def _infer_qgap(ctx):
    x = ctx.tensor_type(0)
    if x is None or x.shape is None:
        return None
    if ctx.node.attrs.get("channels_last", 0):
        shape = (x.shape[0],) + (1,) * (len(x.shape) - 2) + (x.shape[-1],)
    else:
        shape = tuple(x.shape[:2]) + (1,) * (len(x.shape) - 2)
    return [TensorType(x.dtype, shape)]


@op("QLinearGlobalAveragePool", 1, domain=MS_DOMAIN, infer=_infer_qgap,
    differentiable=False, cost=cost.elementwise)
def qlinear_global_average_pool(x, x_scale, x_zero_point, y_scale, y_zero_point, *,
                                channels_last=0):
    """The mean over the spatial axes of a quantized NCHW (or NHWC) tensor."""
    axes = tuple(range(1, x.ndim - 1)) if channels_last else tuple(range(2, x.ndim))
    mean = _minus(x, x_zero_point).mean(axis=axes, keepdims=True)
    return _q(mean * np.asarray(x_scale, np.float64), y_scale, y_zero_point, x)


def _infer_qconcat(ctx):
    first = ctx.tensor_type(2)
    shapes = [ctx.shape(i) for i in range(2, len(ctx.node.inputs), 3)]
    if first is None or any(s is None for s in shapes):
        return None
    ax = ctx.node.attrs.get("axis", 0)
    ax = ax + len(shapes[0]) if ax < 0 else ax
    dims = [s[ax] for s in shapes]
    total = sum(dims) if all(isinstance(d, int) for d in dims) else None
    return [TensorType(first.dtype, tuple(shapes[0][:ax]) + (total,) + tuple(shapes[0][ax + 1:]))]


@op("QLinearConcat", 1, domain=MS_DOMAIN, infer=_infer_qconcat, differentiable=False)
def qlinear_concat(y_scale, y_zero_point, *inputs, axis=0):
    """Concat of quantized tensors given as (tensor, scale, zero point) triples, each
    requantized to Y's scale and zero point."""
    parts = [_q(_deq(x, s, z), y_scale, y_zero_point, x)
             for x, s, z in zip(inputs[::3], inputs[1::3], inputs[2::3])]
    return np.concatenate(parts, axis=axis)


# ---------------------------------------------------------------- matrix products

def _infer_qgemm(ctx):
    a, b = ctx.shape(0), ctx.shape(3)
    zp = ctx.tensor_type(8)
    dtype = zp.dtype if zp is not None else DType.FLOAT
    if a is None or b is None:
        return [TensorType(dtype)]
    at = ctx.node.attrs
    m = a[1] if at.get("transA", 0) else a[0]
    n = b[0] if at.get("transB", 0) else b[1]
    return [TensorType(dtype, (m, n))]


@op("QGemm", 1, domain=MS_DOMAIN, infer=_infer_qgemm, differentiable=False, cost=cost.gemm)
def qgemm(a, a_scale, a_zero_point, b, b_scale, b_zero_point, c=None, y_scale=None,
          y_zero_point=None, *, alpha=1.0, transA=0, transB=0):
    """alpha * A' @ B' + C on quantized A and B (B per-tensor or per-column); C is int32
    quantized with scale a_scale * b_scale * alpha. The result is quantized with
    y_scale/y_zero_point when given, else float32."""
    if transA:
        a = a.T
    if transB:
        b = b.T
    acc = _int_matmul(a, a_zero_point, b, b_zero_point)
    if c is not None:
        acc += c.astype(np.float64)
    mult = alpha * a_scale.astype(np.float64) * b_scale.astype(np.float64)
    if y_scale is None:
        return (acc * mult).astype(np.float32)
    # the requantization multiplier in float32, as integer engines apply it
    mult = (mult / y_scale.astype(np.float64)).astype(np.float32).astype(np.float64)
    v = np.rint(acc * mult) + np.asarray(y_zero_point, np.float64)
    info = np.iinfo(y_zero_point.dtype)
    return np.clip(v, info.min, info.max).astype(y_zero_point.dtype)


def _infer_float_matmul(scale_input: int):
    def rule(ctx):
        a, b = ctx.shape(0), ctx.shape(1)
        dtype = _float(ctx.tensor_type(scale_input))
        if a is None or b is None or len(b) != 2:
            return [TensorType(dtype)]
        return [TensorType(dtype, tuple(a[:-1]) + (b[-1],))]
    return rule


def _scaled(acc, scale, bias) -> np.ndarray:
    y = (acc * scale.astype(np.float64)).astype(np.float32)
    if bias is not None:
        y += bias.astype(np.float32)
    return y


@op("MatMulIntegerToFloat", 1, domain=MS_DOMAIN, infer=_infer_float_matmul(2),
    differentiable=False, cost=cost.matmul)
def matmul_integer_to_float(a, b, a_scale, b_scale, a_zero_point=None, b_zero_point=None,
                            bias=None):
    """(A - a_zp) @ (B - b_zp) * a_scale * b_scale + bias, in float."""
    acc = _int_matmul(a, a_zero_point, b, b_zero_point)
    return _scaled(acc, a_scale.astype(np.float32) * b_scale.astype(np.float32), bias)


@op("DynamicQuantizeMatMul", 1, domain=MS_DOMAIN, infer=_infer_float_matmul(0),
    differentiable=False, cost=cost.matmul)
def dynamic_quantize_matmul(a, b, b_scale, b_zero_point=None, bias=None):
    """A @ B with float A quantized to uint8 on the fly (DynamicQuantizeLinear) and B
    already quantized (per-tensor or per-column)."""
    qa, a_scale, a_zp = dynamic_quantize_linear(a)
    acc = _int_matmul(qa, a_zp, b, b_zero_point)
    return _scaled(acc, a_scale * b_scale.astype(np.float32), bias)


def _unpack(packed: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ``bits``-wide values packed low bits first into uint8, one per slot."""
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    vals = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return vals.reshape(packed.shape[:-1] + (packed.shape[-1] * per,))


def _infer_nbits(ctx):
    a = ctx.tensor_type(0)
    if a is None:
        return None
    n = ctx.node.attrs.get("N")
    return [_tensor(a.dtype, None if a.shape is None else tuple(a.shape[:-1]) + (n,))]


@op("MatMulNBits", 1, domain=MS_DOMAIN, infer=_infer_nbits, cost=cost.matmul)
def matmul_nbits(a, b, scales, zero_points=None, g_idx=None, bias=None, *, K=None, N=None,
                 bits=4, block_size=None, accuracy_level=0, weight_prepacked=0):
    """A @ W^T + bias, W [N, K] stored in blocks of ``block_size`` ``bits``-bit values
    along K, each block with its scale and zero point (packed like the weights, or float;
    by default 2**(bits-1))."""
    if g_idx is not None or weight_prepacked or 8 % bits:
        raise UnsupportedOpError("MatMulNBits with g_idx, prepacked weights or a bit width "
                                 "other than 2, 4 or 8 is not supported", ["MatMulNBits"])
    blocks = b.shape[1]
    q = _unpack(b.reshape(N, blocks, -1), bits).astype(np.float32)  # [N, blocks, block]
    s = scales.reshape(N, blocks, 1).astype(np.float32)
    if zero_points is None:
        zp = np.float32(1 << (bits - 1))
    elif zero_points.dtype == np.uint8:
        zp = _unpack(zero_points.reshape(N, -1), bits)[:, :blocks, None].astype(np.float32)
    else:
        zp = zero_points.reshape(N, blocks, 1).astype(np.float32)
    w = ((q - zp) * s).reshape(N, -1)[:, :K]
    y = np.matmul(a.astype(np.float32), w.T)
    if bias is not None:
        y += bias.astype(np.float32)
    return y.astype(a.dtype, copy=False)


# ---------------------------------------------------------------- transformer ops

def _infer_qattention(ctx):
    x, w, bias = ctx.shape(0), ctx.shape(1), ctx.tensor_type(2)
    dtype = _float(bias)
    if x is None or w is None or not isinstance(w[1], int):
        return [TensorType(dtype)]
    return [TensorType(dtype, tuple(x[:2]) + (w[1] // 3,))]


@op("QAttention", 1, domain=MS_DOMAIN, infer=_infer_qattention, differentiable=False,
    cost=cost.attention)
def qattention(x, weight, bias, input_scale, weight_scale, mask_index=None,
               input_zero_point=None, weight_zero_point=None, past=None, *, num_heads=None,
               scale=None, unidirectional=0, mask_filter_value=-10000.0,
               past_present_share_buffer=0, do_rotary=0):
    """Attention whose input and projection weights are quantized: the projection is an
    exact integer product rescaled to float, the rest is Attention's."""
    no_past("QAttention", past)
    acc = _int_matmul(x, input_zero_point, weight, weight_zero_point)
    qkv = _scaled(acc, input_scale.astype(np.float32) * weight_scale.astype(np.float32), bias)
    return attend(qkv, num_heads, qkv_sizes(weight.shape[1], None), mask_index,
                  scale=scale, unidirectional=unidirectional,
                  mask_filter_value=mask_filter_value).astype(bias.dtype, copy=False)


def _infer_qembed(ctx):
    ids, word = ctx.shape(0), ctx.shape(2)
    dtype = _float(ctx.tensor_type(8))
    shape = None if ids is None or word is None else tuple(ids) + (word[-1],)
    return [_tensor(dtype, shape), _tensor(DType.INT32, None if ids is None else ids[:1])]


@op("QEmbedLayerNormalization", 1, domain=MS_DOMAIN, infer=_infer_qembed,
    differentiable=False, cost=cost.per_element(8))
def qembed_layer_norm(input_ids, segment_ids, word_q, position_q, segment_q, gamma_q, beta_q,
                      mask, word_scale, position_scale, segment_scale, gamma_scale,
                      beta_scale, word_zp, position_zp, segment_zp, gamma_zp, beta_zp, *,
                      epsilon=1e-12):
    """EmbedLayerNormalization with quantized embedding tables, gamma and beta."""
    segment = None if segment_q is None else _deq(segment_q, segment_scale, segment_zp)
    s = embed(input_ids, segment_ids, _deq(word_q, word_scale, word_zp),
              _deq(position_q, position_scale, position_zp), segment)
    y = layer_norm(s, _deq(gamma_q, gamma_scale, gamma_zp), _deq(beta_q, beta_scale, beta_zp),
                   axis=-1, epsilon=epsilon)
    return y, mask_index(input_ids, mask)


# ---------------------------------------------------------------- LSTM

def _deq_weights(w, scale, zp) -> np.ndarray:
    """[dirs, rows, 4*hidden] quantized weights (scale and zero point per direction or per
    direction and column) as float32 in ONNX LSTM's [dirs, 4*hidden, rows] layout."""
    s = scale.astype(np.float32).reshape(w.shape[0], 1, -1)
    z = np.asarray(zp).astype(np.float32).reshape(w.shape[0], 1, -1)
    return ((w.astype(np.float32) - z) * s).transpose(0, 2, 1)


@op("DynamicQuantizeLSTM", 1, domain=MS_DOMAIN, differentiable=False)
def dynamic_quantize_lstm(ctx, x, w, r, b=None, sequence_lens=None, initial_h=None,
                          initial_c=None, p=None, w_scale=None, w_zero_point=None,
                          r_scale=None, r_zero_point=None, *, activation_alpha=None,
                          activation_beta=None, activations=None, clip=None,
                          direction="forward", hidden_size=None, input_forget=0):
    """LSTM with int8 weights stored [dirs, rows, 4*hidden]: the weights are dequantized
    and the float LSTM runs (onnxruntime also quantizes the activations on the fly, so
    results agree to within that rounding)."""
    return lstm(ctx, x, _deq_weights(w, w_scale, w_zero_point),
                _deq_weights(r, r_scale, r_zero_point), b, sequence_lens, initial_h,
                initial_c, p, activation_alpha=activation_alpha,
                activation_beta=activation_beta, activations=activations, clip=clip,
                direction=direction, hidden_size=hidden_size, input_forget=input_forget)
