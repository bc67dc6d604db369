"""Common-subexpression elimination: two nodes of one graph with the same op, the same
inputs and the same attributes compute the same thing, so the second one goes and its
readers read the first one's outputs. Identical constants are merged the same way
(exporters often write one weight several times, or wrap it in Identity nodes).

Nodes with subgraphs and random ops are never merged. Runs per graph, in order, so
merging one node makes its readers candidates too.
"""

from __future__ import annotations

import hashlib

import numpy as np

from kiln.ir import Graph, Model, Node, Value
from kiln.passes.base import Pass, PassRecord, bypass, graphs, rebuild, replace_uses
from kiln.passes.fold_constants import NONDETERMINISTIC

_MAX_ATTR_BYTES = 1 << 16


class CommonSubexpressionElimination(Pass):
    """Merge duplicate nodes and duplicate constants."""

    name = "cse"
    level = 1

    def run(self, model: Model, record: PassRecord) -> None:
        for g in list(graphs(model.graph)):
            merge_constants(g, record)
            merge_nodes(g, record)


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


def _key(n: Node):
    if n.op_type in NONDETERMINISTIC or any(True for _ in n.subgraphs()) or not n.outputs:
        return None
    attrs = []
    for k in sorted(n.attrs):
        f = _freeze(n.attrs[k])
        if f is None:
            return None
        attrs.append((k, f))
    return (n.domain, n.op_type, tuple(id(v) if v is not None else None for v in n.inputs),
            tuple(attrs), len(n.outputs))


def merge_nodes(g: Graph, record: PassRecord) -> None:
    seen: dict = {}
    remove: set[Node] = set()
    for n in g.nodes:
        key = _key(n)
        if key is None:
            continue
        first = seen.get(key)
        if first is None:
            seen[key] = n
            continue
        pairs = [(a, b) for a, b in zip(first.outputs, n.outputs) if b is not None]
        if any(a is None for a, _ in pairs):
            continue
        if any(b in g.outputs for _, b in pairs):
            continue  # output names are the interface; keep it simple and leave these
        for a, b in pairs:
            bypass(g, a, b)
        remove.add(n)
    if remove:
        rebuild(g, remove)
        record.add("duplicate nodes merged", len(remove))


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


def merge_constants(g: Graph, record: PassRecord) -> None:
    groups: dict = {}
    for v in g.initializers.values():
        if v.meta.get("overridable") or v.const is None or v.const.dtype == object:
            continue
        groups.setdefault((v.const.dtype.str, v.const.shape), []).append(v)
    merged = 0
    for vals in groups.values():
        if len(vals) < 2:
            continue
        by_hash: dict[bytes, Value] = {}
        for v in vals:
            h = _fingerprint(v.const)
            first = by_hash.get(h)
            if first is None:
                by_hash[h] = v
                continue
            if v in g.outputs or not np.array_equal(_bytes(first.const), _bytes(v.const)):
                continue
            replace_uses(g, v, first)
            merged += 1
    if merged:
        used = {id(x) for sub in graphs(g) for n in sub.nodes for x in n.inputs} | \
            {id(x) for x in g.outputs}
        for k in [k for k, v in g.initializers.items() if id(v) not in used and
                  not v.meta.get("overridable")]:
            del g.initializers[k]
        record.add("duplicate constants merged", merged)
