"""Values that follow from the inputs' shapes alone, computed once per input shape.

Models exported with dynamic dims compute position ids, attention masks and reshape
targets from ``Shape`` at every run: BERT's export spends 28 of its 76 layers on it. For
a given set of input shapes those layers always give the same values, so a plan's
program runs them on the first run with new input shapes, keeps what the other layers
read, and skips them afterwards (:class:`kiln.runtime.executor.Program`).

A step qualifies when its op is deterministic, it has no subgraphs, nothing returns its
outputs, and every input is a constant, an output of a qualifying step, or, for
``Shape``/``Size``, a value whose shape is known in terms of the inputs' dims: a graph
input, or a value whose inferred shape has only fixed dims and the inputs' symbols. That
is the same trust in shape inference the optimizer's folding of ``Shape`` puts in it, so
only plans of optimized models use it.
"""

from __future__ import annotations

from kiln.ir import SymDim, TensorType, Value
from kiln.ops import registry

MAX_SHAPES = 16
"""Input shapes remembered per program; later new shapes run every layer."""
MAX_BYTES = 64 << 20
"""Memory the remembered values of one program may hold (a long sequence's causal mask
is large): shapes past it run every layer."""


def nbytes(values) -> int:
    """Memory held by ``values`` (arrays of any backend; other values count 0)."""
    total = 0
    for x in values:
        n = getattr(x, "nbytes", None)
        total += n if isinstance(n, int) else 0
    return total


def shape_steps(plan) -> tuple[frozenset[int], tuple[Value, ...]]:
    """(indices of the steps computed once per input shape, the values of theirs that the
    other steps read), or empty ones when the plan has none worth it."""
    inputs = set(plan.graph.inputs)
    symbols: set[str] = set()
    for v in inputs:
        if not isinstance(v.type, TensorType) or v.type.shape is None:
            return frozenset(), ()
        for d in v.type.shape:
            if isinstance(d, SymDim):
                symbols |= d.symbols

    def shape_known(v: Value | None) -> bool:
        if v is None:
            return False
        if v in inputs:
            return True
        t = v.type
        return isinstance(t, TensorType) and t.shape is not None and all(
            isinstance(d, int) or isinstance(d, SymDim) and d.symbols <= symbols
            for d in t.shape)

    returned = set(plan.graph.outputs)
    known: set[Value] = set(plan.consts)
    chosen: set[int] = set()
    for j, s in enumerate(plan.steps):
        n = s.node
        opdef = registry.lookup(n.domain, n.op_type, s.opset)
        if opdef is None or not opdef.deterministic or s.subplans or \
                any(v in returned for v in s.outputs):
            continue
        if n.domain == "" and n.op_type in ("Shape", "Size"):
            ok = shape_known(s.inputs[0])
        else:
            ok = all(v is None or v in known for v in s.inputs)
        if ok:
            chosen.add(j)
            known.update(v for v in s.outputs if v is not None)
    read = {v for j, s in enumerate(plan.steps) if j not in chosen
            for v in s.inputs if v is not None}
    read |= {v for s in plan.steps for g in s.node.subgraphs() for v in g.captures()}
    frontier = tuple(dict.fromkeys(v for j in sorted(chosen) for v in plan.steps[j].outputs
                                   if v is not None and v in read))
    if not frontier:
        return frozenset(), ()
    return frozenset(chosen), frontier
