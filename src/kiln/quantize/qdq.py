"""INT8 quantization written in the standard QDQ format: QuantizeLinear/DequantizeLinear
pairs around the layers that are to compute in integers, so any ONNX runtime loads the
file and one that has integer kernels (onnxruntime, Kiln's torch backend) fuses each
``DQ -> Conv/MatMul/Gemm -> Q`` into one.

- Weights: int8, symmetric (zero point 0, range -127..127), per output channel unless
  ``per_channel=False``; Conv/Gemm biases int32 at scale ``x_scale * w_scale`` (static).
- Activations, static: a Q/DQ pair on every float tensor entering or leaving a quantized
  layer, its scale from calibration; uint8 with a zero point, or int8 symmetric. A
  constant bias Add and a Relu/Clip that alone follow a Conv/MatMul/Gemm share its grid,
  and so does a Relu/Clip alone after a residual Add: no pair between them, so the chain
  rounds once (an integer kernel computes layer, bias and activation together).
- Activations, dynamic: ``DynamicQuantizeLinear`` computes the scale at run time, a
  DequantizeLinear follows it, only in front of Conv/ConvTranspose/MatMul/Gemm.
- Embedding tables (a Gather's constant float data, in both modes): the Gather reads an
  int8 copy and a DequantizeLinear follows it, per column (8 bits, symmetric), so only
  the rows read are converted and every runtime runs the Gather on int8 (a DQ before the
  Gather would convert the whole table on every run where DQ is not constant-folded).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kiln.ir import DType, Graph, Model, Node, TensorType, Value
from kiln.passes.base import add_const
from kiln.quantize.calibrate import Range

__all__ = ["COMPUTE_OPS", "ELEMENTWISE_OPS", "EMBEDDING_OPS", "Plan", "act_params",
           "plan_layers", "quantize_weight", "rewrite"]

COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm")
# Quantized only when every non-constant input comes from a quantized layer: they keep a
# chain of integer layers unbroken, they do not start one.
ELEMENTWISE_OPS = ("Add", "Mul", "Relu", "Clip", "MaxPool", "AveragePool",
                   "GlobalAveragePool")
EMBEDDING_OPS = ("Gather",)
MIN_TABLE = 1024
"""Elements a Gather's table needs to be quantized (a token-type table of 2 rows gains
nothing and costs a node)."""


@dataclass
class Plan:
    """Which layers get quantized, and which were considered and kept in float (why)."""

    quantized: list[Node] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)


def _weight_axis(n: Node) -> int | None:
    """The output-channel axis of ``n``'s weight (input 1), or None when it has none."""
    w = n.inputs[1]
    if w is None or w.const is None or w.const.ndim < 1:
        return None
    if n.op_type == "Conv":
        return 0
    if n.op_type == "ConvTranspose":
        return 1 if n.attrs.get("group", 1) == 1 else None
    if n.op_type == "Gemm":
        return 0 if n.attrs.get("transB", 0) else 1
    return w.const.ndim - 1 if w.const.ndim >= 2 else None  # MatMul: columns of B


def plan_layers(m: Model, mode: str, op_types: tuple[str, ...], exclude: set[str]) -> Plan:
    """Choose the layers to quantize, in graph order."""
    plan = Plan()
    done: set[Value] = set()
    for n in m.graph.nodes:
        if n.op_type not in op_types:
            continue
        label = n.name or f"{n.op_type}({n.outputs[0].name})"
        floats = [v for v in n.inputs if v is not None and v.dtype == DType.FLOAT]
        if n.name in exclude or n.op_type in exclude or label in exclude:
            plan.kept[label] = "excluded by the caller"
            continue
        if n.op_type in EMBEDDING_OPS:
            if _is_table(n.inputs[0]):
                plan.quantized.append(n)  # its output is float: it starts no integer chain
            continue
        if not floats or n.outputs[0].dtype != DType.FLOAT:
            plan.kept[label] = "not float32"
            continue
        acts = [v for v in floats if v.const is None]
        if n.op_type in COMPUTE_OPS:
            w = n.inputs[1]
            if n.op_type == "Gemm" and n.attrs.get("transA", 0):
                plan.kept[label] = "Gemm with transA"
                continue
            if mode == "dynamic" and (w is None or w.const is None):
                plan.kept[label] = "both inputs computed at run time (dynamic mode " \
                                   "quantizes constant weights)"
                continue
        elif mode == "dynamic":
            continue
        elif not acts or any(v not in done for v in acts):
            continue
        plan.quantized.append(n)
        done.update(o for o in n.outputs if o is not None)
    if mode == "static":
        _drop_dead_ends(m.graph, plan)
    return plan


