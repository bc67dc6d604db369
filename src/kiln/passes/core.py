"""The pass framework's base, below the rewrite engine and shape inference (which both
build on it): :class:`Pass` and :class:`PassRecord`, and the graph-editing helpers passes
share, on the IR's use-lists: replacing a value by another, bypassing a node, adding
constants, copying a model. ``kiln.passes.base`` adds the rule passes on top and
re-exports all of it.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from kiln.ir import DType, Graph, Model, Node, TensorType, Value


@dataclass
class PassRecord:
    """What one pass changed: counts per kind of change, the reasons its rules declined
    matches (``declined``, per "rule: reason", counted once per node), plus free notes."""

    name: str
    changes: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0
    declined: Counter = field(default_factory=Counter)

    def add(self, what: str, n: int = 1) -> None:
        """Count ``n`` changes of kind ``what``."""
        if n:
            self.changes[what] += n

    def __bool__(self) -> bool:
        return bool(self.changes)

    def __str__(self) -> str:
        if not self.changes:
            return f"{self.name}: no change"
        what = ", ".join(f"{k} x{v}" for k, v in sorted(self.changes.items()))
        return f"{self.name}: {what}"


class Pass:
    """A model-to-model transformation. Subclasses set ``name`` (what ``disable=`` uses)
    and ``level`` (the lowest optimization level that runs it) and implement ``run``."""

    name: ClassVar[str] = "pass"
    level: ClassVar[int] = 1
    """1: standard ONNX rewrites (the result runs anywhere); 2: Kiln's fused ops."""
    creates: ClassVar[tuple[str, ...]] = ()
    """Kiln-domain ops this pass may create (a backend without kernels for them skips it)."""
    analysis: ClassVar[bool] = False
    """Analyses (shape inference, placement) annotate; they do not rewrite."""

    def run(self, model: Model, record: PassRecord) -> None:
        raise NotImplementedError

    def __call__(self, model: Model) -> tuple[Model, PassRecord]:
        record = PassRecord(self.name)
        t0 = time.perf_counter()
        self.run(model, record)
        record.seconds = time.perf_counter() - t0
        return model, record


# ---------------------------------------------------------------- graph helpers

def graphs(g: Graph) -> Iterator[Graph]:
    """``g`` and every graph nested in its nodes' attributes, outermost first."""
    yield g
    for n in g.nodes:
        if n.attrs:  # asked about every node some 20 times an optimization: skip the call
            for sub in n.subgraphs():
                yield from graphs(sub)


def count_nodes(g: Graph) -> int:
    return sum(len(x.nodes) for x in graphs(g))


def op_histogram(g: Graph) -> Counter:
    return Counter(f"{n.domain}.{n.op_type}" if n.domain else n.op_type
                   for x in graphs(g) for n in x.nodes)


def replace_uses(g: Graph, old: Value, new: Value, outputs: bool = False) -> int:
    """Make every reader of ``old`` read ``new`` instead (through its use-list: O(uses)).
    ``g.outputs`` is changed only when ``outputs`` (output names are the model's interface);
    outputs of nested graphs always are. Returns the number of reads changed."""
    return g.replace_all_uses(old, new, outputs=outputs)


def bypass(g: Graph, src: Value, dst: Value) -> bool:
    """Make ``dst`` (the output of a node about to be removed) stand for ``src``.

    Readers of ``dst`` read ``src`` instead. When ``dst`` is an output of ``g`` its name must
    stay, so instead ``src``'s producer (a node of ``g``) is made to compute ``dst``
    directly. Returns False when neither is possible (the node must stay)."""
    if not dst.is_output_of(g):
        g.replace_all_uses(dst, src)
        return True
    prod = src.producer
    if prod is None or prod.graph is not g or src.is_output_of(g):
        return False
    prod.outputs = [dst if v is src else v for v in prod.outputs]
    g.replace_all_uses(src, dst)
    if dst.type is None:
        dst.type = src.type
    return True


