"""Fuse onnxruntime's integer-op quantized format (what ``quantize_dynamic`` writes) into
Kiln's fused layers with a float output:

    MatMulInteger(x, w, x_zp[, w_zp]) -> Cast(float) -> Mul(x_scale * w_scale) [+ b]
        [-> Relu/Clip]  ->  ai.kiln.QMatMul
    ConvInteger(x, w, x_zp[, w_zp])   -> Cast(float) -> Mul(x_scale * w_scale) [+ b]
        [-> Relu/Clip]  ->  ai.kiln.QConv

``x`` comes from DynamicQuantizeLinear (one scale and zero point, computed at run time),
``w`` is a constant int8/uint8 weight with one scale (and zero point) or one per output
channel. The QDQ format (``DequantizeLinear``/``QuantizeLinear`` around float ops) is
``fuse_quant``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kiln.ir import DType, Node
from kiln.ops.conv import CONV_ATTRS
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import RulePass, const_value, dtype_of, rank_of
from kiln.passes.fuse_quant import (
    _EIGHT_BIT,
    _activation,
    _bias_add,
    _per_channel,
    _scalar_param,
    _sole_reader,
)
from kiln.passes.rewrite import Rewriter, Rule, ops, producer


class FuseIntegerOps(RulePass):
    """MatMulInteger/ConvInteger -> Cast -> Mul(scales) [-> Add] [-> act]  ->  a
    float-output QMatMul/QConv."""

    name = "fuse_integer_ops"
    level = 2
    stage = 2
    creates = ("QMatMul", "QConv")

    def rules(self) -> list[Rule]:
        return [Rule("integer_layer", ops("MatMulInteger", "ConvInteger"), _match_int,
                     _apply_int, _check_int)]


@dataclass
class _IntLayer:
    root: Node
    x: list  # [q, scale, zero point]
    w_scale: np.ndarray
    w_zp: np.ndarray | None
    bias: np.ndarray | None = None
    activation: tuple[str, list[float]] | None = None
    taken: list[Node] = field(default_factory=list)


def _match_int(rw: Rewriter, n: Node) -> _IntLayer | None:
    """The integer layer, its Cast and its Mul by ``x_scale * w_scale``, as onnxruntime's
    quantize_dynamic writes every product and convolution; then a bias Add and an
    activation, when present."""
    conv = n.op_type == "ConvInteger"
    ins = list(n.inputs) + [None] * (4 - len(n.inputs))
    x, wv, xz, wzv = ins[:4]
    w = const_value(wv)
    if w is None or w.dtype not in (np.int8, np.uint8) or (w.ndim < 3 if conv else
                                                            w.ndim != 2):
        return None
    k = w.shape[0] if conv else w.shape[1]  # output channels
    wz = const_value(wzv) if wzv is not None else None
    if x is None or not _scalar_param(xz) or (wzv is not None and
                                              (wz is None or wz.size not in (1, k))):
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
    if ws is None or ws.dtype != np.float32 or ws.size not in (1, k) or not _scalar_param(a):
        return None
    layer = _IntLayer(n, [x, a, xz], _per_channel(ws),
                      None if wz is None else _per_channel(wz), taken=[cast, mul])
    out = mul.outputs[0]
    found = _bias_add(out, k, n.graph, 1 - w.ndim if conv else -1)
    if found is not None:
        add, layer.bias = found
        layer.taken.append(add)
        out = add.outputs[0]
    m = _sole_reader(out, n.graph)
    if m is not None and (act := _activation(m, rw)) is not None:
        layer.activation = act
        layer.taken.append(m)
    return layer


def _check_int(rw: Rewriter, m: _IntLayer) -> str | None:
    r = rank_of(m.x[0])
    if dtype_of(m.x[0]) not in _EIGHT_BIT or r is None or r < 2:
        return "x is not an 8-bit tensor of known rank"
    return None


def _apply_int(rw: Rewriter, m: _IntLayer) -> str:
    n, g = m.root, m.root.graph
    base = n.name or n.outputs[0].name
    wz = None if m.w_zp is None else rw.add_const(g, f"{base}_qweight_zero_point", m.w_zp)
    inputs = list(m.x) + [n.inputs[1], rw.add_const(g, f"{base}_qweight_scale", m.w_scale),
                          wz]
    if m.bias is not None:
        inputs.append(rw.add_const(g, f"{base}_qbias", m.bias))
    while inputs[-1] is None:
        inputs.pop()
    attrs = {"integer_sum": 1}  # float32(acc) * float32(x_scale * w_scale), as written
    if n.op_type == "ConvInteger":
        attrs.update((k, v) for k, v in n.attrs.items() if k in CONV_ATTRS)
    if m.activation is not None:
        attrs["activation"] = m.activation[0]
        if m.activation[1]:
            attrs["activation_params"] = list(m.activation[1])
    last = m.taken[-1]
    op_type = "QConv" if n.op_type == "ConvInteger" else "QMatMul"
    fused = Node(op_type, inputs, [None], attrs, domain=KILN_DOMAIN, name=n.name or last.name)
    fused.outputs = [last.outputs[0]]
    rw.replace([n] + m.taken, [fused])
    chain = " -> ".join(t.op_type for t in m.taken)
    return f"{n.op_type} -> {chain} -> {op_type}"
