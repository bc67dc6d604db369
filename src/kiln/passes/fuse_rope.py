"""Fuse rotary position embedding, as Llama, Qwen and GPT-NeoX exports write it:

    x1 = Slice(x, 0, d/2)    x2 = Slice(x, d/2, end)        (last axis)
    y  = x * cos + Concat(-x2, x1) * sin
        -> ai.kiln.RoPE(x, cos, sin)

Six layers for each of a layer's query and key become one. ``x``'s last dim must be
known and even; every intermediate must have no other reader.
"""

from __future__ import annotations

from kiln.ir import Node, Value
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import RulePass, const_value, dtype_of, shape_of
from kiln.passes.rewrite import Rewriter, Rule, ops, single_reader


class FuseRoPE(RulePass):
    """x * cos + rotate_half(x) * sin -> ai.kiln.RoPE."""

    name = "fuse_rope"
    level = 2
    stage = 2
    creates = ("RoPE",)

    def rules(self) -> list[Rule]:
        return [Rule("rope", ops("Add"), _match, _apply)]


def _other(mul: Node, v: Value) -> Value | None:
    """The input of binary ``mul`` that is not ``v`` (None when ``v`` is not one)."""
    a, b = mul.inputs
    return b if a is v else a if b is v else None


def _slice_of(v: Value, reader: Node):
    """(x, start, end) when ``v`` is a unit-step Slice of the last axis of a tensor, with
    constant bounds."""
    s = single_reader(v, reader, "Slice")
    if s is None or len(s.inputs) < 4:
        return None
    x, shape = s.inputs[0], shape_of(s.inputs[0])
    bounds = [const_value(i) for i in s.inputs[1:4]]
    steps = s.inputs[4] if len(s.inputs) > 4 else None
    if steps is not None:
        bounds.append(const_value(steps))
    if shape is None or any(c is None or c.size != 1 for c in bounds):
        return None
    start, end, axis, *step = (int(c.reshape(-1)[0]) for c in bounds)
    if axis not in (-1, len(shape) - 1) or step not in ([], [1]):
        return None
    return x, start, end


def _match(rw: Rewriter, add: Node):
    """(x, cos, sin, nodes) or None."""
    if len(add.inputs) != 2:
        return None
    for rot_v, plain_v in (add.inputs, add.inputs[::-1]):
        m = _try(add, rot_v, plain_v)
        if m is not None:
            return m
    return None


def _try(add: Node, rot_v: Value, plain_v: Value):
    rot_mul = single_reader(rot_v, add, "Mul")
    plain_mul = single_reader(plain_v, add, "Mul")
    if rot_mul is None or plain_mul is None or len(rot_mul.inputs) != 2:
        return None
    for cat_v in rot_mul.inputs:
        cat = single_reader(cat_v, rot_mul, "Concat")
        if cat is None or len(cat.inputs) != 2:
            continue
        neg = single_reader(cat.inputs[0], cat, "Neg")
        hi = _slice_of(neg.inputs[0], neg) if neg is not None else None
        lo = _slice_of(cat.inputs[1], cat)
        if hi is None or lo is None or hi[0] is not lo[0]:
            continue
        x, shape = hi[0], shape_of(hi[0])
        d = shape[-1]
        if not isinstance(d, int) or d % 2 or cat.attrs.get("axis") not in (-1, len(shape) - 1):
            continue
        h = d // 2
        if lo[1:] != (0, h) or hi[1] != h or hi[2] < d:
            continue
        cos = _other(plain_mul, x)
        sin = _other(rot_mul, cat_v)
        if cos is None or sin is None or cos is x or sin is x or \
                not dtype_of(x) == dtype_of(cos) == dtype_of(sin):
            continue
        slices = [cat.inputs[1].producer, neg.inputs[0].producer]
        return x, cos, sin, slices + [neg, cat, rot_mul, plain_mul, add]
    return None


def _apply(rw: Rewriter, m) -> str:
    x, cos, sin, nodes = m
    add = nodes[-1]
    fused = Node("RoPE", [x, cos, sin], [None], domain=KILN_DOMAIN, name=add.name)
    fused.outputs = [add.outputs[0]]
    rw.replace(nodes, [fused])
    return "rotary embedding fused"
