"""Cost rules op definitions point at (``@op(..., cost=...)``): estimated floating-point
operations of one node from concrete shapes. A multiply-add counts 2. Each rule takes
``(node, input_shapes, output_shapes)`` (tuples of ints, None where unknown) and returns
FLOPs or None when a shape it needs is unknown."""

from __future__ import annotations

from collections.abc import Callable
from math import prod

Shapes = list[tuple[int, ...] | None]


def _first(shapes: Shapes):
    return shapes[0] if shapes else None


def elementwise(node, ins: Shapes, outs: Shapes) -> int | None:
    """One operation per output element."""
    y = _first(outs)
    return None if y is None else prod(y)


def per_element(k: int) -> Callable:
    """``k`` operations per output element (normalizations, softmax)."""

    def rule(node, ins: Shapes, outs: Shapes) -> int | None:
        y = _first(outs)
        return None if y is None else k * prod(y)
    return rule


def reduce(node, ins: Shapes, outs: Shapes) -> int | None:
    """One operation per input element."""
    x = _first(ins)
    return None if x is None else prod(x)


def conv(weight: int = 1) -> Callable:
    """Convolutions: each output does C/group x kernel multiply-adds, plus the bias; the
    weight is input ``weight``."""

    def rule(node, ins: Shapes, outs: Shapes) -> int | None:
        y, w = _first(outs), ins[weight] if weight < len(ins) else None
        if y is None or w is None or len(y) < 2 or len(w) < 2:
            return None
        return 2 * prod(y) * prod(w[1:]) + prod(y)
    return rule


def conv_transpose(node, ins: Shapes, outs: Shapes) -> int | None:
    x, w = _first(ins), ins[1] if len(ins) > 1 else None
    if x is None or w is None or len(x) < 2 or len(w) < 2:
        return None
    return 2 * prod(x) * prod(w[1:])


def matmul(node, ins: Shapes, outs: Shapes) -> int | None:
    a, y = _first(ins), _first(outs)
    if a is None or y is None or not a:
        return None
    return 2 * prod(y) * a[-1]


def gemm(node, ins: Shapes, outs: Shapes) -> int | None:
    a, y = _first(ins), _first(outs)
    if a is None or y is None or len(a) != 2:
        return None
    k = a[0] if node.attrs.get("transA", 0) else a[1]
    bias = len(node.inputs) > 2 and node.inputs[2] is not None
    return 2 * prod(y) * k + (prod(y) if bias else 0)


def attention(node, ins: Shapes, outs: Shapes) -> int | None:
    """Two batched products (scores and weighted values): 4-D query and key, or 3-D ones
    whose last axis holds the heads (Kiln's ``num_heads``); Kiln's ``k_transposed`` key is
    [..., d, s_k]."""
    q, k = _first(ins), ins[1] if len(ins) > 1 else None
    if q is None or k is None or len(q) != len(k) or len(q) not in (3, 4):
        return None
    if len(q) == 3:
        b, s, e = q
        return 4 * b * s * k[1] * e
    b, h, s, d = q
    return 4 * b * h * s * k[3 if node.attrs.get("k_transposed") else 2] * d


def pool(node, ins: Shapes, outs: Shapes) -> int | None:
    """One operation per output element and kernel position."""
    y, ks = _first(outs), node.attrs.get("kernel_shape")
    return None if y is None or not ks else prod(y) * prod(ks)
