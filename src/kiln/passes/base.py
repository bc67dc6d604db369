"""The pass framework: a :class:`Pass` takes a Model and returns it with a
:class:`PassRecord` of what it changed; a :class:`PassManager` runs a pipeline of passes
again and again until none changes anything (or an iteration bound is hit).

Also the graph-editing helpers every pass shares: who reads a value, replacing a value
by another, bypassing a node, adding constants. Passes never edit a list while iterating
over it: they collect what to remove or insert and rebuild ``graph.nodes`` once.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from kiln.ir import DType, Graph, Model, Node, TensorType, Value


@dataclass
class PassRecord:
    """What one run of one pass changed: counts per kind of change, plus free notes."""

    name: str
    changes: Counter = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def add(self, what: str, n: int = 1) -> None:
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
    """Analyses (shape inference, placement) annotate; their changes alone do not ask the
    pass manager for another iteration."""

    def run(self, model: Model, record: PassRecord) -> None:
        raise NotImplementedError

    def __call__(self, model: Model) -> tuple[Model, PassRecord]:
        record = PassRecord(self.name)
        t0 = time.perf_counter()
        self.run(model, record)
        record.seconds = time.perf_counter() - t0
        return model, record


@dataclass
class OptimizeReport:
    """Everything a pipeline did to a model: per pass and iteration, and the totals."""

    nodes_before: int = 0
    nodes_after: int = 0
    ops_before: Counter = field(default_factory=Counter)
    ops_after: Counter = field(default_factory=Counter)
    records: list[tuple[int, PassRecord]] = field(default_factory=list)
    iterations: int = 0
    seconds: float = 0.0
    converged: bool = True

    def by_pass(self) -> dict[str, Counter]:
        """Changes summed over iterations, per pass."""
        out: dict[str, Counter] = {}
        for _, r in self.records:
            out.setdefault(r.name, Counter()).update(r.changes)
        return out

    def summary(self) -> str:
        lines = [f"nodes {self.nodes_before} -> {self.nodes_after} in {self.iterations} "
                 f"iteration(s), {self.seconds * 1e3:.0f} ms"
                 + ("" if self.converged else " (iteration bound hit)")]
        for name, changes in self.by_pass().items():
            if changes:
                lines.append(f"  {name}: " + ", ".join(f"{k} x{v}" for k, v in
                                                       sorted(changes.items())))
        return "\n".join(lines)


class PassManager:
    """Runs ``passes`` in order, repeatedly, until an iteration changes nothing or
    ``max_iterations`` is reached. Passes named in ``disable`` are skipped."""

    def __init__(self, passes: Iterable[Pass], max_iterations: int = 8,
                 disable: Iterable[str] = ()):
        self.passes = list(passes)
        self.max_iterations = max_iterations
        self.disable = set(disable)

    def run(self, model: Model, report: OptimizeReport | None = None
            ) -> tuple[Model, OptimizeReport]:
        report = report if report is not None else OptimizeReport()
        active = [p for p in self.passes if p.name not in self.disable]
        t0 = time.perf_counter()
        report.converged = False
        for _ in range(self.max_iterations):
            changed = False
            for p in active:
                model, rec = p(model)
                report.records.append((report.iterations, rec))
                changed |= bool(rec) and not p.analysis
            report.iterations += 1
            if not changed:
                report.converged = True
                break
        report.seconds += time.perf_counter() - t0
        return model, report


# ---------------------------------------------------------------- graph helpers

def graphs(g: Graph) -> Iterator[Graph]:
    """``g`` and every graph nested in its nodes' attributes, outermost first."""
    yield g
    for n in g.nodes:
        for sub in n.subgraphs():
            yield from graphs(sub)


def count_nodes(g: Graph) -> int:
    return sum(1 for _ in g.walk())


def op_histogram(g: Graph) -> Counter:
    return Counter((f"{n.domain}." if n.domain else "") + n.op_type for _, n in g.walk())


class Uses:
    """Who reads each value of a graph: its nodes and those of nested subgraphs, and
    whether it is an output of the graph (or of a nested one)."""

    def __init__(self, g: Graph):
        self.readers: dict[Value, list[Node]] = {}
        self.outputs: Counter = Counter()
        for sub in graphs(g):
            for n in sub.nodes:
                for v in n.inputs:
                    if v is not None:
                        self.readers.setdefault(v, []).append(n)
            self.outputs.update(sub.outputs)
        self.graph_outputs = set(g.outputs)

    def consumers(self, v: Value) -> list[Node]:
        return self.readers.get(v, [])

    def count(self, v: Value) -> int:
        """Number of reads of ``v`` (a node reading it twice counts twice), outputs
        included."""
        return len(self.readers.get(v, ())) + self.outputs[v]

    def only_reader(self, v: Value, node: Node) -> bool:
        """True when ``node`` is the one and only use of ``v`` (it may read it once)."""
        return self.outputs[v] == 0 and self.readers.get(v, []) == [node]

    def used(self, v: Value) -> bool:
        return self.count(v) > 0


def producers(g: Graph) -> dict[Value, Node]:
    """Value -> the node of ``g`` (not of nested graphs) that computes it."""
    return {v: n for n in g.nodes for v in n.outputs if v is not None}


def replace_uses(g: Graph, old: Value, new: Value, outputs: bool = False) -> int:
    """Make every reader of ``old`` in ``g`` (and nested graphs) read ``new`` instead.
    ``g.outputs`` is changed only when ``outputs`` (output names are the model's interface);
    outputs of nested graphs always are. Returns the number of reads changed."""
    n_changed = 0
    for sub in graphs(g):
        for n in sub.nodes:
            if any(v is old for v in n.inputs):
                n.inputs = [new if v is old else v for v in n.inputs]
                n_changed += 1
        if (sub is not g or outputs) and any(v is old for v in sub.outputs):
            sub.outputs = [new if v is old else v for v in sub.outputs]
    return n_changed


def bypass(g: Graph, src: Value, dst: Value) -> bool:
    """Make ``dst`` (the output of a node about to be removed) stand for ``src``.

    Readers of ``dst`` read ``src`` instead. When ``dst`` is an output of ``g`` its name must
    stay, so instead ``src``'s producer (a node of ``g``) is made to compute ``dst``
    directly. Returns False when neither is possible (the node must stay)."""
    if dst not in g.outputs:
        replace_uses(g, dst, src)
        return True
    prod = producers(g).get(src)
    if prod is None or src in g.outputs:
        return False
    prod.outputs = [dst if v is src else v for v in prod.outputs]
    dst.producer, src.producer = prod, None
    replace_uses(g, src, dst)
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


def rebuild(g: Graph, remove: set[Node], insert: dict[Node, list[Node]] | None = None) -> None:
    """Rebuild ``g.nodes`` without ``remove``, placing ``insert[n]`` where ``n`` was
    (before ``n`` when ``n`` stays)."""
    insert = insert or {}
    out: list[Node] = []
    for n in g.nodes:
        out.extend(insert.get(n, ()))
        if n not in remove:
            out.append(n)
    g.nodes = out


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
