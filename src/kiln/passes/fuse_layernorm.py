"""Fuse the decomposed layer normalization into one op:

    mean = ReduceMean(x, axes)          d = x - mean
    var  = ReduceMean(d ^ 2, axes)      (Pow(d, 2) or d * d)
    y    = d / Sqrt(var + eps)          (or d * Reciprocal(Sqrt(...)))
    [y * gamma] [+ beta]

where ``axes`` are the last k axes. The result is ONNX's ``LayerNormalization`` (opset 17+,
when Kiln has its kernel) or Kiln's ``LayerNorm`` (same semantics) for older models.

A second rule fuses RMS normalization (Llama's, T5's, Qwen's) the same way:

    y = x / Sqrt(ReduceMean(x ^ 2, axes) + eps)   (or x * 1/Sqrt(...), x * Reciprocal(...))
    [y * gamma]

into ONNX's ``RMSNormalization`` (opset 23+) or Kiln's ``RMSNorm``.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Graph, Model, Node, Value
from kiln.ops import symdim
from kiln.ops.registry import KILN_DOMAIN, lookup
from kiln.passes.base import (
    RulePass,
    add_const,
    const_value,
    dtype_of,
    rank_of,
    scalar_value,
    shape_of,
)
from kiln.passes.rewrite import Rewriter, Rule, ops


class FuseLayerNorm(RulePass):
    """Decomposed LayerNorm -> LayerNormalization (or Kiln's LayerNorm)."""

    name = "fuse_layernorm"
    level = 2
    stage = 2
    creates = ("LayerNorm", "RMSNorm")

    def rules(self) -> list[Rule]:
        return [Rule("layernorm", ops("ReduceMean"), _match, _apply, _check),
                Rule("rmsnorm", ops("ReduceMean"), _match_rms, _apply_rms, _check)]


def _match(rw: Rewriter, n: Node):
    return _LayerNormFuser(n.graph, rw.model).match(n)


def _check(rw: Rewriter, m) -> str | None:
    x = m[0]
    if not dtype_of(x) or not dtype_of(x).is_float:
        return "input is not a float tensor (or its type is unknown)"
    return None


def _apply(rw: Rewriter, m) -> str:
    x, gamma, beta, y, nodes, axis, eps = m
    node = _LayerNormFuser(nodes[0].graph, rw.model).emit(x, gamma, beta, y, axis, eps)
    node.name = nodes[0].name
    rw.replace(nodes, [node])
    return "LayerNorm pattern fused"


def _match_rms(rw: Rewriter, n: Node):
    return _LayerNormFuser(n.graph, rw.model).match_rms(n)


def _apply_rms(rw: Rewriter, m) -> str:
    x, gamma, y, nodes, axis, eps = m
    node = _LayerNormFuser(nodes[0].graph, rw.model).emit_rms(x, gamma, y, axis, eps)
    node.name = nodes[0].name
    rw.replace(nodes, [node])
    return "RMSNorm pattern fused"


class _LayerNormFuser:
    def __init__(self, g: Graph, model: Model):
        self.g, self.model = g, model
        self.onnx_ln = model.opset >= 17 and \
            lookup("", "LayerNormalization", model.opset) is not None

    def _readers(self, v: Value) -> list[Node]:
        if v.is_returned:
            return []
        return [r for r in v.readers() if r.graph is self.g]

    def _one(self, v: Value, *ops: str) -> Node | None:
        r = self._readers(v)
        if len(r) != 1 or v.num_reads != 1:
            return None
        return r[0] if r[0].domain == "" and r[0].op_type in ops else None

    def _axes(self, n: Node) -> list[int] | None:
        if not n.attrs.get("keepdims", 1):
            return None
        if self.model.opset >= 18:
            if len(n.inputs) < 2 or n.inputs[1] is None:
                return None
            return symdim.known_ints(symdim.sym_of(n.inputs[1]))
        return n.attrs.get("axes")

    def _last_axes(self, x: Value | None, axes: list[int] | None) -> int | None:
        """k when ``axes`` are the last k axes of ``x``."""
        if axes is None or not axes or x is None:
            return None
        k, rank = len(axes), rank_of(x)
        if rank is not None:
            return k if sorted(a % rank for a in axes) == list(range(rank - k, rank)) else None
        return k if sorted(axes) == list(range(-k, 0)) else None

    def _eps_sqrt(self, ms: Value) -> tuple[float, list[Node]] | None:
        """(eps, [Add, Sqrt]) for Sqrt(ms + eps), each read once."""
        add = self._one(ms, "Add")
        if add is None:
            return None
        eps = scalar_value(add.inputs[1] if add.inputs[0] is ms else add.inputs[0])
        sqrt = self._one(add.outputs[0], "Sqrt") if eps is not None else None
        return None if sqrt is None else (eps, [add, sqrt])

    def match_rms(self, var_node: Node):
        """(x, gamma, y, nodes, axis, eps) or None."""
        sq = var_node.inputs[0].producer if var_node.inputs else None
        if sq is None or sq.graph is not self.g or sq.domain != "" or \
                self._one(sq.outputs[0], "ReduceMean") is not var_node:
            return None
        x = sq.inputs[0]
        if not (sq.op_type == "Pow" and scalar_value(sq.inputs[1]) == 2.0 or
                sq.op_type == "Mul" and sq.inputs[1] is x):
            return None
        k = self._last_axes(x, self._axes(var_node))
        found = self._eps_sqrt(var_node.outputs[0]) if k is not None else None
        if found is None:
            return None
        eps, tail = found
        root = tail[-1].outputs[0]
        nodes = [sq, var_node] + tail
        step = self._one(root, "Div", "Reciprocal")
        if step is not None and step.op_type == "Div" and step.inputs[0] is x and \
                step.inputs[1] is root:
            nodes.append(step)  # x / Sqrt(...)
        elif step is not None and (step.op_type == "Reciprocal" or step.inputs[1] is root and
                                   scalar_value(step.inputs[0]) == 1.0):
            mul = self._one(step.outputs[0], "Mul")  # x * (1 / Sqrt(...))
            if mul is None or set(mul.inputs) != {x, step.outputs[0]}:
                return None
            nodes += [step, mul]
        else:
            return None
        y, gamma = nodes[-1].outputs[0], None
        mul = self._one(y, "Mul")
        if mul is not None:
            other = mul.inputs[1] if mul.inputs[0] is y else mul.inputs[0]
            if self._param(other, k):
                gamma, y = other, mul.outputs[0]
                nodes.append(mul)
        return x, gamma, y, nodes, -k, eps

    def emit_rms(self, x, gamma, y, axis, eps) -> Node:
        norm_shape = shape_of(x)[axis:] if shape_of(x) is not None else None
        static = symdim.static_shape(norm_shape)
        if self.model.opset >= 23 and static is not None and \
                lookup("", "RMSNormalization", self.model.opset) is not None:
            scale = self._full(gamma, static, 1.0, dtype_of(x).numpy, y)
            node = Node("RMSNormalization", [x, scale], [None],
                        {"axis": axis, "epsilon": eps})
        else:
            node = Node("RMSNorm", [x] + ([gamma] if gamma is not None else []), [None],
                        {"axis": axis, "epsilon": eps}, domain=KILN_DOMAIN)
        node.outputs = [y]
        return node

    def match(self, mean_node: Node):
        """(x, gamma, beta, y, nodes, axis, eps) or None."""
        x, axes = mean_node.inputs[0], self._axes(mean_node)
        k = self._last_axes(x, axes)
        if k is None:
            return None
        mean = mean_node.outputs[0]
        sub = self._one(mean, "Sub")
        if sub is None or sub.inputs[0] is not x or sub.inputs[1] is not mean:
            return None
        d = sub.outputs[0]
        readers = list(dict.fromkeys(self._readers(d)))  # Mul(d, d) reads d twice
        if len(readers) != 2 or set(d.readers()) != set(readers):
            return None
        sq = next((r for r in readers if r.op_type in ("Pow", "Mul") and r.domain == ""
                   and r.inputs[0] is d), None)
        div = next((r for r in readers if r is not sq), None)
        if sq is None or div is None or div.domain != "":
            return None
        if sq.op_type == "Pow" and scalar_value(sq.inputs[1]) != 2.0:
            return None
        if sq.op_type == "Mul" and sq.inputs[1] is not d:
            return None
        var_node = self._one(sq.outputs[0], "ReduceMean")
        if var_node is None or sorted(self._axes(var_node) or []) != sorted(axes):
            return None
        found = self._eps_sqrt(var_node.outputs[0])
        if found is None:
            return None
        eps, (add, sqrt) = found
        nodes = [mean_node, sub, sq, var_node, add, sqrt]
        if div.op_type == "Div" and div.inputs[0] is d and div.inputs[1] is sqrt.outputs[0]:
            if self._one(sqrt.outputs[0], "Div") is not div:
                return None
            nodes.append(div)
        elif div.op_type == "Mul":
            rec = self._one(sqrt.outputs[0], "Reciprocal")
            if rec is None or set(div.inputs) != {d, rec.outputs[0]} or \
                    self._one(rec.outputs[0], "Mul") is not div:
                return None
            nodes += [rec, div]
        else:
            return None
        y = div.outputs[0]
        gamma = beta = None
        mul = self._one(y, "Mul")
        if mul is not None and "axis" not in mul.attrs:
            other = mul.inputs[1] if mul.inputs[0] is y else mul.inputs[0]
            if self._param(other, k):
                gamma, y = other, mul.outputs[0]
                nodes.append(mul)
        addb = self._one(y, "Add")
        if addb is not None and "axis" not in addb.attrs:
            other = addb.inputs[1] if addb.inputs[0] is y else addb.inputs[0]
            if self._param(other, k):
                beta, y = other, addb.outputs[0]
                nodes.append(addb)
        return x, gamma, beta, y, nodes, -k, eps

    def _param(self, v: Value | None, k: int) -> bool:
        """A constant scale/shift that broadcasts over the normalized axes only."""
        c = const_value(v)
        return c is not None and c.ndim <= k and c.dtype.kind == "f"

    def emit(self, x, gamma, beta, y, axis, eps) -> Node:
        dtype = dtype_of(x).numpy
        norm_shape = shape_of(x)[axis:] if shape_of(x) is not None else None
        static = symdim.static_shape(norm_shape)
        use_onnx = self.onnx_ln and static is not None
        if use_onnx:
            gamma = self._full(gamma, static, 1.0, dtype, y)
            beta = self._full(beta, static, 0.0, dtype, y) if beta is not None else None
            node = Node("LayerNormalization", [x, gamma, beta] if beta is not None else
                        [x, gamma], [None], {"axis": axis, "epsilon": eps})
        else:
            node = Node("LayerNorm", [x, gamma, beta], [None], {"axis": axis, "epsilon": eps},
                        domain=KILN_DOMAIN)
        node.outputs = [y]
        return node

    def _full(self, v, shape, fill, dtype, y) -> Value:
        """``v`` broadcast to the normalized shape (LayerNormalization wants it so)."""
        c = const_value(v) if v is not None else None
        arr = np.full(shape, fill, dtype) if c is None else \
            np.broadcast_to(c.astype(dtype), shape).copy()
        if c is not None and c.shape == tuple(shape) and c.dtype == dtype:
            return v
        return add_const(self.g, f"{y.name}_{'scale' if fill == 1.0 else 'bias'}", arr)