def _drop_dead_ends(g: Graph, plan: Plan) -> None:
    """Leave in float the elementwise layers whose results only float ops read, unless
    they share a compute layer's grid (a bias Add, a Relu/Clip after it). They exist to
    keep a chain of integer layers unbroken between compute layers; one that leads only
    to float adds a rounding and an integer kernel runs none of it (PaddleOCR's v4
    recognizer rounded each Conv's output up to six times more, through a scalar affine
    and a hard-swish, on the way to a float Div)."""
    inner = _activation_inputs(g, plan)

    def fused(n: Node) -> bool:
        computed = [v for v in n.inputs if v is not None and v.const is None]
        v = computed[0] if len(computed) == 1 else None
        if v is None or v.producer is None:
            return False
        if v.producer.op_type in COMPUTE_OPS and n.op_type == "Add" and len(v.uses) == 1:
            return True  # a bias Add, of any shape: the layer's output as the model has it
        return v in inner and (v.producer.op_type in COMPUTE_OPS or fused(v.producer))

    keep = set(plan.quantized)
    for n in reversed(plan.quantized):
        # MaxPool picks values already on its input's grid: it adds no rounding.
        if n.op_type not in ELEMENTWISE_OPS or n.op_type == "MaxPool" or fused(n):
            continue
        if not any(u.node in keep for o in n.outputs if o is not None for u in o.uses):
            keep.discard(n)
    plan.quantized = [n for n in plan.quantized if n in keep]


def _is_table(v: Value | None) -> bool:
    c = None if v is None or v.meta.get("overridable") else v.const
    return c is not None and c.dtype == np.float32 and c.ndim >= 2 and c.size >= MIN_TABLE


