"""Common-subexpression elimination: two nodes of one graph with the same op, the same
inputs and the same attributes compute the same thing, so the later one goes and its
readers read the earlier one's outputs. Identical constants are merged the same way
(exporters often write one weight several times, or wrap it in Identity nodes).

Both are rules: a node is looked up by its key (op, input values, attributes) in a table
that lives for the engine run, and each constant input by its bytes; merging queues the
readers, whose keys changed, so chains of duplicates merge in one run. Nodes with
subgraphs and non-deterministic ops (``OpDef.deterministic``) are never merged.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kiln.ir import Model, Node, Value
from kiln.ops.registry import lookup
from kiln.passes.base import PassRecord, RulePass, graphs
from kiln.passes.rewrite import Rewriter, Rule

_MAX_ATTR_BYTES = 1 << 16


class CommonSubexpressionElimination(RulePass):
    """Merge duplicate nodes and duplicate constants."""

    name = "cse"
    level = 1

    def rules(self) -> list[Rule]:
        return [Rule("duplicate constant", None, _match_constant, _merge_constant,
                     needs_types=False),
                Rule("duplicate node", None, _match_node, _merge_node, _check_node,
                     needs_types=False)]

    def finish(self, model: Model, record: PassRecord) -> None:
        if not record.changes.get("duplicate constants merged"):
            return
        for g in list(graphs(model.graph)):
            for k, v in list(g.initializers.items()):
                if v.meta.pop("cse_merged", False) and not v.is_used():
                    del g.initializers[k]


def _freeze(a):
    """A hashable stand-in for an attribute value (None when it cannot be compared)."""
    if isinstance(a, np.ndarray):
        if a.nbytes > _MAX_ATTR_BYTES or a.dtype == object:
            return None
        return ("array", a.dtype.str, a.shape, a.tobytes())
    if isinstance(a, float):
        return ("float", repr(a))
    if isinstance(a, list):
        items = tuple(_freeze(x) for x in a)
        return None if any(x is None for x in items) else ("list", items)
    if isinstance(a, (int, str, bool)) or a is None:
        return (type(a).__name__, a)
    try:
        hash(a)
    except TypeError:
        return None
    return ("obj", a)


def deterministic(n: Node, opset: int) -> bool:
    """Whether running ``n`` twice gives the same result (unknown ops are assumed so)."""
    d = lookup(n.domain, n.op_type, opset)
    return d is None or d.deterministic


def _key(n: Node, opset: int, deterministic_ops: dict):
    if n.subgraphs() or not n.outputs:
        return None
    op = (n.domain, n.op_type, opset)
    det = deterministic_ops.get(op)
    if det is None:  # one registry lookup per op type and run, not per node
        det = deterministic_ops[op] = deterministic(n, opset)
    if not det:
        return None
    attrs = []
    for k in sorted(n.attrs):
        f = _freeze(n.attrs[k])
        if f is None:
            return None
        attrs.append((k, f))
    return (id(n.graph), n.domain, n.op_type,
            tuple(id(v) if v is not None else None for v in n.inputs), tuple(attrs),
            len(n.outputs))


def _match_node(rw: Rewriter, n: Node):
    """(kept, merged): an earlier live node with ``n``'s key (the table keeps the earliest
    node per key; entries whose node changed or went are replaced)."""
    for v in n.inputs:
        # A node alone in reading a computed value has no duplicate. Should another node
        # come to read it, the engine queues the value's readers again (touch's radius).
        if v is not None and v.producer is not None and v.only_reader(n):
            return None
    det = rw.state.setdefault("cse_deterministic", {})
    key = _key(n, rw.opset(n), det)
    if key is None:
        return None
    table = rw.state.setdefault("cse", {})
    first = table.get(key)
    if first is None or first is n or first.graph is None or \
            _key(first, rw.opset(first), det) != key:
        table[key] = n
        return None
    if rw.order[first] > rw.order[n]:
        table[key] = n
        first, n = n, first
    return first, n


def _check_node(rw: Rewriter, m) -> str | None:
    first, n = m
    if rw.order[first] == rw.order[n]:
        return "both replace the same node: their order is unknown"
    pairs = [(a, b) for a, b in zip(first.outputs, n.outputs) if b is not None]
    if any(a is None for a, _ in pairs):
        return "the kept node lacks an output the other computes"
    if any(b.is_output_of(n.graph) for _, b in pairs):
        return "an output is a graph output (its name is the interface)"
    return None


def _merge_node(rw: Rewriter, m) -> str:
    first, n = m
    for a, b in zip(first.outputs, n.outputs):
        if b is not None:
            rw.replace_all_uses(b, a, keep_outputs_of=n.graph)
    rw.remove(n)
    return "duplicate nodes merged"


def _bytes(a: np.ndarray) -> np.ndarray:
    """The raw bytes of ``a`` (bitwise comparison: NaNs equal, -0.0 != 0.0)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _fingerprint(a: np.ndarray) -> bytes:
    """A cheap digest for telling constants apart: all bytes of small arrays, a strided
    sample of big ones (equal fingerprints are confirmed by a full comparison)."""
    flat = _bytes(a)
    if flat.size > 4096:
        flat = np.concatenate([flat[:1024], flat[:: max(1, flat.size // 2048)][:2048]])
    return hashlib.blake2b(flat).digest()


def _mergeable(v: Value | None, n: Node) -> bool:
    return v is not None and v.const is not None and not v.meta.get("overridable") and \
        v.const.dtype != object and n.graph.initializers.get(v.name) is v


def _canonical(rw: Rewriter, n: Node, v: Value) -> Value:
    """The first constant of ``n``'s graph with ``v``'s dtype, shape and bytes."""
    table = rw.state.setdefault("cse_const", {})
    prints = rw.state.setdefault("cse_print", {})
    const = v.const
    seen = prints.get(v)
    if seen is None or seen[0] is not const:  # a value may be given a new array
        seen = prints[v] = (const, _fingerprint(const))
    bucket = table.setdefault((id(n.graph), const.dtype.str, const.shape, seen[1]), [])
    for c in bucket:
        if c is v:
            return v
        if c.const is not None and n.graph.initializers.get(c.name) is c and \
                np.array_equal(_bytes(c.const), _bytes(const)):
            return c
    bucket.append(v)
    return v


def _match_constant(rw: Rewriter, n: Node):
    firsts = rw.state.setdefault("cse_firsts", set())
    for i, v in enumerate(n.inputs):
        # a constant found to be the first of its bytes stays so: many nodes read one
        if v is not None and v not in firsts and _mergeable(v, n):
            c = _canonical(rw, n, v)
            if c is v:
                firsts.add(v)
            elif not v.is_output_of(n.graph):
                return n, i, v, c
    return None


def _merge_constant(rw: Rewriter, m) -> str:
    n, _, v, c = m
    for i, x in enumerate(n.inputs):
        if x is v:
            rw.set_input(n, i, c)
    merged = rw.state.setdefault("cse_merged", set())
    v.meta["cse_merged"] = True
    if v in merged:
        return ""
    merged.add(v)
    return "duplicate constants merged"
