"""A small pattern language for rewrite rules: a rule is a pattern of ops over variables
and constants, and what it becomes.

    X = Var("x")
    rule = pattern_rule("x * 1", Op("Mul", X, Const(equals(1)), commutative=True), X)

``Op(op_type, *inputs)`` matches a standard-domain node of that type whose inputs match
(nested ops through producers in the same graph; ``commutative``: either order of two
inputs); ``Var(name)`` matches any value, the same value wherever the name repeats;
``Const(test)`` a constant (never one a feed may override) for which ``test(array)`` holds.
The result is a ``Var`` (the root's readers read that value) or an ``Op`` over the
pattern's variables (a new node computing the root's output).

A result that is a ``Var`` must be a no-op: the rule declines (and says so in the report)
unless the value has exactly the root output's element type and a shape known equal to
it, so an identity constant that broadcasts (``x[3] * ones[2, 3]``) or promotes is never
dropped. ``where(rw, bindings) -> reason | None`` adds a check of the rule's own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir import Node, Value
from kiln.ops import symdim
from kiln.passes.base import const_value, dtype_of, fresh_value, shape_of
from kiln.passes.rewrite import Rewriter, Rule, ops, producer


@dataclass(frozen=True)
class Var:
    """Any value, bound to ``name`` (the same value wherever the name repeats)."""

    name: str


@dataclass(frozen=True)
class Const:
    """A constant whose array passes ``test``."""

    test: Callable[[np.ndarray], bool]


@dataclass(frozen=True)
class Op:
    """A standard op with these input patterns (``commutative``: two inputs, any order)."""

    op_type: str
    inputs: tuple[Pattern, ...]
    commutative: bool = False

    def __init__(self, op_type: str, *inputs: Pattern, commutative: bool = False):
        object.__setattr__(self, "op_type", op_type)
        object.__setattr__(self, "inputs", inputs)
        object.__setattr__(self, "commutative", commutative)


Pattern = Var | Const | Op
Bindings = dict[str, Value]


def match(pattern: Op, node: Node) -> Bindings | None:
    """The variables' values where ``pattern`` matches at ``node`` (None: no match)."""
    found: Bindings = {}
    return found if _node(pattern, node, found) else None


def _node(p: Op, n: Node, b: Bindings) -> bool:
    if n.op_type != p.op_type or n.domain != "" or len(n.inputs) != len(p.inputs):
        return False
    orders = [n.inputs]
    if p.commutative and len(n.inputs) == 2:
        orders.append(n.inputs[::-1])
    for inputs in orders:
        trial = dict(b)
        if all(_value(q, v, n, trial) for q, v in zip(p.inputs, inputs)):
            b.update(trial)
            return True
    return False


def _value(p: Pattern, v: Value | None, reader: Node, b: Bindings) -> bool:
    if v is None:
        return False
    if isinstance(p, Var):
        return b.setdefault(p.name, v) is v
    if isinstance(p, Const):
        c = const_value(v)
        return c is not None and c.size > 0 and bool(p.test(c))
    inner = producer(v, reader, p.op_type)
    return inner is not None and _node(p, inner, b)


def pattern_rule(name: str, pattern: Op, result: Var | Op,
                 where: Callable[[Rewriter, Bindings], str | None] | None = None) -> Rule:
    """A :class:`~kiln.passes.rewrite.Rule` rewriting ``pattern`` into ``result``."""
    label = f"{name} simplified"

    def match_(rw: Rewriter, n: Node):
        b = match(pattern, n)
        return None if b is None else (n, b)

    def check(rw: Rewriter, m: tuple[Node, Bindings]) -> str | None:
        n, b = m
        if isinstance(result, Var):
            why = _no_op(b[result.name], n)
            if why:
                return why
        return where(rw, b) if where is not None else None

    def apply(rw: Rewriter, m: tuple[Node, Bindings]) -> str | None:
        n, b = m
        out = n.outputs[0]
        if isinstance(result, Var):
            if not rw.bypass(b[result.name], out):
                return None
            rw.remove(n)
            return label
        new = _build(result, b, n)
        new[-1].outputs = [out]
        rw.replace([n], new)
        return label

    return Rule(name, ops(pattern.op_type), match_, apply, check)


def _no_op(src: Value, n: Node) -> str | None:
    """Why the root's output cannot simply be ``src`` (None: it can)."""
    out = n.outputs[0]
    if len(n.outputs) != 1 or out is None:
        return "the node has other outputs"
    if dtype_of(src) is None or dtype_of(src) != dtype_of(out):
        return "the result's element type differs or is unknown"
    a, c = shape_of(src), shape_of(out)
    if a is None or c is None or len(a) != len(c) or \
            not all(symdim.same(x, y) for x, y in zip(a, c)):
        return "the constant may broadcast the result to another shape"
    if out.is_output_of(n.graph) and (src.producer is None or src.producer.graph is not n.graph
                                      or src.is_output_of(n.graph)):
        return "its output is a graph output computed from a graph input"
    return None


def _build(p: Op, b: Bindings, root: Node) -> list[Node]:
    """Nodes computing ``p`` over the bound values, innermost first (the last computes
    the root's output)."""
    nodes: list[Node] = []
    inputs: list[Any] = []
    for q in p.inputs:
        if isinstance(q, Var):
            inputs.append(b[q.name])
        elif isinstance(q, Op):
            nodes += _build(q, b, root)
            inputs.append(nodes[-1].outputs[0])
        else:
            raise TypeError("a result pattern is made of ops and variables only")
    suffix = f"{p.op_type.lower()}{len(nodes)}"
    nodes.append(Node(p.op_type, inputs, [fresh_value(root.outputs[0], suffix)],
                      name=f"{root.name}_{suffix}"))
    return nodes


# -- constant tests ------------------------------------------------------------------------

def equals(value: float) -> Callable[[np.ndarray], bool]:
    """Every element equals ``value`` (and, for a float zero, has its sign)."""
    def test(c: np.ndarray) -> bool:
        if c.dtype.kind not in "fiub":
            return False
        if not np.all(c == value):
            return False
        if value == 0 and c.dtype.kind == "f":
            return bool(np.all(np.signbit(c) == np.signbit(value)))
        return True
    return test
