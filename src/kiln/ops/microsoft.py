"""onnxruntime's own operators (domain ``com.microsoft``) that its tools write into models:
the transformer optimizer's fusions (Attention, EmbedLayerNormalization,
SkipLayerNormalization, BiasGelu, FastGelu, Gelu) and the graph optimizations it saves at
the extended level (FusedConv, FusedGemm, FusedMatMul). Semantics follow onnxruntime's
ContribOperators documentation; the quantized ones are in :mod:`kiln.ops.microsoft_quant`.

FusedConv and FusedGemm mean what Kiln's own fused ops (:mod:`kiln.ops.fused`) mean, with
the same activations, so they run the same kernels.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.errors import UnsupportedOpError
from kiln.ir import TensorType
from kiln.ir.symbolic import broadcast
from kiln.ir.types import DType
from kiln.ops import cost
from kiln.ops._array import namespace
from kiln.ops.fused import (
    _in_float32,
    _infer_conv,
    _infer_gemm,
    apply_activation,
    fused_conv,
    fused_gemm,
    layer_norm,
)
from kiln.ops.registry import op

MS_DOMAIN = "com.microsoft"


def _same_as_first(x, *rest, **attrs):
    return x if isinstance(x, TensorType) else None


def _tensor(dtype: DType, shape) -> TensorType:
    return TensorType(dtype, None if shape is None else tuple(shape))


# ---------------------------------------------------------------- GELU family

@op("Gelu", 1, domain=MS_DOMAIN, infer=_same_as_first, cost=cost.elementwise)
@_in_float32
def gelu(x):
    """x * Phi(x), the exact (erf) GELU."""
    return apply_activation(np.array(x, copy=True), "Gelu")


def _infer_broadcast(a, b=None, **attrs):
    if not isinstance(a, TensorType):
        return None
    if not isinstance(b, TensorType) or a.shape is None or b.shape is None:
        return TensorType(a.dtype, a.shape)
    return _tensor(a.dtype, broadcast(a.shape, b.shape))


@op("BiasGelu", 1, domain=MS_DOMAIN, infer=_infer_broadcast, cost=cost.per_element(2))
@_in_float32
def bias_gelu(a, b):
    """GELU(A + B), the exact (erf) form."""
    return apply_activation(np.add(a, b), "Gelu")


@op("FastGelu", 1, domain=MS_DOMAIN, infer=_infer_broadcast, cost=cost.per_element(2))
@_in_float32
def fast_gelu(x, bias=None):
    """GELU(X + bias) with the tanh approximation."""
    y = np.array(x, copy=True) if bias is None else np.add(x, bias)
    return apply_activation(y, "GeluTanh")


# ---------------------------------------------------------------- layer normalization

def _norm_stats(s: np.ndarray, epsilon: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean and 1/sqrt(var + epsilon) over the last axis (float32 or wider), kept dims."""
    w = s.astype(np.promote_types(s.dtype, np.float32), copy=False)
    mean = w.mean(axis=-1, keepdims=True)
    var = np.square(w - mean).mean(axis=-1, keepdims=True)
    return mean, 1 / np.sqrt(var + np.float32(epsilon))


def _infer_skip_ln(ctx):
    x = ctx.tensor_type(0)
    if x is None:
        return None
    stat = None if x.shape is None else tuple(x.shape[:-1]) + (1,)
    return [x, _tensor(DType.FLOAT, stat), _tensor(DType.FLOAT, stat), x]


@op("SkipLayerNormalization", 1, domain=MS_DOMAIN, infer=_infer_skip_ln,
    cost=cost.per_element(7))
def skip_layer_norm(ctx, x, skip, gamma, beta=None, bias=None, *, epsilon=1e-12):
    """LayerNorm(input + skip + bias) over the last axis; optional outputs: the mean, the
    inverse standard deviation, and the sum that was normalized."""
    s = np.add(x, skip)
    if bias is not None:
        s += bias.astype(s.dtype)
    y = layer_norm(s, gamma, beta, axis=-1, epsilon=epsilon)
    if ctx.num_outputs == 1:
        return y
    mean, inv = _norm_stats(s, epsilon) if ctx.num_outputs > 1 else (None, None)
    return (y, mean.astype(np.float32), inv.astype(np.float32), s)[:ctx.num_outputs]


def _infer_embed_ln(ctx):
    ids, word = ctx.shape(0), ctx.tensor_type(2)
    if word is None:
        return None
    shape = None if ids is None or word.shape is None else tuple(ids) + (word.shape[-1],)
    out = _tensor(word.dtype, shape)
    return [out, _tensor(DType.INT32, None if ids is None else ids[:1]), out]


