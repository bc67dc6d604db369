"""Fuse scaled dot-product attention into Kiln's ``Attention`` op:

    scores = MatMul(Q, K^T)            (Q and/or K possibly pre-multiplied by a scalar)
    scores = scores * c  |  scores / c (optional)
    scores = scores + mask             (optional, any broadcastable additive mask)
    probs  = Softmax(scores, axis=-1)
    out    = MatMul(probs, V)

becomes ``Attention(Q, K^T, V, mask; scale, k_transposed=1)``. The fused kernel keeps one
score buffer and does the scale, mask add and softmax in place on it, where the unfused
ops allocate a new array for each step. Every intermediate must have no other reader.
PyTorch's export of ``scaled_dot_product_attention`` also zeroes NaN probabilities
(``Where(IsNaN(probs), 0, probs)``: rows a mask hides entirely); that guard is taken in
too, as ``zero_nan=1``.

A second rule takes in the head split and merge transformer exporters write around it:

    q, k, v [B, S, H*D] -> Reshape [B, S, H, D] -> Transpose -> Attention -> Transpose
        -> Reshape [B, S, H*D]      ->  Attention(q, k, v, mask; num_heads=H)

Nine layers become one; the kernels split the heads as views (docs/performance.md has
what BERT at sequence 16 spends on these). Shapes come from shape inference, so
exporters' constant and computed Reshape targets alike qualify.
"""

from __future__ import annotations

from kiln.ir import Node, Value
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import RulePass, dtype_of, rank_of, scalar_value, shape_of
from kiln.passes.rewrite import Rewriter, Rule, only_consumer, ops, producer


class FuseAttention(RulePass):
    """MatMul -> scale -> mask -> Softmax -> MatMul  ->  ai.kiln.Attention."""

    name = "fuse_attention"
    level = 2
    stage = 2
    creates = ("Attention",)

    def rules(self) -> list[Rule]:
        return [Rule("attention", ops("Softmax"), _match, _apply, _check),
                Rule("heads", ops("Attention", domain=KILN_DOMAIN), _match_heads,
                     _apply_heads)]


def _match(rw: Rewriter, sm: Node):
    return _AttentionMatcher(rw, sm).match()


def _check(rw: Rewriter, m) -> str | None:
    q, kt, v, mask, scale, nodes, sm, mm2, zero_nan = m
    if mask is not None and mask is v:
        return "the mask is also V"
    return None


def _apply(rw: Rewriter, m) -> str:
    q, kt, v, mask, scale, nodes, sm, mm2, zero_nan = m
    attrs = {"scale": float(scale), "k_transposed": 1} | ({"zero_nan": 1} if zero_nan else {})
    att = Node("Attention", [q, kt, v] + ([mask] if mask is not None else []), [None],
               attrs, domain=KILN_DOMAIN, name=mm2.name or sm.name)
    att.outputs = [mm2.outputs[0]]
    rw.replace(nodes, [att])
    return "attention fused"


_HEADS = [0, 2, 1, 3]
"""[B, S, H, D] <-> [B, H, S, D]."""


def _known(shape) -> bool:
    return shape is not None and all(d is not None for d in shape)


def _split_heads(att: Node, i: int, perm: list[int]):
    """(x, heads, head size, [Reshape, Transpose]) when input ``i`` of ``att`` is
    Transpose(perm) of a Reshape of a 3-D ``x`` splitting its last axis into heads."""
    v = att.inputs[i]
    t = producer(v, att, "Transpose")
    if t is None or not v.only_reader(att) or list(t.attrs.get("perm", ())) != perm:
        return None
    r = producer(t.inputs[0], t, "Reshape")
    if r is None or not t.inputs[0].only_reader(t):
        return None
    x = r.inputs[0]
    xs, ys = shape_of(x), shape_of(r.outputs[0])
    if not (_known(xs) and _known(ys)) or len(xs) != 3 or len(ys) != 4:
        return None
    h, d = ys[2], ys[3]
    if not (isinstance(h, int) and isinstance(d, int)) or tuple(ys[:2]) != tuple(xs[:2]) \
            or h * d != xs[2]:
        return None
    return x, h, d, [r, t]


