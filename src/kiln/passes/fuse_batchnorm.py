"""Fold an inference-mode BatchNormalization into the Conv, ConvTranspose or Gemm before
it: ``BN(conv(x, W) + b) = conv(x, W * s) + (b - mean) * s + beta`` with
``s = scale / sqrt(var + eps)`` per output channel. The result is a plain Conv/Gemm with
new constant weights, so the BN costs nothing at run time.

Requires the weights and all four BN parameters to be constants, the BN to be the only
reader of the Conv's output, and no training-mode outputs in use. The per-channel factors
are computed in float64, then applied to the weights in their own dtype.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Node
from kiln.passes.base import RulePass, add_const, const_value
from kiln.passes.rewrite import Rewriter, Rule, ops, single_reader


class FuseBatchNorm(RulePass):
    """Fold BatchNormalization into the preceding Conv/ConvTranspose/Gemm."""

    name = "fuse_batchnorm"
    level = 1

    def rules(self) -> list[Rule]:
        return [Rule("batchnorm", ops("BatchNormalization"), _match, _apply, _check)]


def _match(rw: Rewriter, bn: Node):
    if len(bn.inputs) < 5 or bn.inputs[0] is None:
        return None
    base = single_reader(bn.inputs[0], bn, "Conv", "ConvTranspose", "Gemm")
    return None if base is None else (bn, base)


def _check(rw: Rewriter, m) -> str | None:
    bn, base = m
    if bn.attrs.get("training_mode", 0) or any(v is not None for v in bn.outputs[1:]):
        return "training mode (running statistics in use)"
    if any(const_value(v) is None for v in bn.inputs[1:5]):
        return "BatchNormalization parameters are not constant"
    return None


def _apply(rw: Rewriter, m) -> str | None:
    bn, base = m
    params = [const_value(v) for v in bn.inputs[1:5]]
    new = _fold(bn.graph, base, params, bn.attrs.get("epsilon", 1e-5))
    if new is None:
        return None
    new.outputs = [bn.outputs[0]]
    rw.replace([base, bn], [new])
    return f"BatchNormalization folded into {base.op_type}"


def _fold(g: Graph, base: Node, params, eps: float) -> Node | None:
    scale, beta, mean, var = (p.astype(np.float64).reshape(-1) for p in params)
    w = const_value(base.inputs[1]) if len(base.inputs) > 1 else None
    b_in = base.inputs[2] if len(base.inputs) > 2 else None
    b = const_value(b_in) if b_in is not None else None
    if w is None or (b_in is not None and b is None) or w.dtype.kind != "f":
        return None
    s = scale / np.sqrt(var + eps)
    c = s.size
    s_w = s.astype(w.dtype)
    if base.op_type == "Conv":
        if w.shape[0] != c:
            return None
        w_new = w * s_w.reshape((c,) + (1,) * (w.ndim - 1))
    elif base.op_type == "ConvTranspose":
        group = base.attrs.get("group", 1)
        if w.shape[1] * group != c:
            return None
        per = w.shape[1]
        wg = w.reshape((group, w.shape[0] // group, per) + w.shape[2:])
        wg = wg * s_w.reshape((group, 1, per) + (1,) * (w.ndim - 2))
        w_new = wg.reshape(w.shape)
    else:  # Gemm: output columns are the channels
        if w.ndim != 2:
            return None
        trans_b = base.attrs.get("transB", 0)
        n_out = w.shape[0] if trans_b else w.shape[1]
        if n_out != c:
            return None
        alpha = base.attrs.get("alpha", 1.0)
        sa = (s * alpha).astype(w.dtype)
        w_new = w * (sa.reshape(-1, 1) if trans_b else sa.reshape(1, -1))
        bias = np.zeros(c) if b is None else \
            np.broadcast_to(b.astype(np.float64) * base.attrs.get("beta", 1.0), _bshape(b, c))
        if bias.ndim == 2 and bias.shape[0] != 1:
            b_new = (bias - mean) * s + beta  # per-row bias stays [M, N]
        else:
            b_new = (bias.reshape(-1) - mean) * s + beta
        attrs = {k: v for k, v in base.attrs.items() if k not in ("alpha", "beta")}
        return _node(g, base, w_new, b_new, attrs)
    bias = np.zeros(c) if b is None else b.astype(np.float64).reshape(-1)
    b_new = (bias - mean) * s + beta
    return _node(g, base, w_new, b_new, dict(base.attrs))


def _bshape(b: np.ndarray, c: int) -> tuple:
    return b.shape if b.ndim == 2 else (c,)


def _node(g: Graph, base: Node, w: np.ndarray, b: np.ndarray, attrs) -> Node:
    dtype = base.inputs[1].const.dtype
    wv = add_const(g, f"{base.inputs[1].name}_bn", w.astype(dtype, copy=False))
    bv = add_const(g, f"{base.name or base.op_type}_bn_bias", b.astype(dtype))
    return Node(base.op_type, [base.inputs[0], wv, bv], [None], attrs, name=base.name)
