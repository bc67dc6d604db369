"""Fuse onnxruntime's integer-op quantized format (what ``quantize_dynamic`` writes) into
Kiln's fused layers:

    MatMulInteger(x, w, x_zp[, w_zp = 0]) -> Cast(float) -> Mul(x_scale * w_scale) [+ b]
        -> ai.kiln.QMatMul with a float output

``x`` comes from DynamicQuantizeLinear (one scale and zero point, computed at run time),
``w`` is a constant int8/uint8 matrix with one scale or one per column. The QDQ format
(``DequantizeLinear``/``QuantizeLinear`` around float ops) is ``fuse_quant``'s; ConvInteger
is not fused yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.ir import DType, Node
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import RulePass, const_value, dtype_of, rank_of
from kiln.passes.fuse_quant import _EIGHT_BIT, _bias_add, _scalar_param, _sole_reader
from kiln.passes.rewrite import Rewriter, Rule, ops, producer


class FuseIntegerOps(RulePass):
    """MatMulInteger -> Cast -> Mul(scales) [-> Add]  ->  a float-output QMatMul."""

    name = "fuse_integer_ops"
    level = 2
    stage = 2
    creates = ("QMatMul",)

    def rules(self) -> list[Rule]:
        return [Rule("integer_matmul", ops("MatMulInteger"), _match_int, _apply_int,
                     _check_int)]


@dataclass
class _IntMatMul:
    root: Node
    x: list  # [q, scale, zero point]
    w: np.ndarray
    w_scale: np.ndarray
    bias: np.ndarray | None
    taken: list[Node]


def _match_int(rw: Rewriter, n: Node) -> _IntMatMul | None:
    """MatMulInteger(x, w, x_zp[, w_zp = 0]) -> Cast(float) -> Mul(x_scale * w_scale)
    [-> Add(b)], as onnxruntime's quantize_dynamic writes every product."""
    ins = list(n.inputs) + [None] * (4 - len(n.inputs))
    x, wv, xz, wz = ins[:4]
    w = const_value(wv)
    if w is None or w.ndim != 2 or w.dtype not in (np.int8, np.uint8) or \
            not _scalar_param(xz) or x is None:
        return None
    if wz is not None and (const_value(wz) is None or np.any(const_value(wz))):
        return None
    cast = _sole_reader(n.outputs[0], n.graph)
    if cast is None or cast.op_type != "Cast" or cast.attrs.get("to") != DType.FLOAT.value:
        return None
    mul = _sole_reader(cast.outputs[0], n.graph)
    if mul is None or mul.op_type != "Mul":
        return None
    scales = producer(mul.inputs[1] if mul.inputs[0] is cast.outputs[0] else mul.inputs[0],
                      mul, "Mul")
    if scales is None:
        return None
    a, b = scales.inputs
    if const_value(a) is not None:
        a, b = b, a
    ws = const_value(b)
    k = w.shape[1]
    if ws is None or ws.dtype != np.float32 or ws.size not in (1, k) or not _scalar_param(a):
        return None
    layer = _IntMatMul(n, [x, a, xz], w, ws.reshape(-1) if ws.size > 1 else ws.reshape(()),
                       None, [cast, mul])
    found = _bias_add(mul.outputs[0], k, n.graph)
    if found is not None:
        add, layer.bias = found
        layer.taken.append(add)
    return layer


def _check_int(rw: Rewriter, m: _IntMatMul) -> str | None:
    r = rank_of(m.x[0])
    if dtype_of(m.x[0]) not in _EIGHT_BIT or r is None or r < 2:
        return "x is not an 8-bit matrix of known rank"
    return None


def _apply_int(rw: Rewriter, m: _IntMatMul) -> str:
    n, g = m.root, m.root.graph
    base = n.name or n.outputs[0].name
    inputs = list(m.x) + [n.inputs[1], rw.add_const(g, f"{base}_qweight_scale", m.w_scale),
                          None]
    if m.bias is not None:
        inputs.append(rw.add_const(g, f"{base}_qbias", m.bias))
    while inputs[-1] is None:
        inputs.pop()
    last = m.taken[-1]
    fused = Node("QMatMul", inputs, [None], {}, domain=KILN_DOMAIN, name=n.name or last.name)
    fused.outputs = [last.outputs[0]]
    rw.replace([n] + m.taken, [fused])
    chain = " -> ".join(t.op_type for t in m.taken)
    return f"MatMulInteger -> {chain} -> QMatMul"