def quantize_weight(w: np.ndarray, axis: int | None, bits: int = 8
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric integer weights and their float32 scale (per ``axis``, or one scale)."""
    qmax = 2 ** (bits - 1) - 1
    if axis is None:
        amax = np.abs(w).max(initial=0.0)
        scale = np.float32(amax / qmax if amax > 0 else 1.0)
        q = np.clip(np.rint(w / scale), -qmax, qmax)
        return q.astype(np.int8), np.array(scale, np.float32)
    other = tuple(i for i in range(w.ndim) if i != axis)
    amax = np.abs(w).max(axis=other)
    # A channel of subnormal weights (PaddleOCR's SE blocks hold some at 1e-40) is a zero
    # channel: its scale would underflow and its int32 bias at x_scale * w_scale overflow.
    scale = np.where(amax >= np.finfo(np.float32).tiny, amax / qmax, 1.0).astype(np.float32)
    shape = [1] * w.ndim
    shape[axis] = -1
    q = np.clip(np.rint(w / scale.reshape(shape)), -qmax, qmax)
    return q.astype(np.int8), scale


def act_params(r: Range, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Scale and zero point of an activation with calibrated range ``r``: uint8 over
    [min(lo, 0), max(hi, 0)], or int8 symmetric around 0."""
    if symmetric:
        amax = max(abs(r.lo), abs(r.hi))
        scale = amax / 127 if amax > 0 else 1.0
        return np.array(scale, np.float32), np.array(0, np.int8)
    lo, hi = min(r.lo, 0.0), max(r.hi, 0.0)
    scale = np.float32((hi - lo) / 255 if hi > lo else 1.0)
    zp = np.clip(np.rint(-lo / scale), 0, 255)
    return np.array(scale, np.float32), np.array(zp, np.uint8)


class _Editor:
    """Inserts Q/DQ nodes into a graph, each right before the first reader of the value
    it rewrites, so the node order stays topological."""

    def __init__(self, g: Graph, weight_bits: int = 8):
        self.g = g
        self.weight_bits = weight_bits
        self.order = {n: i for i, n in enumerate(g.nodes)}
        self.weights: dict[tuple[Value, int | None], Value] = {}
        self.acts: dict[Value, tuple[Value, np.ndarray]] = {}
        self.tables: dict[tuple[Value, int | None], Value] = {}
        """int8 copies of Gather tables (what the Gather reads, not a DQ output)."""
        self.gathered: set[Value] = set()
        """Outputs of the DequantizeLinear after a quantized table's Gather."""

    def _first_reader(self, v: Value) -> Node:
        readers = [u.node for u in v.uses if u.node in self.order]
        return min(readers, key=self.order.__getitem__)

    def weight(self, w: Value, axis: int | None) -> tuple[Value, np.ndarray]:
        """DQ(int8 copy of constant ``w``) and its scale; later reads reuse it."""
        key = (w, axis)
        if key not in self.weights:
            q, scale = quantize_weight(w.const, axis, self.weight_bits)
            attrs = {} if axis is None else {"axis": axis}
            self.weights[key] = self._dq(w, q, scale, np.zeros(scale.shape, np.int8), attrs,
                                         self._first_reader(w))
        return self.weights[key], self.weights[key].meta["scale"]

    def table(self, n: Node, per_column: bool) -> None:
        """Make Gather ``n`` read an int8 copy of its constant table and dequantize what
        it gathered: per column when the gathered axis is not the last."""
        w, out = n.inputs[0], n.outputs[0]
        last = w.const.ndim - 1
        axis = n.attrs.get("axis", 0)
        per_column = per_column and axis not in (last, -1)
        # Its own cache: ``weights`` holds DQ outputs, and a table may also be a MatMul's
        # weight (tied embeddings) under the same key.
        key = (w, last if per_column else None)
        if key not in self.tables:
            q, scale = quantize_weight(w.const, key[1])
            qv = add_const(self.g, f"{w.name}_quantized", q)
            qv.meta["scale"] = scale
            self.tables[key] = qv
        qv = self.tables[key]
        scale = qv.meta["scale"]
        readers = [u.node for u in out.uses if u.node in self.order]
        gathered = Value(f"{out.name}_gathered", TensorType(DType.INT8, out.shape))
        n.set_input(0, qv)
        n.outputs = [gathered]
        dq = Node("DequantizeLinear",
                  [gathered, add_const(self.g, f"{out.name}_scale", scale),
                   add_const(self.g, f"{out.name}_zero_point", np.zeros(scale.shape, np.int8))],
                  [out], {"axis": -1} if per_column else {}, name=f"{out.name}_DequantizeGathered")
        self.gathered.add(out)
        if readers:
            self.g.insert_before(min(readers, key=self.order.__getitem__), [dq])
        else:
            self.g.append(dq)

    def bias(self, b: Value, scale: np.ndarray) -> Value:
        """DQ(int32 ``b`` at ``scale``), the bias precision integer kernels accumulate in."""
        lim = np.iinfo(np.int32).max
        q = np.clip(np.rint(b.const.astype(np.float64) / scale), -lim, lim).astype(np.int32)
        attrs = {"axis": 0} if scale.ndim else {}
        return self._dq(b, q, scale.astype(np.float32), np.zeros(scale.shape, np.int32),
                        attrs, self._first_reader(b))

    def _dq(self, w: Value, q, scale, zp, attrs, before: Node) -> Value:
        g = self.g
        qv = add_const(g, f"{w.name}_quantized", q)
        sv = add_const(g, f"{w.name}_scale", scale)
        zv = add_const(g, f"{w.name}_zero_point", zp)
        out = Value(f"{w.name}_dequantized", TensorType(DType.FLOAT, w.shape))
        out.meta["scale"] = scale
        g.insert_before(before, [Node("DequantizeLinear", [qv, sv, zv], [out], attrs,
                                      name=f"{w.name}_DequantizeLinear")])
        return out

    def activation(self, v: Value, scale: np.ndarray, zp: np.ndarray) -> Value:
        """Q/DQ on ``v``: every node reader of ``v`` reads the DQ output from now on."""
        if v in self.acts:
            return self.acts[v][0]
        g = self.g
        first = self._first_reader(v)
        sv = add_const(g, f"{v.name}_scale", scale)
        zv = add_const(g, f"{v.name}_zero_point", zp)
        q = Value(f"{v.name}_quantized", TensorType(DType.from_numpy(zp.dtype), v.shape))
        dq = Value(f"{v.name}_dequantized", TensorType(DType.FLOAT, v.shape))
        readers = list(v.uses)
        g.insert_before(first, [
            Node("QuantizeLinear", [v, sv, zv], [q], name=f"{v.name}_QuantizeLinear"),
            Node("DequantizeLinear", [q, sv, zv], [dq], name=f"{v.name}_DequantizeLinear")])
        for n, i in readers:
            n.set_input(i, dq)
        self.acts[v] = (dq, scale)
        return dq

    def dynamic(self, v: Value) -> Value:
        """DynamicQuantizeLinear(v) -> DQ: activations quantized with a run-time scale."""
        if v in self.acts:
            return self.acts[v][0]
        g = self.g
        q = Value(f"{v.name}_quantized", TensorType(DType.UINT8, v.shape))
        s = Value(f"{v.name}_scale", TensorType(DType.FLOAT, ()))
        z = Value(f"{v.name}_zero_point", TensorType(DType.UINT8, ()))
        dq = Value(f"{v.name}_dequantized", TensorType(DType.FLOAT, v.shape))
        readers = [u for u in v.uses if u.node.op_type in COMPUTE_OPS and u.index == 0]
        g.insert_before(self._first_reader(v), [
            Node("DynamicQuantizeLinear", [v], [q, s, z], name=f"{v.name}_DynamicQuantize"),
            Node("DequantizeLinear", [q, s, z], [dq], name=f"{v.name}_DequantizeLinear")])
        for n, i in readers:
            n.set_input(i, dq)
        self.acts[v] = (dq, None)
        return dq

    def drop_unused(self) -> None:
        for name, v in list(self.g.initializers.items()):
            if not v.is_used():
                del self.g.initializers[name]


def rewrite(m: Model, plan: Plan, mode: str, ranges: dict[str, Range] | None,
            per_channel: bool, symmetric: bool, weight_bits: int = 8,
            float_ends: bool = False) -> None:
    """Insert the Q/DQ nodes for ``plan`` into ``m`` (in place). ``weight_bits=7`` keeps
    weights in -63..63 (see :mod:`kiln.quantize.cpu`). ``float_ends`` (static): a
    quantized layer whose output no quantized layer reads leaves it float instead of
    rounding it onto a grid no integer kernel reads; Kiln's integer kernels write float
    there, onnxruntime fuses an integer Conv/MatMul only with a Q after it."""
    ed = _Editor(m.graph, weight_bits)
    per_channel = per_channel and m.opset >= 13
    inner = _activation_inputs(m.graph, plan) if mode == "static" else set()
    for n in plan.quantized:
        if n.op_type in EMBEDDING_OPS:
            ed.table(n, per_channel)
            continue
        if mode == "static":
            for i, v in enumerate(list(n.inputs)):
                if v is None or v.const is not None or v.dtype != DType.FLOAT or v in inner or \
                        v.producer is not None and v.producer.op_type == "DequantizeLinear" \
                        and v not in ed.gathered:  # a table's per-column grid is no activation's
                    continue
                if v in ed.acts:
                    n.set_input(i, ed.acts[v][0])
                    continue
                scale, zp = act_params(ranges[v.name], symmetric)
                ed.activation(v, scale, zp)
        elif n.inputs[0].const is None:
            ed.dynamic(n.inputs[0])
        if n.op_type not in COMPUTE_OPS:
            continue
        w = n.inputs[1]
        if w.const is not None:
            axis = _weight_axis(n) if per_channel else None
            dq, w_scale = ed.weight(w, axis)
            n.set_input(1, dq)
            b = n.inputs[2] if len(n.inputs) > 2 else None
            if mode == "static" and b is not None and b.const is not None and \
                    _bias_fits(n, b):
                x_scale = _scale_of(ed, n.inputs[0])
                if x_scale is not None:
                    n.set_input(2, ed.bias(b, x_scale * w_scale))
    if mode == "static":
        chosen = set(plan.quantized)
        for n in plan.quantized:
            if n.op_type in EMBEDDING_OPS:
                continue
            for o in n.outputs:
                if float_ends and o is not None and not chosen.intersection(o.consumers()):
                    continue
                if o is not None and o.dtype == DType.FLOAT and o.uses and o not in ed.acts \
                        and o not in inner and o.name in ranges:
                    scale, zp = act_params(ranges[o.name], symmetric)
                    ed.activation(o, scale, zp)
    ed.drop_unused()


def _activation_inputs(g: Graph, plan: Plan) -> set[Value]:
    """Outputs of quantized compute layers read only by a quantized constant bias Add
    or Relu/Clip, and of quantized Adds (bias or residual) read only by a Relu/Clip: they
    stay float, the chain's last output is quantized instead, one grid for all (a
    residual Add's own grid would spend half its levels on values the Relu drops)."""
    chosen = set(plan.quantized)
    out: set[Value] = set()
    for n in plan.quantized:  # graph order: a bias Add is seen before its activation
        if n.op_type == "Add":
            consts = [v for v in n.inputs if v is not None and v.const is not None]
            if len(consts) != 1 or consts[0].const.ndim > 1:
                continue
        elif n.op_type not in ("Relu", "Clip"):
            continue
        v = next((v for v in n.inputs if v is not None and v.const is None), None)
        p = v.producer if v is not None else None
        if p not in chosen or v.is_output_of(g) or len(v.uses) != 1:
            continue
        if p.op_type in COMPUTE_OPS or (p.op_type == "Add" and n.op_type != "Add"):
            out.add(v)
    return out


def _scale_of(ed: _Editor, dq: Value) -> np.ndarray | None:
    for dq_out, scale in ed.acts.values():
        if dq_out is dq:
            return scale
    return None


def _bias_fits(n: Node, b: Value) -> bool:
    """Whether ``b`` is a per-output-channel bias an integer kernel can add as int32."""
    if n.op_type == "Gemm" and (n.attrs.get("alpha", 1.0) != 1.0 or
                                n.attrs.get("beta", 1.0) != 1.0):
        return False
    return b.const.ndim == 1 and n.op_type in ("Conv", "Gemm")