def _match_heads(rw: Rewriter, att: Node):
    """(q, k, v, heads, nodes in order, the merged output's Reshape) or None."""
    if att.attrs.get("num_heads", 0) or len(att.inputs) < 3:
        return None
    kperm = [0, 2, 3, 1] if att.attrs.get("k_transposed", 0) else _HEADS
    parts = [_split_heads(att, i, p) for i, p in ((0, _HEADS), (1, kperm), (2, _HEADS))]
    if any(p is None for p in parts):
        return None
    (q, hq, dq, nq), (k, hk, dk, nk), (v, hv, dv, nv) = parts
    qs, ks, vs = shape_of(q), shape_of(k), shape_of(v)
    if not hq == hk == hv or dq != dk or not qs[0] == ks[0] == vs[0] or ks[1] != vs[1]:
        return None
    t = only_consumer(att.outputs[0], "Transpose")
    if t is None or list(t.attrs.get("perm", ())) != _HEADS:
        return None
    r = only_consumer(t.outputs[0], "Reshape")
    ys = shape_of(r.outputs[0]) if r is not None else None
    if not _known(ys) or tuple(ys) != (qs[0], qs[1], hv * dv):
        return None
    return q, k, v, hq, nq + nk + nv + [att, t, r], r


def _apply_heads(rw: Rewriter, m) -> str:
    q, k, v, heads, nodes, last = m
    att = nodes[6]
    attrs = {k: a for k, a in att.attrs.items() if k != "k_transposed"}
    fused = Node("Attention", [q, k, v] + att.inputs[3:4], [None],
                 attrs | {"num_heads": heads}, domain=KILN_DOMAIN, name=att.name)
    fused.outputs = [last.outputs[0]]
    rw.replace(nodes, [fused])
    return "head split and merge taken into attention"


class _AttentionMatcher:
    def __init__(self, rw: Rewriter, root: Node):
        self.model, self.root = rw.model, root

    def _p(self, v: Value | None, *ops: str, reader: Node | None = None) -> Node | None:
        """The producer of ``v`` if it is one of ``ops`` and ``reader`` is its only reader."""
        n = producer(v, self.root, *ops)
        if n is None:
            return None
        if reader is not None and not v.only_reader(reader):
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

    def match(self):
        """(Q, K^T, V, mask, scale, nodes, softmax, last MatMul) or None."""
        sm = self.root
        scores = sm.inputs[0]
        rank = rank_of(scores)
        axis = sm.attrs.get("axis", -1 if self.model.opset >= 13 else 1)
        if rank is None or axis not in (-1, rank - 1) or rank < 2:
            return None
        dtype = dtype_of(scores)
        if dtype is None or not dtype.is_float:
            return None
        guard = self._nan_guard(sm.outputs[0])
        probs = guard[-1].outputs[0] if guard else sm.outputs[0]
        mm2 = only_consumer(probs, "MatMul")
        if mm2 is None or mm2.inputs[0] is not probs:
            return None
        mask = None
        cur, reader = scores, sm
        extra = []
        add = self._p(cur, "Add", reader=reader)
        if add is not None:
            for i in (0, 1):
                base = self._qk_chain(add.inputs[i], add)
                if base is not None:
                    mask = add.inputs[1 - i]
                    cur, reader = add.inputs[i], add
                    extra.append(add)
                    break
            else:
                return None
        chain = self._qk_chain(cur, reader)
        if chain is None:
            return None
        q, kt, scale, chain_nodes = chain
        # producers first, the final MatMul last: the fused node takes its place
        nodes = list(reversed(chain_nodes)) + extra[::-1] + [sm] + guard + [mm2]
        return q, kt, mm2.inputs[1], mask, scale, nodes, sm, mm2, bool(guard)

    def _nan_guard(self, p: Value) -> list[Node]:
        """[IsNaN, Where] when the probabilities ``p`` are read only as
        ``Where(IsNaN(p), 0, p)`` (PyTorch's exported attention zeroes the rows a mask
        hides entirely, whose softmax is NaN), else []."""
        readers = p.consumers()
        if p.is_returned or len(readers) != 2:
            return []
        isnan = next((r for r in readers if r.op_type == "IsNaN" and r.domain == ""), None)
        where = next((r for r in readers if r.op_type == "Where" and r.domain == ""), None)
        if isnan is None or where is None or isnan.graph is not self.root.graph or \
                where.graph is not self.root.graph or \
                only_consumer(isnan.outputs[0], "Where") is not where or \
                list(where.inputs) != [isnan.outputs[0], where.inputs[1], p] or \
                scalar_value(where.inputs[1]) != 0.0:
            return []
        return [isnan, where]

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