def const_value(v: Value | None) -> np.ndarray | None:
    """The constant array of ``v``, unless it is unknown or a feed may override it."""
    if v is None or v.const is None or v.meta.get("overridable"):
        return None
    return v.const


def scalar_value(v: Value | None) -> float | None:
    """A constant holding one number (of any shape), as a Python float."""
    c = const_value(v)
    if c is None or c.size != 1 or c.dtype.kind not in "fiub":
        return None
    return float(c.reshape(-1)[0])


def add_const(g: Graph, name: str, array: np.ndarray) -> Value:
    """A new initializer of ``g`` (named ``name``, made unique)."""
    array = np.asarray(array, order="C")
    base, k = name, 1
    while name in g.initializers:
        name, k = f"{base}_{k}", k + 1
    v = Value(name, TensorType(DType.from_numpy(array.dtype), tuple(array.shape)), const=array)
    g.initializers[name] = v
    return v


def adopt_const(g: Graph, v: Value) -> None:
    """Register the constant ``v`` (from another graph) as an initializer of ``g``."""
    name, k = v.name, 1
    while name in g.initializers and g.initializers[name] is not v:
        name, k = f"{v.name}_{k}", k + 1
    g.initializers[name] = v


def make_const(v: Value, g: Graph, array: np.ndarray) -> None:
    """Turn ``v`` (a node output) into an initializer of ``g`` holding ``array``."""
    array = np.asarray(array, order="C")
    v.const = array
    v.producer = None
    v.type = TensorType(DType.from_numpy(array.dtype), tuple(array.shape))
    v.meta.pop("sym", None)
    adopt_const(g, v)


def fresh_value(like: Value | None, suffix: str, type=None) -> Value:
    """A new intermediate value named after ``like``."""
    name = f"{like.name}_{suffix}" if like is not None else suffix
    return Value(name, type if type is not None else None)


def tensor_type(v: Value | None) -> TensorType | None:
    return v.type if v is not None and isinstance(v.type, TensorType) else None


def shape_of(v: Value | None):
    t = tensor_type(v)
    return None if t is None else t.shape


def rank_of(v: Value | None) -> int | None:
    s = shape_of(v)
    return None if s is None else len(s)


def dtype_of(v: Value | None) -> DType | None:
    t = tensor_type(v)
    return None if t is None else t.dtype


# ---------------------------------------------------------------- copying a model

def clone_model(model: Model) -> Model:
    """A copy of ``model`` whose graphs, nodes and values are new objects; constant
    arrays and functions are shared (passes never write into an array)."""
    vmap: dict[Value, Value] = {}
    return replace(model, graph=_clone_graph(model.graph, vmap),
                   opset_imports=dict(model.opset_imports), functions=dict(model.functions),
                   metadata=dict(model.metadata))


def _cv(v: Value | None, vmap: dict[Value, Value]) -> Value | None:
    if v is None:
        return None
    c = vmap.get(v)
    if c is None:
        c = vmap[v] = Value(v.name, v.type, v.const)
        c.meta = dict(v.meta)
    return c


def _clone_attr(a: Any, vmap: dict[Value, Value]) -> Any:
    if isinstance(a, Graph):
        return _clone_graph(a, vmap)
    if isinstance(a, list):
        return [_clone_attr(x, vmap) for x in a]
    return a


def _clone_graph(g: Graph, vmap: dict[Value, Value]) -> Graph:
    ng = Graph(name=g.name, doc=g.doc)
    ng.initializers = {k: _cv(v, vmap) for k, v in g.initializers.items()}
    ng.inputs = [_cv(v, vmap) for v in g.inputs]
    for n in g.nodes:
        attrs = {k: _clone_attr(a, vmap) for k, a in n.attrs.items()}
        nn = Node(n.op_type, [_cv(v, vmap) for v in n.inputs],
                  [_cv(v, vmap) for v in n.outputs], attrs, domain=n.domain, name=n.name)
        nn.doc = n.doc
        ng.nodes.append(nn)
    ng.outputs = [_cv(v, vmap) for v in g.outputs]
    ng.value_info = {k: _cv(v, vmap) for k, v in g.value_info.items()}
    return ng
