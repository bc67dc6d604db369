"""Attention ops: Attention (opsets 23-25: causal/windowed/boolean/float masks, GQA, KV
cache, softcap, qk_matmul_output modes), FlexAttention (ai.onnx.preview), LinearAttention,
RotaryEmbedding."""

from __future__ import annotations

import math

import numpy as np
from onnx import helper

from kiln.ops import cost
from kiln.ops.conv import work_dtype
from kiln.ops.registry import op


def _split_heads(x, heads):
    """(B, S, H*D) -> (B, H, S, D)."""
    b, s, hd = x.shape
    return x.reshape(b, s, heads, hd // heads).transpose(0, 2, 1, 3)


def _repeat_kv(x, q_heads):
    """Share each K/V head with its contiguous group of query heads."""
    return x if x.shape[1] == q_heads else np.repeat(x, q_heads // x.shape[1], axis=1)


def _softmax_rows(s):
    """Softmax over the last axis; rows with no finite score become all zero."""
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.exp(s - m)
    total = e.sum(axis=-1, keepdims=True)
    return e / np.where(total == 0, 1, total)


def _precision(code, default):
    return np.dtype(helper.tensor_dtype_to_np_dtype(code)) if code else default


def _allowed(b, hq, sq, total, offset, is_causal, left, right, nonpad):
    """Keys each query may attend, (B or 1, 1, Sq, T) bool, or None if all."""
    if not is_causal and left < 0 and right < 0 and nonpad is None:
        return None
    j = np.arange(total)[None, None, None, :]
    pos = np.arange(sq)[None, None, :, None] + np.asarray(offset).reshape(-1, 1, 1, 1)
    ok = np.ones((np.size(offset), 1, sq, total), dtype=bool)
    if is_causal:
        ok &= j <= pos
    if left >= 0:
        ok &= j >= pos - left
    if right >= 0:
        ok &= j <= pos + right
    if nonpad is not None:
        ok &= j < np.asarray(nonpad).reshape(-1, 1, 1, 1)
    return ok


@op("Attention", 23, cost=cost.attention)
def attention(ctx, q, k, v, attn_mask=None, past_key=None, past_value=None,
              nonpad_kv_seqlen=None, *, is_causal=0, kv_num_heads=None,
              left_window_size=-1, q_num_heads=None, qk_matmul_output_mode=0,
              right_window_size=-1, scale=None, softcap=0.0, softmax_precision=None):
    dtype = q.dtype
    three_d = q.ndim == 3
    if three_d:
        q = _split_heads(q, q_num_heads)
        k = _split_heads(k, kv_num_heads)
        v = _split_heads(v, kv_num_heads)
    past_len = 0
    if past_key is not None:
        past_len = past_key.shape[2]
        k = np.concatenate([past_key, k], axis=2)
        v = np.concatenate([past_value, v], axis=2)
    present_k, present_v = k, v
    b, hq, sq, d = q.shape
    total = k.shape[2]
    wd = work_dtype(dtype)
    if scale is None:
        scale = 1 / math.sqrt(d)
    root = wd.type(math.sqrt(scale))
    kk = _repeat_kv(k.astype(wd), hq)
    vv = _repeat_kv(v.astype(wd), hq)
    s = np.matmul(q.astype(wd) * root, np.swapaxes(kk * root, -1, -2))
    outputs = {0: s}
    if softcap:
        s = wd.type(softcap) * np.tanh(s / wd.type(softcap))
    outputs[1] = s
    if nonpad_kv_seqlen is not None and past_key is None:
        offset = np.asarray(nonpad_kv_seqlen).astype(np.int64) - sq
    else:
        offset = np.array([past_len])
    ok = _allowed(b, hq, sq, total, offset, is_causal, left_window_size, right_window_size,
                  nonpad_kv_seqlen)
    if attn_mask is not None:
        m = attn_mask
        if m.shape[-1] < total:  # a short mask: the missing keys are masked out
            pad = [(0, 0)] * (m.ndim - 1) + [(0, total - m.shape[-1])]
            m = np.pad(m, pad, constant_values=False if m.dtype == bool else -np.inf)
        if m.dtype == bool:
            ok = m if ok is None else ok & m
        else:
            s = s + m.astype(wd)
    if ok is not None:
        s = np.where(ok, s, -np.inf).astype(wd, copy=False)
    outputs[2] = s
    sp = _precision(softmax_precision, wd)
    if sp.kind != "f" or sp.itemsize < 4:  # NumPy's half types compute poorly
        sp = wd
    p = _softmax_rows(s.astype(sp)).astype(wd)
    outputs[3] = p
    y = np.matmul(p, vv)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(b, sq, -1)
    results = [y.astype(dtype), present_k, present_v,
               np.ascontiguousarray(outputs[qk_matmul_output_mode]).astype(dtype)]
    return tuple(results[:ctx.num_outputs]) if ctx.num_outputs > 1 else results[0]


@op("FlexAttention", 1, domain="ai.onnx.preview")
def flex_attention(ctx, q, k, v, *, prob_mod=None, scale=None, score_mod=None,
                   softmax_precision=None):
    """Attention with optional score and probability modifier subgraphs."""
    dtype = q.dtype
    sp = _precision(softmax_precision,
                    np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32))
    if scale is None:
        scale = 1 / math.sqrt(q.shape[-1])
    hq = q.shape[1]
    kk = _repeat_kv(k.astype(sp), hq)
    vv = _repeat_kv(v.astype(sp), hq)
    s = np.matmul(q.astype(sp), np.swapaxes(kk, -1, -2)) * sp.type(scale)
    if score_mod is not None:
        s = np.asarray(ctx.run(score_mod, [s])[0])
    p = _softmax_rows(s)
    if prob_mod is not None:
        p = np.asarray(ctx.run(prob_mod, [p])[0])
    return np.matmul(p.astype(sp), vv).astype(dtype)


@op("LinearAttention", 27)
def linear_attention(ctx, query, key, value, past_state=None, decay=None, beta=None, *,
                     chunk_size=64, kv_num_heads=None, q_num_heads=None, scale=0.0,
                     update_rule="gated_delta"):
    """Recurrent linear attention, one vectorized state update per time step."""
    if isinstance(update_rule, bytes):
        update_rule = update_rule.decode()
    dtype = query.dtype
    wd = work_dtype(dtype)
    b, t_len, _ = query.shape
    hk = kv_num_heads
    q = query.astype(wd).reshape(b, t_len, q_num_heads, -1)
    k = key.astype(wd).reshape(b, t_len, hk, -1)
    vals = value.astype(wd).reshape(b, t_len, hk, -1)
    dk, dv = q.shape[-1], vals.shape[-1]
    if not scale:
        scale = 1 / math.sqrt(dk)
    state = np.zeros((b, hk, dk, dv), wd) if past_state is None else \
        past_state.astype(wd, copy=True)
    gates = None if decay is None else np.exp(decay.astype(wd).reshape(b, t_len, hk, -1))
    rates = None if beta is None else beta.astype(wd).reshape(b, t_len, -1)
    group = q_num_heads // hk
    out = np.empty((b, t_len, q_num_heads, dv), wd)
    for t in range(t_len):
        kt, vt = k[:, t], vals[:, t]
        if update_rule in ("gated", "gated_delta"):
            state = state * gates[:, t][..., None]  # (B, H, dk or 1, 1)
        if update_rule in ("delta", "gated_delta"):
            bt = np.broadcast_to(rates[:, t], (b, hk))[..., None]
            vt = bt * (vt - np.einsum("bhkv,bhk->bhv", state, kt))
        state = state + kt[..., :, None] * vt[..., None, :]
        qt = q[:, t].reshape(b, hk, group, dk)
        out[:, t] = np.einsum("bhgk,bhkv->bhgv", qt, state).reshape(b, q_num_heads, dv)
    out *= wd.type(scale)
    y = out.reshape(b, t_len, -1).astype(dtype)
    present = state.astype(dtype if past_state is None else past_state.dtype)
    return (y, present) if ctx.num_outputs > 1 else y


@op("RotaryEmbedding", 23)
def rotary_embedding(x, cos_cache, sin_cache, position_ids=None, *, interleaved=0,
                     num_heads=0, rotary_embedding_dim=0):
    """Rotate pairs of each head's leading ``rotary_embedding_dim`` features by the
    per-position angles in the caches (split halves, or even/odd pairs if interleaved)."""
    shape = x.shape
    if x.ndim == 4:  # (B, H, S, D) -> (B, S, H, D)
        xs = x.transpose(0, 2, 1, 3)
    else:
        xs = x.reshape(shape[0], shape[1], num_heads, -1)
    dim = rotary_embedding_dim or xs.shape[-1]
    if position_ids is not None:
        cos_cache, sin_cache = cos_cache[position_ids], sin_cache[position_ids]
    cos = cos_cache[:, :, None, :]
    sin = sin_cache[:, :, None, :]
    rot = xs[..., :dim]
    x1, x2 = (rot[..., 0::2], rot[..., 1::2]) if interleaved else np.split(rot, 2, axis=-1)
    real = cos * x1 - sin * x2
    imag = sin * x1 + cos * x2
    y = np.array(xs, copy=True)
    if interleaved:
        y[..., 0:dim:2] = real
        y[..., 1:dim:2] = imag
    else:
        y[..., :dim // 2] = real
        y[..., dim // 2:dim] = imag
    if x.ndim == 4:
        return np.ascontiguousarray(y.transpose(0, 2, 1, 3))
    return y.reshape(shape)