def embed(input_ids, segment_ids, word, position, segment, position_ids=None):
    """Word + position + segment embeddings of a [batch, seq] batch of token ids."""
    s = word[input_ids.astype(np.int64)]
    if position_ids is None:
        position_ids = np.arange(input_ids.shape[1])[None, :]
    s = s + position[position_ids.astype(np.int64)]
    if segment is not None and segment_ids is not None:
        s = s + segment[segment_ids.astype(np.int64)]
    return s


def mask_index(input_ids, mask):
    """The number of unmasked tokens per batch row (onnxruntime's 1-D mask index)."""
    if mask is None:
        return np.zeros(input_ids.shape[0], np.int32)
    return (mask != 0).sum(axis=1).astype(np.int32)


@op("EmbedLayerNormalization", 1, domain=MS_DOMAIN, infer=_infer_embed_ln,
    cost=cost.per_element(8))
def embed_layer_norm(ctx, input_ids, segment_ids, word, position, segment, gamma, beta,
                     mask=None, position_ids=None, *, epsilon=1e-12, mask_index_type=1):
    """LayerNorm of the summed word, position and segment embeddings; the mask index is
    the count of unmasked tokens per row; the third output is the sum before the norm."""
    s = embed(input_ids, segment_ids, word, position, segment, position_ids)
    y = layer_norm(s, gamma, beta, axis=-1, epsilon=epsilon)
    return (y, mask_index(input_ids, mask), s)[:ctx.num_outputs]


# ---------------------------------------------------------------- Attention

