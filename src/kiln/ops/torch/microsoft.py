"""Torch kernels for onnxruntime's transformer ops (domain com.microsoft, defined in
kiln/ops/microsoft.py). Their reference kernels are NumPy-only (GELU needs erf, which the
array API lacks), so without these a torch session, on CUDA above all, would move every
hidden state to the host and back at each of them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops.microsoft import MS_DOMAIN, fused_matmul_perm, key_mask, no_past, qkv_sizes
from kiln.ops.torch import activation, kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    bound,
    decided,
    dtype_in,
    fact,
    known_dim,
    known_rank,
)

# onnxruntime's Gelu is ONNX's (20) with the default (erf) form: the same kernel
kernel("Gelu", 1, domain=MS_DOMAIN, dtypes=FLOATS)(activation.gelu)


@kernel("BiasGelu", 1, domain=MS_DOMAIN, dtypes=FLOATS)
def bias_gelu(a, b):
    return F.gelu(a + b)


@kernel("FastGelu", 1, domain=MS_DOMAIN, dtypes=FLOATS)
def fast_gelu(x, bias=None):
    return F.gelu(x if bias is None else x + bias, approximate="tanh")


def _layer_norm(s, gamma, beta, epsilon):
    # float16 inputs normalize in float32, as the NumPy kernel does
    w = s.float() if s.dtype in (torch.float16, torch.bfloat16) else s
    y = F.layer_norm(w, w.shape[-1:], gamma.to(w.dtype),
                     None if beta is None else beta.to(w.dtype), epsilon)
    return y.to(s.dtype)


@kernel("SkipLayerNormalization", 1, domain=MS_DOMAIN, dtypes=FLOATS)
def skip_layer_norm(ctx, x, skip, gamma, beta=None, bias=None, *, epsilon=1e-12):
    s = x + skip if bias is None else x + skip + bias
    y = _layer_norm(s, gamma, beta, epsilon)
    if ctx.num_outputs == 1:
        return y
    w = s.float()
    mean = w.mean(-1, keepdim=True)
    inv = torch.rsqrt(w.var(-1, unbiased=False, keepdim=True) + epsilon)
    return (y, mean, inv, s)[:ctx.num_outputs]


@kernel("EmbedLayerNormalization", 1, domain=MS_DOMAIN, prepare=True)
def embed_layer_norm(site):
    # float tables (input 2); other types take the reference kernel
    return decided(site, [dtype_in(site, 2, FLOATS)], bound(_embed_layer_norm, site),
                   lambda ids, segment_ids, word, *rest: word.dtype in FLOATS)


def _embed_layer_norm(ctx, input_ids, segment_ids, word, position, segment, gamma, beta,
                      mask=None, position_ids=None, *, epsilon=1e-12, mask_index_type=1):
    s = word[input_ids.long()]
    if position_ids is None:
        s = s + position[: input_ids.shape[1]].unsqueeze(0)
    else:
        s = s + position[position_ids.long()]
    if segment is not None and segment_ids is not None:
        s = s + segment[segment_ids.long()]
    y = _layer_norm(s, gamma, beta, epsilon)
    if mask is None:
        index = torch.zeros(input_ids.shape[0], dtype=torch.int32, device=input_ids.device)
    else:
        index = (mask != 0).sum(1).to(torch.int32)
    return (y, index, s)[:ctx.num_outputs]


def _attend(q, k, v, num_heads, mask, attention_bias, scale, unidirectional, filter_value):
    """Torch form of kiln.ops.microsoft.attend_heads."""
    b, s, total = q.shape[0], q.shape[1], k.shape[1]
    q, k, v = (t.reshape(t.shape[0], t.shape[1], num_heads, -1).transpose(1, 2)
               for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * (scale or 1 / math.sqrt(q.shape[-1]))
    if mask is not None:
        # the mask is a few integers per row: its additive form is built on the host
        add = key_mask(mask.cpu().numpy(), b, s, total, filter_value)
        scores = scores + torch.from_numpy(add).to(scores.device, scores.dtype)
    if attention_bias is not None:
        scores = scores + attention_bias
    if unidirectional:
        future = torch.ones(s, total, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, filter_value)
    out = torch.softmax(scores, -1) @ v
    return out.transpose(1, 2).reshape(b, s, -1)


# rotary embeddings are left to the reference kernel, which says they are unsupported
@kernel("Attention", 1, domain=MS_DOMAIN, dtypes=FLOATS,
        when=lambda site: not site.attr("do_rotary", 0))
def attention(x, weights, bias=None, mask_index=None, past=None, attention_bias=None,
              past_sequence_length=None, *, num_heads=None, qkv_hidden_sizes=None,
              scale=None, unidirectional=0, mask_filter_value=-10000.0,
              past_present_share_buffer=0, do_rotary=0, rotary_embedding_dim=0):
    no_past("Attention", past)
    qkv = x @ weights if bias is None else torch.addmm(
        bias, x.reshape(-1, x.shape[-1]), weights).reshape(x.shape[:-1] + (-1,))
    q, k, v = qkv.split(list(qkv_sizes(weights.shape[1], qkv_hidden_sizes)), dim=-1)
    return _attend(q, k, v, num_heads, mask_index, attention_bias, scale, unidirectional,
                   mask_filter_value)


@kernel("MultiHeadAttention", 1, domain=MS_DOMAIN, prepare=True)
def multi_head_attention(site):
    # Separate 3-D query, key and value of a float type, no past state and, one-way, as
    # many keys as queries; the reference kernel runs the rest (or says what it lacks).
    # What the plan knows is settled now; what it does not is checked each call.
    uni = bool(site.attr("unidirectional", 0))
    q_len, k_len = known_dim(site, 0, 1), known_dim(site, 1, 1)
    facts = [dtype_in(site, 0, FLOATS), site.has_input(1) and site.has_input(2),
             not site.has_input(6), fact(known_rank(site, 0), lambda r: r == 3),
             fact(known_rank(site, 1), lambda r: r == 3),
             True if not uni else None if None in (q_len, k_len) else q_len == k_len]

    def check(query, key=None, value=None, *rest):
        return query.dtype in FLOATS and query.dim() == 3 and key.dim() == 3 and \
            (not uni or query.shape[1] == key.shape[1])
    return decided(site, facts, bound(_multi_head_attention, site), check)


def _multi_head_attention(query, key=None, value=None, bias=None, key_padding_mask=None,
                          attention_bias=None, past_key=None, past_value=None,
                          past_sequence_length=None, cache_indirection=None, *,
                          num_heads=None, scale=None, unidirectional=0,
                          mask_filter_value=-10000.0):
    if bias is not None:
        query, key, value = (t + c for t, c in zip(
            (query, key, value), bias.split([query.shape[-1], key.shape[-1],
                                             value.shape[-1]])))
    return _attend(query, key, value, num_heads, key_padding_mask, attention_bias, scale,
                   unidirectional, mask_filter_value)


@kernel("FusedMatMul", 1, domain=MS_DOMAIN, dtypes=FLOATS)
def fused_matmul(a, b, *, alpha=1.0, transA=0, transB=0, transBatchA=0, transBatchB=0):
    pa = fused_matmul_perm(a.dim(), transA, transBatchA)
    pb = fused_matmul_perm(b.dim(), transB, transBatchB)
    y = (a if pa is None else a.permute(pa)) @ (b if pb is None else b.permute(pb))
    return y * alpha if alpha != 1 else y
