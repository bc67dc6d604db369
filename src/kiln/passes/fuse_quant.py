"""Fuse quantized layers written in the QDQ format into Kiln's integer ops:

    DQ(x), DQ(w) [, DQ(b) or b] -> Conv            [-> act] [-> Q]  -> ai.kiln.QConv
    DQ(x), DQ(w) [, DQ(b) or b] -> Gemm            [-> act] [-> Q]  -> ai.kiln.QMatMul
    DQ(x), DQ(w)                -> MatMul [+ Add(b)] [-> act] [-> Q]  -> ai.kiln.QMatMul
    DQ(a), DQ(b)                -> Add               [-> Relu] -> Q   -> ai.kiln.QAdd
    DQ(x) -> Reshape/Transpose/Squeeze/Unsqueeze/Flatten/MaxPool -> op(x) -> DQ
    DQ(x) -> Q on the DQ's grid                                         -> x
    Q(x) -> DQ on the Q's grid, nothing else reading the Q   -> ai.kiln.QuantizeDequantize

The last two are exact (data movement never computes with an element, a maximum commutes
with an increasing map, and Q(DQ(v)) = v on one grid) and onnxruntime makes the same
rewrites: together they run a pool or an attention layer's head split on the 8-bit
tensor and drop the Q/DQ pair around it. The residual Add is what remains between the
integer layers of a ResNet. The round trip ``Q -> DQ`` (a QDQ file's requantizations inside
attention, where the products of two activations stay float) becomes one float op that
rounds onto the grid; its rule (``RoundTrips``) runs one engine stage later, after every
quantized layer has taken the Q that ends it.

``act`` is Relu or Clip with constant bounds directly on the layer's output (onnxruntime's
``quantize_static`` often drops it into the Q's range instead; ``kiln.quantize`` writes
it like this). A Relu behind a Q/DQ pair of its own (``Q -> DQ -> Relu -> Q``: two grids,
two roundings) is left as it is: fusing it would round once and drift from what the file
computes by more than a step. Without a final Q the fused layer outputs float (logits;
``DynamicQuantizeLinear -> DQ -> layer`` from dynamic quantization).

``x`` must be 8-bit with one scale and zero point, ``w`` a constant int8 weight with one
scale or one per output channel. The DequantizeLinear nodes stay for their other readers
and go with dead-code elimination otherwise. Kernels: ``kiln/ops/quant_fused.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kiln.ir import DType, Node, Value
from kiln.ops.conv import CONV_ATTRS
from kiln.ops.quant import dequantize_linear
from kiln.ops.quant_fused import ACTIVATIONS
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import RulePass, const_value, dtype_of, fresh_value, rank_of
from kiln.passes.fuse_activation import single_activation
from kiln.passes.rewrite import Rewriter, Rule, ops, producer

_EIGHT_BIT = (DType.UINT8, DType.INT8)


class FuseQuant(RulePass):
    """DQ -> Conv/MatMul/Gemm [-> Relu/Clip] -> Q  ->  one integer QConv/QMatMul; the
    residual DQ, DQ -> Add [-> Relu] -> Q  ->  QAdd; data movement and max-pools on the
    8-bit tensor, and Q(DQ(x)) on one grid -> x."""

    name = "fuse_quant"
    level = 2
    stage = 2
    creates = ("QConv", "QMatMul", "QAdd")

    def rules(self) -> list[Rule]:
        return [Rule("qdq_layer", ops("Conv", "MatMul", "Gemm"), _match, _apply, _check),
                Rule("qdq_add", ops("Add"), _match_add, _apply_add, _check_add),
                Rule("dq_sink", ops(*_MOVES), _match_sink, _apply_sink, _check_sink),
                Rule("qdq_identity", ops("QuantizeLinear"), _match_identity,
                     _apply_identity)]


@dataclass
class _Layer:
    """What one match gathered: the layer, its quantized operands and its output chain."""

    root: Node
    x: list  # [q, scale, zero point]
    w: np.ndarray
    w_scale: np.ndarray
    w_zp: np.ndarray | None
    bias: np.ndarray | None = None
    activation: str = ""
    params: list[float] = field(default_factory=list)
    taken: list[Node] = field(default_factory=list)
    out_q: Node | None = None


def _sole_reader(v: Value, g) -> Node | None:
    """The one standard-op node of ``g`` reading ``v`` once, when nothing returns ``v``."""
    if v.is_returned or v.num_reads != 1:
        return None
    r = next(v.readers())
    return r if r.graph is g and r.domain == "" else None


def _scalar_param(v: Value | None) -> bool:
    """A per-tensor scale or zero point: a constant of one element, or a computed scalar
    (DynamicQuantizeLinear's)."""
    if v is None:
        return True
    c = const_value(v)
    if c is not None:
        return c.size == 1
    return rank_of(v) == 0


def _dq_parts(dq: Node) -> list | None:
    """[q, scale, zero point] of a DequantizeLinear with no block size."""
    if dq.attrs.get("block_size", 0):
        return None
    ins = list(dq.inputs) + [None] * (3 - len(dq.inputs))
    return ins[:3]


def _activation(m: Node, rw: Rewriter) -> tuple[str, list[float]] | None:
    """Relu, or Clip with constant bounds: the activations a quantized layer applies."""
    act = single_activation(m, rw.opset(m))
    if act is None or act[0] not in ACTIVATIONS:
        return None
    return act[0], [float(p) for p in act[1]]


def _match(rw: Rewriter, n: Node) -> _Layer | None:
    if len(n.outputs) != 1 or n.outputs[0] is None or len(n.inputs) < 2:
        return None
    xdq = producer(n.inputs[0], n, "DequantizeLinear")
    wdq = producer(n.inputs[1], n, "DequantizeLinear")
    if xdq is None or wdq is None:
        return None
    x, w = _dq_parts(xdq), _dq_parts(wdq)
    if x is None or w is None or dtype_of(x[0]) not in _EIGHT_BIT:
        return None
    if not _scalar_param(x[1]) or not _scalar_param(x[2]) or x[1] is None:
        return None
    wq, ws = const_value(w[0]), const_value(w[1])
    wz = const_value(w[2]) if w[2] is not None else None
    if wq is None or ws is None or wq.dtype not in (np.int8, np.uint8) or \
            (w[2] is not None and wz is None):
        return None
    layer = _Layer(n, x, wq, ws, wz)
    if not _weight_layout(layer, wdq):
        return None
    if not _bias(layer, rw):
        return None
    _output_chain(layer, rw)
    return layer


def _weight_layout(layer: _Layer, wdq: Node) -> bool:
    """Put the weight in the fused op's layout (QConv: OIHW; QMatMul: [K, N]) and check
    that its scale is per tensor or per output channel."""
    n, w, ws = layer.root, layer.w, layer.w_scale
    axis = wdq.attrs.get("axis", 1)
    axis = axis + w.ndim if axis < 0 else axis
    if n.op_type == "Conv":
        if w.ndim < 3:
            return False
        out_axis = 0
    elif n.op_type == "MatMul":
        if w.ndim != 2:
            return False
        out_axis = 1
    else:
        a = n.attrs
        if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or w.ndim != 2:
            return False
        out_axis = 0 if a.get("transB", 0) else 1
    if ws.size > 1 and (axis != out_axis or ws.size != w.shape[out_axis]):
        return False
    zp = layer.w_zp
    if zp is not None and zp.size > 1 and zp.size != ws.size:
        return False
    layer.w_scale = _per_channel(ws)
    if zp is not None:
        layer.w_zp = _per_channel(zp)
    if n.op_type == "Gemm" and out_axis == 0:
        layer.w = np.ascontiguousarray(w.T)
    return True


def _per_channel(c: np.ndarray) -> np.ndarray:
    """A weight's scale or zero point as the fused ops take it: a vector over the output
    channels, or a scalar."""
    return c.reshape(-1) if c.size > 1 else c.reshape(())


def _channels(layer: _Layer) -> int:
    return layer.w.shape[0] if layer.root.op_type == "Conv" else layer.w.shape[1]


def _bias(layer: _Layer, rw: Rewriter) -> bool:
    """The layer's own bias (Conv/Gemm input 2), a constant or DQ of one, as a float
    vector over the output channels."""
    n = layer.root
    if n.op_type == "MatMul" or len(n.inputs) < 3 or n.inputs[2] is None:
        return True
    b = n.inputs[2]
    c = const_value(b)
    if c is None:
        dq = producer(b, n, "DequantizeLinear")
        parts = _dq_parts(dq) if dq is not None else None
        if parts is None:
            return False
        vals = [const_value(v) if v is not None else None for v in parts]
        if vals[0] is None or vals[1] is None or (parts[2] is not None and vals[2] is None):
            return False
        c = dequantize_linear(vals[0], vals[1], vals[2], axis=dq.attrs.get("axis", 1))
    if n.op_type == "Gemm" and n.attrs.get("beta", 1.0) != 1.0:
        c = c * np.float32(n.attrs["beta"])
    k = _channels(layer)
    if c.dtype != np.float32 or c.size not in (1, k) or \
            (c.ndim > 1 and sum(d != 1 for d in c.shape) > 1):
        return False
    layer.bias = np.broadcast_to(c.reshape(-1), (k,)).copy()
    return True


def _bias_add(out: Value, k: int, g, axis: int = -1) -> tuple[Node, np.ndarray] | None:
    """The Add of ``g`` that alone reads ``out`` and adds a constant float32 bias of ``k``
    values along ``axis`` (counted from the end: -1 for a product's columns, 1 - rank for
    a convolution's channels), and that bias (a layer's bias, written as an Add)."""
    m = _sole_reader(out, g)
    if m is None or m.op_type != "Add" or "axis" in m.attrs:
        return None
    c = const_value(m.inputs[1] if m.inputs[0] is out else m.inputs[0])
    if c is None or c.dtype != np.float32 or c.size != k or c.ndim < -axis or \
            c.shape[axis] != k:
        return None
    return m, c.reshape(-1).copy()


def _output_chain(layer: _Layer, rw: Rewriter) -> None:
    """Absorb [Add(bias)] [act] [Q] after the layer."""
    g = layer.root.graph
    out = layer.root.outputs[0]
    if layer.root.op_type == "MatMul" and layer.bias is None:
        found = _bias_add(out, _channels(layer), g)
        if found is not None:
            add, layer.bias = found
            layer.taken.append(add)
            out = add.outputs[0]
    m = _sole_reader(out, g)
    if m is not None and (act := _activation(m, rw)) is not None:
        layer.activation, layer.params = act
        layer.taken.append(m)
        out = m.outputs[0]
        m = _sole_reader(out, g)
    if m is None or m.op_type != "QuantizeLinear" or not _output_q(m):
        return
    layer.taken.append(m)
    layer.out_q = m


def _output_q(q: Node) -> bool:
    """A per-tensor QuantizeLinear to 8 bits with constant scale and zero point."""
    if q.attrs.get("block_size", 0) or q.attrs.get("output_dtype", 0) and \
            q.attrs["output_dtype"] not in (DType.UINT8.value, DType.INT8.value):
        return False
    s = const_value(q.inputs[1])
    z = q.inputs[2] if len(q.inputs) > 2 else None
    zc = const_value(z) if z is not None else None
    if s is None or s.size != 1 or (z is not None and (zc is None or zc.size != 1)):
        return False
    return zc is None or zc.dtype in (np.uint8, np.int8)


def _check(rw: Rewriter, layer: _Layer) -> str | None:
    if dtype_of(layer.root.outputs[0]) != DType.FLOAT:
        return "the layer does not compute in float32"
    if layer.root.op_type in ("MatMul", "Gemm"):
        r = rank_of(layer.x[0])
        if r is None or r < 2 or (layer.root.op_type == "Gemm" and r != 2):
            return "input rank unknown or not a matrix"
    if layer.activation and layer.activation not in ACTIVATIONS:
        return f"activation {layer.activation} is not fused"
    return None


def _apply(rw: Rewriter, layer: _Layer) -> str | None:
    n = layer.root
    g = n.graph
    base = n.name or n.outputs[0].name
    w = rw.add_const(g, f"{base}_qweight", layer.w) if layer.root.op_type == "Gemm" \
        else n.inputs[1].producer.inputs[0]
    ws = rw.add_const(g, f"{base}_qweight_scale", layer.w_scale)
    wz = None if layer.w_zp is None else rw.add_const(g, f"{base}_qweight_zero_point",
                                                      layer.w_zp)
    b = None if layer.bias is None else rw.add_const(g, f"{base}_qbias", layer.bias)
    ys = yz = None
    if layer.out_q is not None:
        ys = layer.out_q.inputs[1]
        yz = layer.out_q.inputs[2] if len(layer.out_q.inputs) > 2 else None
    inputs = list(layer.x) + [w, ws, wz, b, ys, yz]
    while inputs and inputs[-1] is None:
        inputs.pop()
    attrs = {}
    if n.op_type == "Conv":
        attrs = {k: v for k, v in n.attrs.items() if k in CONV_ATTRS}
    if layer.activation:
        attrs["activation"] = layer.activation
        if layer.params:
            attrs["activation_params"] = list(layer.params)
    op_type = "QConv" if n.op_type == "Conv" else "QMatMul"
    last = layer.taken[-1] if layer.taken else n
    fused = Node(op_type, inputs, [None], attrs, domain=KILN_DOMAIN, name=n.name or last.name)
    fused.outputs = [last.outputs[0]]
    rw.replace([n] + layer.taken, [fused])
    chain = " -> ".join(m.op_type for m in layer.taken)
    return f"DQ -> {n.op_type}" + (f" -> {chain}" if chain else "") + f" -> {op_type}"


# ---------------------------------------------------------------- residual Add, MaxPool

def _grid(dq: Node) -> list | None:
    """[q, scale, zero point] of a DequantizeLinear of an 8-bit tensor on one constant
    per-tensor grid."""
    parts = _dq_parts(dq)
    if parts is None or dtype_of(parts[0]) not in _EIGHT_BIT:
        return None
    s = const_value(parts[1])
    z = const_value(parts[2]) if parts[2] is not None else None
    if s is None or s.size != 1 or s.dtype != np.float32 or \
            (parts[2] is not None and (z is None or z.size != 1)):
        return None
    return parts


@dataclass
class _Add:
    root: Node
    a: list
    b: list
    relu: Node | None
    q: Node


def _match_add(rw: Rewriter, n: Node) -> _Add | None:
    if len(n.inputs) != 2 or n.inputs[0] is n.inputs[1]:
        return None
    dqs = [producer(v, n, "DequantizeLinear") for v in n.inputs]
    if None in dqs:
        return None
    a, b = (_grid(d) for d in dqs)
    if a is None or b is None:
        return None
    m = _sole_reader(n.outputs[0], n.graph)
    relu = None
    if m is not None and m.op_type == "Relu":
        relu, m = m, _sole_reader(m.outputs[0], n.graph)
    if m is None or m.op_type != "QuantizeLinear" or not _output_q(m):
        return None
    return _Add(n, a, b, relu, m)


def _check_add(rw: Rewriter, m: _Add) -> str | None:
    sa, sb = m.root.inputs[0].shape, m.root.inputs[1].shape
    if sa is None or sa != sb:
        return "the two inputs' shapes are not known to be equal (no broadcasting)"
    return None


def _apply_add(rw: Rewriter, m: _Add) -> str:
    q = m.q
    inputs = list(m.a) + list(m.b) + [q.inputs[1], q.inputs[2] if len(q.inputs) > 2 else None]
    while inputs[-1] is None:
        inputs.pop()
    fused = Node("QAdd", inputs, [None], {"activation": "Relu"} if m.relu else {},
                 domain=KILN_DOMAIN, name=m.root.name or q.name)
    fused.outputs = [q.outputs[0]]
    taken = [m.root] + ([m.relu] if m.relu else []) + [q]
    rw.replace(taken, [fused])
    return "DQ, DQ -> Add" + (" -> Relu" if m.relu else "") + " -> Q -> QAdd"


# Data movement commutes with a per-tensor dequantization: it picks or repeats elements
# and never computes with them. MaxPool takes a maximum, which commutes with any increasing
# map, as a dequantization with a positive scale is. The opset where each takes 8 bits:
_MOVES = {"Reshape": 5, "Transpose": 1, "Squeeze": 1, "Unsqueeze": 1, "Flatten": 9,
          "MaxPool": 12}


@dataclass
class _Sink:
    dq: Node
    root: Node
    x: list  # the DQ's [q, scale, zero point]


def _match_sink(rw: Rewriter, n: Node) -> _Sink | None:
    """DQ(x) on one constant grid, read only by ``n`` (a data-movement op or MaxPool)."""
    if not n.inputs or any(v is not None and v.is_used() for v in n.outputs[1:]):
        return None  # MaxPool's indices
    dq = producer(n.inputs[0], n, "DequantizeLinear")
    x = _grid(dq) if dq is not None and _sole_reader(dq.outputs[0], n.graph) is n else None
    return None if x is None else _Sink(dq, n, x)


def _check_sink(rw: Rewriter, m: _Sink) -> str | None:
    if rw.opset(m.root) < _MOVES[m.root.op_type]:
        return f"{m.root.op_type} takes 8-bit tensors from opset {_MOVES[m.root.op_type]}"
    if m.root.op_type == "MaxPool" and float(const_value(m.x[1]).reshape(-1)[0]) <= 0:
        return "a scale that is not positive reverses the order MaxPool compares by"
    return None


def _apply_sink(rw: Rewriter, m: _Sink) -> str:
    """n(DQ(x)) -> DQ(n(x)): the op moves the 8-bit elements and the DQ follows it, where
    a Q on the same grid can cancel it (``qdq_identity``) or a layer fuse with it."""
    n = m.root
    moved = Node(n.op_type, [m.x[0]] + list(n.inputs[1:]),
                 [fresh_value(n.outputs[0], "8bit")], dict(n.attrs), name=n.name)
    params = m.x[1:] if m.x[2] is not None else m.x[1:2]
    deq = Node("DequantizeLinear", [moved.outputs[0]] + params, [None], dict(m.dq.attrs),
               name=m.dq.name)
    deq.outputs = [n.outputs[0]]
    rw.replace([m.dq, n], [moved, deq])
    return f"DQ -> {n.op_type} -> {n.op_type} on 8 bits -> DQ"


def _match_identity(rw: Rewriter, q: Node) -> list | None:
    """Q(DQ(x)) with the Q on the DQ's grid and type: [x, the Q]."""
    dq = producer(q.inputs[0], q, "DequantizeLinear")
    x = _grid(dq) if dq is not None and _output_q(q) else None
    if x is None or dtype_of(q.outputs[0]) != dtype_of(x[0]):
        return None
    return [x[0], q] if _on_grid(q, x[1:]) else None


def _on_grid(q: Node, params: list) -> bool:
    """Whether QuantizeLinear ``q`` has the scale and zero point ``params`` (a DQ's, as
    ``_grid`` gives them): equal constants, or no zero point on either."""
    qin = list(q.inputs[1:3]) + [None]
    return all(a is b or a is not None and b is not None and
               np.array_equal(const_value(a), const_value(b)) for a, b in zip(params, qin))


def _apply_identity(rw: Rewriter, m: list) -> str | None:
    """Exact: (q - zp) * s / s rounds back to q - zp for any float32 scale."""
    x, q = m
    if not rw.bypass(x, q.outputs[0]):
        return None
    rw.remove(q)
    return "DQ -> Q on the same grid -> nothing"


class RoundTrips(RulePass):
    """Q(x) -> DQ on one constant grid, the DQ the Q's only reader -> one
    ``ai.kiln.QuantizeDequantize`` (x rounded onto the grid in float32)."""

    name = "qdq_round_trip"
    level = 2
    stage = 3  # after stage 2's layer fusions, which end at a Q of their own
    creates = ("QuantizeDequantize",)

    def rules(self) -> list[Rule]:
        return [Rule("qdq_round_trip", ops("DequantizeLinear"), _match_round_trip,
                     _apply_round_trip)]


def _match_round_trip(rw: Rewriter, dq: Node) -> list | None:
    """[x, the Q, the DQ] when the DQ undoes a Q on its own grid and nothing else reads
    the Q's 8-bit output."""
    q = producer(dq.inputs[0], dq, "QuantizeLinear")
    grid = _grid(dq) if q is not None else None
    if grid is None or not _output_q(q) or q.attrs.get("precision", 0) or \
            _sole_reader(q.outputs[0], dq.graph) is not dq or \
            dtype_of(q.inputs[0]) != DType.FLOAT or \
            grid[2] is None and dtype_of(grid[0]) != DType.UINT8:
        return None
    return [q.inputs[0], q, dq] if _on_grid(q, grid[1:]) else None


def _apply_round_trip(rw: Rewriter, m: list) -> str:
    x, q, dq = m
    params = [p for p in dq.inputs[1:3] if p is not None]
    fused = Node("QuantizeDequantize", [x] + params, [None], {}, domain=KILN_DOMAIN,
                 name=q.name or dq.name)
    fused.outputs = [dq.outputs[0]]
    rw.replace([q, dq], [fused])
    return "Q -> DQ on one grid -> QuantizeDequantize"