def _infer_attention(ctx):
    x, w = ctx.tensor_type(0), ctx.shape(1)
    if x is None:
        return None
    sizes = ctx.node.attrs.get("qkv_hidden_sizes")
    hv = sizes[2] if sizes else (w[1] // 3 if w is not None and isinstance(w[1], int) else None)
    shape = None if x.shape is None else tuple(x.shape[:2]) + (hv,)
    return [_tensor(x.dtype, shape)]


def key_mask(mask, batch: int, seq: int, total: int, filter_value: float) -> np.ndarray:
    """The additive score mask (batch, 1, seq, total) for an Attention ``mask_index`` in
    any of its forms: key lengths [B], lengths and starts [2B], or a raw 0/1 mask
    [B, T], [B, S, T] or [B, 1, max, max]."""
    mask = np.asarray(mask)
    j = np.arange(total)
    if mask.ndim == 1:
        end = mask[:batch].reshape(-1, 1)
        keep = j[None, :] < end
        if mask.shape[0] == 2 * batch:
            keep &= j[None, :] >= mask[batch:].reshape(-1, 1)
        keep = keep[:, None, None, :]
    elif mask.ndim == 2:
        keep = (mask != 0)[:, None, None, :]
    elif mask.ndim == 3:
        keep = (mask != 0)[:, None, :, :]
    elif mask.ndim == 4:
        keep = (mask[:, :, :seq, :total] != 0)
    else:
        raise UnsupportedOpError(f"Attention: a {mask.ndim}-D mask_index is not supported; "
                                 "onnxruntime documents 1-D to 4-D masks", ["Attention"])
    return np.where(keep, np.float32(0), np.float32(filter_value))


def attend(qkv: np.ndarray, num_heads: int, sizes, mask=None, attention_bias=None, *,
           scale: float | None = None, unidirectional: int = 0,
           mask_filter_value: float = -10000.0) -> np.ndarray:
    """Multi-head self-attention over a packed [batch, seq, q+k+v] projection, returning
    [batch, seq, v]: onnxruntime's Attention after its input projection."""
    hq, hk, hv = sizes
    q, k, v = qkv[..., :hq], qkv[..., hq:hq + hk], qkv[..., hq + hk:hq + hk + hv]
    return attend_heads(q, k, v, num_heads, mask, attention_bias, scale=scale,
                        unidirectional=unidirectional, mask_filter_value=mask_filter_value)


def attend_heads(q, k, v, num_heads: int, mask=None, attention_bias=None, *,
                 scale: float | None = None, unidirectional: int = 0,
                 mask_filter_value: float = -10000.0) -> np.ndarray:
    """Multi-head attention of queries [batch, seq, dq] over keys/values [batch, total, d]
    (heads side by side in the last axis), returning [batch, seq, dv]."""
    b, s, total = q.shape[0], q.shape[1], k.shape[1]

    def heads(t):
        return t.reshape(t.shape[0], t.shape[1], num_heads, -1).transpose(0, 2, 1, 3)

    q, k, v = heads(q), heads(k), heads(v)
    if scale is None or scale == 0:
        scale = 1 / math.sqrt(q.shape[-1])
    scores = np.matmul(q, k.transpose(0, 1, 3, 2)) * np.float32(scale)
    if mask is not None:
        scores += key_mask(mask, b, s, total, mask_filter_value)
    if attention_bias is not None:
        scores += attention_bias.astype(scores.dtype)
    if unidirectional:
        future = np.triu(np.ones((s, total), bool), 1)
        scores = np.where(future, np.float32(mask_filter_value), scores)
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    out = np.matmul(scores, v)
    return out.transpose(0, 2, 1, 3).reshape(b, s, -1)


def qkv_sizes(width: int, qkv_hidden_sizes) -> tuple[int, int, int]:
    """The Q, K and V widths of a packed projection ``width`` wide."""
    if qkv_hidden_sizes:
        return tuple(int(v) for v in qkv_hidden_sizes)
    return (width // 3,) * 3


def no_past(op_type: str, past) -> None:
    """Raise for the KV-cache inputs Kiln does not implement for onnxruntime's attention."""
    if past is not None:
        raise UnsupportedOpError(f"{op_type} with a past key/value input (KV cache) is not "
                                 "supported; export the model without past state",
                                 [op_type])


@op("Attention", 1, domain=MS_DOMAIN, infer=_infer_attention, cost=cost.attention)
@_in_float32
def ms_attention(x, weights, bias=None, mask_index=None, past=None, attention_bias=None,
                 past_sequence_length=None, *, num_heads=None, qkv_hidden_sizes=None,
                 scale=None, unidirectional=0, mask_filter_value=-10000.0,
                 past_present_share_buffer=0, do_rotary=0, rotary_embedding_dim=0):
    """Self-attention of ``x`` [batch, seq, hidden] with its own Q/K/V projection."""
    no_past("Attention", past)
    if do_rotary:
        raise UnsupportedOpError("Attention with do_rotary=1 is not supported",
                                 ["Attention"])
    qkv = np.matmul(x, weights)
    if bias is not None:
        qkv += bias
    return attend(qkv, num_heads, qkv_sizes(weights.shape[1], qkv_hidden_sizes), mask_index,
                  attention_bias, scale=scale, unidirectional=unidirectional,
                  mask_filter_value=mask_filter_value)


def _infer_mha(ctx):
    q, v = ctx.tensor_type(0), ctx.shape(2)
    if q is None:
        return None
    if q.shape is None or v is None or len(q.shape) != 3:
        return [TensorType(q.dtype)]
    return [_tensor(q.dtype, tuple(q.shape[:2]) + (v[-1],))]


@op("MultiHeadAttention", 1, domain=MS_DOMAIN, infer=_infer_mha, cost=cost.attention)
@_in_float32
def multi_head_attention(query, key=None, value=None, bias=None, key_padding_mask=None,
                         attention_bias=None, past_key=None, past_value=None,
                         past_sequence_length=None, cache_indirection=None, *,
                         num_heads=None, scale=None, unidirectional=0,
                         mask_filter_value=-10000.0):
    """Attention of projected queries [batch, seq, d] over projected keys and values
    [batch, total, d], each plus its part of ``bias``."""
    no_past("MultiHeadAttention", past_key)
    if key is None or value is None or query.ndim != 3 or key.ndim != 3:
        raise UnsupportedOpError("MultiHeadAttention: only separate 3-D query, key and value "
                                 "inputs are supported (not packed QKV or per-head keys)",
                                 ["MultiHeadAttention"])
    if unidirectional and query.shape[1] != key.shape[1]:
        raise UnsupportedOpError("MultiHeadAttention: unidirectional cross attention (query "
                                 "and key lengths differ) is not supported",
                                 ["MultiHeadAttention"])
    if bias is not None:
        dq, dk = query.shape[-1], key.shape[-1]
        query, key, value = query + bias[:dq], key + bias[dq:dq + dk], value + bias[dq + dk:]
    return attend_heads(query, key, value, num_heads, key_padding_mask, attention_bias,
                        scale=scale, unidirectional=unidirectional,
                        mask_filter_value=mask_filter_value)


# ---------------------------------------------------------------- small fusions

@op("QuickGelu", 1, domain=MS_DOMAIN, infer=_same_as_first, generic=True,
    cost=cost.per_element(4))
def quick_gelu(x, *, alpha=1.702):
    """x * sigmoid(alpha * x)."""
    xp = namespace(x)
    return x / (1 + xp.exp(-alpha * x))


def _rms(s: np.ndarray, epsilon: float, axes=(-1,)) -> np.ndarray:
    """1/sqrt(mean(s^2) + epsilon) over ``axes`` in float32 or wider, kept dims."""
    w = s.astype(np.promote_types(s.dtype, np.float32), copy=False)
    return 1 / np.sqrt(np.square(w).mean(axis=axes, keepdims=True) + np.float32(epsilon))


@op("SkipSimplifiedLayerNormalization", 1, domain=MS_DOMAIN, infer=_infer_skip_ln,
    cost=cost.per_element(5))
def skip_simplified_layer_norm(ctx, x, skip, gamma, bias=None, *, epsilon=1e-12):
    """RMS normalization of input + skip + bias over the last axis, times gamma; optional
    outputs: (unused) mean, inverse RMS, and the sum that was normalized."""
    s = np.add(x, skip)
    if bias is not None:
        s += bias.astype(s.dtype)
    inv = _rms(s, epsilon)
    y = (s * inv * gamma).astype(s.dtype, copy=False)
    return (y, None, inv.astype(np.float32), s)[:ctx.num_outputs]


@op("SimplifiedLayerNormalization", 1, infer=_same_as_first, cost=cost.per_element(4))
def simplified_layer_norm(ctx, x, scale, *, axis=-1, epsilon=1e-5, stash_type=1):
    """RMS normalization from ``axis`` on, times scale (onnxruntime registers it in the
    ONNX domain; ONNX itself has no op of this name)."""
    ax = axis + x.ndim if axis < 0 else axis
    inv = _rms(x, epsilon, tuple(range(ax, x.ndim)))
    y = (x * inv * scale).astype(x.dtype, copy=False)
    return (y, inv.astype(np.float32))[:ctx.num_outputs]


# ---------------------------------------------------------------- fused Conv / Gemm / MatMul

op("FusedConv", 1, domain=MS_DOMAIN, infer=_infer_conv, prepare=True,
   cost=cost.conv())(fused_conv)


@op("FusedGemm", 1, domain=MS_DOMAIN, infer=_infer_gemm, cost=cost.gemm)
def ms_fused_gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, activation="",
                  activation_alpha=None, activation_beta=None, activation_gamma=None):
    """activation(alpha * A' @ B' + beta * C); the activation's scalars come as
    activation_alpha/beta/gamma (LeakyRelu's alpha, HardSigmoid's alpha and beta)."""
    params = [p for p in (activation_alpha, activation_beta, activation_gamma) if p is not None]
    return fused_gemm(a, b, c, alpha=alpha, beta=beta, transA=transA, transB=transB,
                      activation=activation, activation_params=params)


def fused_matmul_perm(rank: int, trans: int, trans_batch: int) -> list[int] | None:
    """The axis order giving a FusedMatMul operand its [..., rows, cols] view.
    transBatch moves the first axis behind the batch axes; trans swaps the last two."""
    perm = list(range(rank))
    if trans_batch and rank > 2:
        perm = perm[1:-1] + [0, rank - 1]
    if trans:
        perm[-2], perm[-1] = perm[-1], perm[-2]
    return None if perm == list(range(rank)) else perm


def _infer_fused_matmul(ctx):
    a, b = ctx.tensor_type(0), ctx.tensor_type(1)
    if a is None:
        return None
    if a.shape is None or b is None or b.shape is None or min(len(a.shape), len(b.shape)) < 2:
        return [TensorType(a.dtype)]
    at = ctx.node.attrs
    sa, sb = list(a.shape), list(b.shape)
    for s, t, tb in ((sa, "transA", "transBatchA"), (sb, "transB", "transBatchB")):
        perm = fused_matmul_perm(len(s), at.get(t, 0), at.get(tb, 0))
        if perm:
            s[:] = [s[i] for i in perm]
    batch = broadcast(tuple(sa[:-2]), tuple(sb[:-2]))
    return [_tensor(a.dtype, tuple(batch) + (sa[-2], sb[-1]))]


@op("FusedMatMul", 1, domain=MS_DOMAIN, infer=_infer_fused_matmul, cost=cost.matmul)
@_in_float32
def ms_fused_matmul(a, b, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    """alpha * A' @ B', each operand transposed as its trans/transBatch flags say."""
    pa = fused_matmul_perm(a.ndim, transA, transBatchA)
    pb = fused_matmul_perm(b.ndim, transB, transBatchB)
    y = np.matmul(a if pa is None else a.transpose(pa), b if pb is None else b.transpose(pb))
    if alpha != 1:
        y *= y.dtype.type(alpha)
    return y
