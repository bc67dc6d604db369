"""Fuse scaled dot-product attention into Kiln's ``Attention`` op:

    scores = MatMul(Q, K^T)            (Q and/or K possibly pre-multiplied by a scalar)
    scores = scores * c  |  scores / c (optional)
    scores = scores + mask             (optional, any broadcastable additive mask)
    probs  = Softmax(scores, axis=-1)
    out    = MatMul(probs, V)

becomes ``Attention(Q, K^T, V, mask; scale, k_transposed=1)``. The fused kernel keeps one
score buffer and does the scale, mask add and softmax in place on it, where the unfused
ops allocate a new array for each step. Every intermediate must have no other reader.
"""

from __future__ import annotations

from kiln.ir import Graph, Model, Node, Value
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import (
    Pass,
    PassRecord,
    Uses,
    dtype_of,
    graphs,
    producers,
    rank_of,
    rebuild,
    scalar_value,
)


class FuseAttention(Pass):
    """MatMul -> scale -> mask -> Softmax -> MatMul  ->  ai.kiln.Attention."""

    name = "fuse_attention"
    level = 2
    creates = ("Attention",)

    def run(self, model: Model, record: PassRecord) -> None:
        for g in list(graphs(model.graph)):
            _AttentionFuser(g, model, record).run()
        if any(n.domain == KILN_DOMAIN for _, n in model.graph.walk()):
            model.opset_imports.setdefault(KILN_DOMAIN, 1)


class _AttentionFuser:
    def __init__(self, g: Graph, model: Model, record: PassRecord):
        self.g, self.model, self.record = g, model, record
        self.uses, self.prod = Uses(g), producers(g)
        self.remove: set[Node] = set()
        self.insert: dict[Node, list[Node]] = {}

    def run(self) -> None:
        for n in self.g.nodes:
            if n.domain == "" and n.op_type == "Softmax" and n not in self.remove:
                self._match(n)
        if self.remove:
            rebuild(self.g, self.remove, self.insert)

    def _p(self, v: Value | None, *ops: str, reader: Node | None = None) -> Node | None:
        """The producer of ``v`` if it is one of ``ops`` and ``reader`` is its only reader."""
        n = self.prod.get(v) if v is not None else None
        if n is None or n.domain != "" or n.op_type not in ops or n in self.remove:
            return None
        if reader is not None and not self.uses.only_reader(v, reader):
            return None
        return n

    def _scaled(self, v: Value, reader: Node):
        """(base value, factor, nodes) for v = base * c or base / c, else (v, 1, [])."""
        n = self._p(v, "Mul", "Div", reader=reader)
        if n is not None and len(n.inputs) == 2:
            for i in (0, 1):
                c = scalar_value(n.inputs[1 - i])
                if c is None or (n.op_type == "Div" and i == 1) or c == 0:
                    continue
                return n.inputs[i], (c if n.op_type == "Mul" else 1.0 / c), [n]
        return v, 1.0, []

    def _match(self, sm: Node) -> None:
        scores = sm.inputs[0]
        rank = rank_of(scores)
        axis = sm.attrs.get("axis", -1 if self.model.opset >= 13 else 1)
        if rank is None or axis not in (-1, rank - 1) or rank < 2:
            return
        dtype = dtype_of(scores)
        if dtype is None or not dtype.is_float:
            return
        readers = self.uses.consumers(sm.outputs[0])
        if len(readers) != 1 or self.uses.outputs[sm.outputs[0]]:
            return
        mm2 = readers[0]
        if mm2.domain != "" or mm2.op_type != "MatMul" or mm2.inputs[0] is not sm.outputs[0]:
            return
        nodes = [sm, mm2]
        mask = None
        cur, reader = scores, sm
        add = self._p(cur, "Add", reader=reader)
        if add is not None:
            for i in (0, 1):
                base = self._qk_chain(add.inputs[i], add)
                if base is not None:
                    mask = add.inputs[1 - i]
                    cur, reader = add.inputs[i], add
                    nodes.append(add)
                    break
            else:
                return
        chain = self._qk_chain(cur, reader)
        if chain is None:
            return
        q, kt, scale, chain_nodes = chain
        nodes += chain_nodes
        v = mm2.inputs[1]
        if mask is not None and mask is v:
            return
        att = Node("Attention", [q, kt, v] + ([mask] if mask is not None else []),
                   [mm2.outputs[0]], {"scale": float(scale), "k_transposed": 1},
                   domain=KILN_DOMAIN, name=mm2.name or sm.name)
        self.insert[mm2] = [att]
        self.remove.update(nodes)
        self.record.add("attention fused")

    def _qk_chain(self, v: Value, reader: Node):
        """(Q, K^T, scale, nodes) when ``v`` is an optionally scaled MatMul(Q, K^T)."""
        base, factor, nodes = self._scaled(v, reader)
        mm = self._p(base, "MatMul", reader=nodes[0] if nodes else reader)
        if mm is None or len(mm.inputs) != 2:
            return None
        if rank_of(mm.inputs[0]) is None or rank_of(mm.inputs[0]) < 2:
            return None
        q, fq, nq = self._scaled(mm.inputs[0], mm)
        kt, fk, nk = self._scaled(mm.inputs[1], mm)
        return q, kt, factor * fq * fk, nodes + [mm] + nq + nk
