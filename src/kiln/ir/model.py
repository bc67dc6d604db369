"""The graph IR: Model, Graph, Node, Value and Function.

Values are objects, not names: a Node's inputs point at the Value objects produced
elsewhere (possibly in an enclosing graph, for subgraphs of If/Loop/Scan). Names are kept
for export and messages. Constants (initializers) are Values with ``const`` set.

Every Value knows its producer and its uses: the ``(node, input index)`` pairs reading it,
nodes of nested subgraphs that capture it included, and the graphs returning it as an
output. The use-lists are kept by the mutation API (``Node.set_input``, ``Node.inputs = ...``,
``Graph.append``/``insert_before``/``remove_node``, ``Value.replace_all_uses_with``) and
by ``graph.nodes``/``graph.outputs``, lists that report what enters and leaves them. Only
nodes that belong to a live graph (the main graph, a function body, the subgraph of a node
that is itself live) count as uses, so a node built and thrown away, or removed, leaves no
trace. :func:`check_uses` verifies it all (the tests run it after optimizing).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from kiln.ir.types import TensorType, ValueType


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a model or plan is built, then put it
    back as it was. Building creates objects by the million that all survive, and each
    collection of the oldest generation walks every one of them: 2 of the 9 s of loading a
    200,000-node chain and 3.7 of the 7 s of building its session. Nothing built here is
    garbage until the build is over (refcounting still frees what is dropped)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class Use(NamedTuple):
    """One read of a value: ``node.inputs[index]``."""

    node: Node
    index: int


class Value:
    """A named value flowing between nodes: graph input, initializer or node output."""

    __slots__ = ("name", "type", "producer", "const", "meta", "_uses", "_returned_by")

    def __init__(self, name: str, type: ValueType | None = None, const: np.ndarray | None = None):
        self.name = name
        self.type = type
        self.producer: Node | None = None
        self.const = const
        self.meta: dict[str, Any] = {}
        # dicts, not lists: insertion-ordered with O(1) removal
        self._uses: dict[tuple[Node, int], None] = {}
        self._returned_by: dict[Graph, int] = {}

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @property
    def shape(self):
        return self.type.shape if isinstance(self.type, TensorType) else None

    @property
    def dtype(self):
        return self.type.dtype if isinstance(self.type, TensorType) else None

    def described_type(self) -> ValueType | None:
        """The type to describe this value by (onnxruntime's ``get_outputs``, a saved file):
        the computed ``type``, taking the dim names of what the file declared
        (``meta["declared"]``) where the two agree. Never used to compute anything: a file's
        declaration is a claim, and where it contradicts the computed type it is dropped."""
        t, said = self.type, self.meta.get("declared")
        if said is None:
            return t
        if t is None:
            return said
        if not isinstance(t, TensorType):  # sequences, maps, optionals: as computed
            return t
        if not (isinstance(t, TensorType) and isinstance(said, TensorType)) or \
                t.dtype != said.dtype or t.shape is None or said.shape is None or \
                len(t.shape) != len(said.shape):
            return t if t.shape is not None or not isinstance(said, TensorType) or \
                t.dtype != said.dtype else said
        if any(isinstance(a, int) and isinstance(b, int) and a != b
               for a, b in zip(t.shape, said.shape)):
            return t
        return TensorType(t.dtype, tuple(a if isinstance(a, int) or b is None else b
                                         for a, b in zip(t.shape, said.shape)))

    @property
    def uses(self) -> list[Use]:
        """Every ``(node, input index)`` reading this value, in the order they were made."""
        return [Use(n, i) for n, i in self._uses]

    def readers(self) -> Iterator[Node]:
        """The node of every read of this value (a node reading it twice comes twice)."""
        return (n for n, _ in self._uses)

    @property
    def num_reads(self) -> int:
        """Reads by nodes (graph outputs not counted)."""
        return len(self._uses)

    @property
    def is_returned(self) -> bool:
        """Whether some graph returns this value as an output."""
        return bool(self._returned_by)

    def consumers(self) -> list[Node]:
        """The nodes reading this value (each once), nested subgraphs' nodes included."""
        return list(dict.fromkeys(n for n, _ in self._uses))

    def output_of(self) -> list[Graph]:
        """The graphs returning this value as one of their outputs."""
        return list(self._returned_by)

    def is_output_of(self, g: Graph) -> bool:
        return g in self._returned_by

    @property
    def num_uses(self) -> int:
        """Reads by nodes plus appearances among graph outputs."""
        return len(self._uses) + sum(self._returned_by.values())

    def is_used(self) -> bool:
        return bool(self._uses) or bool(self._returned_by)

    def only_reader(self, node: Node) -> bool:
        """True when ``node`` is the one use of this value (it may read it more than once),
        and no graph returns it."""
        return not self._returned_by and bool(self._uses) and \
            all(n is node for n, _ in self._uses)

    def replace_all_uses_with(self, new: Value, keep_outputs_of: Graph | None = None) -> int:
        """Make every reader of this value read ``new`` and every graph returning it return
        ``new`` (except ``keep_outputs_of``, whose output names are an interface). Returns
        the number of reads changed."""
        if new is self:
            return 0
        uses = list(self._uses)
        for n, i in uses:
            n.set_input(i, new)
        for g in list(self._returned_by):
            if g is not keep_outputs_of:
                g.outputs.replace(self, new)
        return len(uses)

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {self.type})"


@dataclass(frozen=True)
class AttrRef:
    """Inside a function body: an attribute whose value is the caller's attribute ``name``."""

    name: str


class Node:
    """One layer: an operator application. Missing optional inputs/outputs are None.

    ``inputs``/``outputs`` read as lists; assign them (or use :meth:`set_input`) rather
    than editing them in place, so use-lists and producers stay right. ``graph`` is the
    graph the node belongs to (None while detached)."""

    __slots__ = ("name", "op_type", "domain", "_inputs", "_outputs", "attrs", "doc", "graph",
                 "_live")

    def __init__(self, op_type: str, inputs: list[Value | None], outputs: list[Value | None],
                 attrs: dict[str, Any] | None = None, domain: str = "", name: str = ""):
        self.op_type = op_type
        self.domain = domain
        self.name = name
        self._inputs: list[Value | None] = list(inputs)
        self._outputs: list[Value | None] = list(outputs)
        self.attrs = dict(attrs or {})
        self.doc = ""
        self.graph: Graph | None = None
        self._live = False
        for v in self._outputs:
            if v is not None:
                v.producer = self
        for g in self.subgraphs():
            g.owner = self

    # -- inputs and outputs
    @property
    def inputs(self) -> list[Value | None]:
        return self._inputs

    @inputs.setter
    def inputs(self, values: Iterable[Value | None]) -> None:
        values = list(values)
        if self._live:
            self._unregister_inputs()
            self._inputs = values
            self._register_inputs()
        else:
            self._inputs = values

    def set_input(self, i: int, v: Value | None) -> None:
        """Make input ``i`` read ``v`` (``None``: the optional input is missing)."""
        ins = self._inputs
        while len(ins) <= i:
            ins.append(None)
        old = ins[i]
        if old is v:
            return
        if self._live:
            if old is not None:
                old._uses.pop((self, i), None)
            if v is not None:
                v._uses[(self, i)] = None
        ins[i] = v

    def replace_input(self, old: Value, new: Value | None) -> int:
        """Every input reading ``old`` reads ``new`` instead; returns how many."""
        k = 0
        for i, v in enumerate(self._inputs):
            if v is old:
                self.set_input(i, new)
                k += 1
        return k

    @property
    def outputs(self) -> list[Value | None]:
        return self._outputs

    @outputs.setter
    def outputs(self, values: Iterable[Value | None]) -> None:
        """New output values; an attached node becomes their producer."""
        values = list(values)
        if self.graph is not None:
            for v in self._outputs:
                if v is not None and v.producer is self and v not in values:
                    v.producer = None
            for v in values:
                if v is not None:
                    v.producer = self
        self._outputs = values

    def subgraphs(self) -> list[Graph]:
        """The graphs held in this node's attributes (If branches, Loop/Scan bodies)."""
        if not self.attrs:  # most nodes: asked once per node by every pass and the plan
            return []
        out: list[Graph] = []
        for a in self.attrs.values():
            if isinstance(a, Graph):
                out.append(a)
            elif isinstance(a, list) and a and isinstance(a[0], Graph):
                out.extend(a)
        return out

    # -- use-list bookkeeping (called by Graph)
    def _register_inputs(self) -> None:
        for i, v in enumerate(self._inputs):
            if v is not None:
                v._uses[(self, i)] = None

    def _unregister_inputs(self) -> None:
        for i, v in enumerate(self._inputs):
            if v is not None:
                v._uses.pop((self, i), None)

    def _set_live(self, live: bool) -> None:
        if self._live == live:
            return
        self._live = live
        if live:
            for i, v in enumerate(self._inputs):
                if v is not None:
                    v._uses[(self, i)] = None
        else:
            self._unregister_inputs()
        for g in self.subgraphs():
            g._set_live(live)

    def __repr__(self) -> str:
        ins = ", ".join(v.name if v else "" for v in self._inputs)
        outs = ", ".join(v.name if v else "" for v in self._outputs)
        dom = f"{self.domain}." if self.domain else ""
        return f"<{dom}{self.op_type} {self.name!r}: ({ins}) -> ({outs})>"


class _TrackedList(list):
    """A list that reports every item entering (``added``) or leaving (``removed``) it."""

    __slots__ = ("_added", "_removed")

    def __init__(self, items: Iterable, added: Callable[[Any], None],
                 removed: Callable[[Any], None]):
        super().__init__(items)
        self._added, self._removed = added, removed
        for x in self:
            added(x)

    def append(self, x) -> None:
        super().append(x)
        self._added(x)

    def extend(self, xs) -> None:
        xs = list(xs)
        super().extend(xs)
        for x in xs:
            self._added(x)

    def __iadd__(self, xs):
        self.extend(xs)
        return self

    def __imul__(self, k):
        raise TypeError("tracked IR lists cannot be multiplied in place")

    def insert(self, i, x) -> None:
        super().insert(i, x)
        self._added(x)

    def remove(self, x) -> None:
        super().remove(x)
        self._removed(x)

    def pop(self, i=-1):
        x = super().pop(i)
        self._removed(x)
        return x

    def clear(self) -> None:
        old = list(self)
        super().clear()
        for x in old:
            self._removed(x)

    def __setitem__(self, i, x) -> None:
        old = self[i]
        new = list(x) if isinstance(i, slice) else [x]
        super().__setitem__(i, new if isinstance(i, slice) else x)
        for y in (old if isinstance(i, slice) else [old]):
            self._removed(y)
        for y in new:
            self._added(y)

    def __delitem__(self, i) -> None:
        old = self[i]
        super().__delitem__(i)
        for y in (old if isinstance(i, slice) else [old]):
            self._removed(y)

    def replace(self, old, new) -> None:
        """Every ``old`` item becomes ``new``, in place."""
        for i, x in enumerate(self):
            if x is old:
                self[i] = new

    def _raw_set(self, items: list) -> None:
        """Replace the contents without reporting (the owner has done the bookkeeping)."""
        super().__setitem__(slice(None), items)


class Graph:
    """Nodes in run order plus the graph's inputs, outputs and constants.

    ``nodes`` and ``outputs`` are lists that keep the use-lists right when edited. For
    many edits, :meth:`remove_node` and :meth:`insert_before` cost O(1) each: the node list
    is compacted once, the next time ``nodes`` is read."""

    def __init__(self, nodes: Iterable[Node] | None = None, inputs: list[Value] | None = None,
                 outputs: Iterable[Value] | None = None,
                 initializers: dict[str, Value] | None = None, name: str = "", doc: str = "",
                 value_info: dict[str, Value] | None = None):
        self.owner: Node | None = None
        """The node whose attribute holds this graph (None for a main graph or a body)."""
        self._live = True
        self._dirty = False
        self._before: dict[Node, list[Node]] = {}
        self._nodes = _TrackedList(nodes or (), self._adopt, self._release)
        self._outputs = _TrackedList(outputs or (), self._add_output, self._drop_output)
        self.inputs: list[Value] = list(inputs or [])
        self.initializers: dict[str, Value] = dict(initializers or {})
        self.name = name
        self.doc = doc
        self.value_info: dict[str, Value] = dict(value_info or {})

    # -- nodes
    @property
    def nodes(self) -> list[Node]:
        if self._dirty:
            self._compact()
        return self._nodes

    @nodes.setter
    def nodes(self, nodes: Iterable[Node]) -> None:
        nodes = list(nodes)
        keep = set(nodes)
        for n in self.nodes:
            if n not in keep:
                self._release(n)
        for n in nodes:
            if n.graph is not self:
                self._adopt(n)
        self._nodes._raw_set(nodes)

    def append(self, node: Node) -> None:
        """Add ``node`` at the end."""
        self.nodes.append(node)

    def insert_before(self, anchor: Node, nodes: Iterable[Node]) -> None:
        """Put ``nodes`` (in order) just before ``anchor``, which may be removed later:
        they keep its place. O(1) per node."""
        nodes = list(nodes)
        for n in nodes:
            self._adopt(n)
        self._before.setdefault(anchor, []).extend(nodes)
        self._dirty = True

    def remove_node(self, node: Node) -> None:
        """Take ``node`` out of the graph: its reads stop counting as uses and it stops
        producing its outputs. O(1) (plus its subgraphs' size)."""
        if node.graph is not self:
            raise ValueError(f"{node} is not a node of graph {self.name!r}")
        self._release(node)
        self._dirty = True

    def _compact(self) -> None:
        out: list[Node] = []
        before = self._before

        def emit(n: Node) -> None:
            for m in before.pop(n, ()):
                emit(m)
            if n.graph is self:
                out.append(n)

        for n in self._nodes:
            emit(n)
        self._before = {}
        self._dirty = False
        self._nodes._raw_set(out)

    def _adopt(self, n: Node) -> None:
        if n.graph is not None and n.graph is not self:
            raise ValueError(f"{n} already belongs to graph {n.graph.name!r}")
        n.graph = self
        for v in n._outputs:
            if v is not None:
                v.producer = n
        n._set_live(self._live)

    def _release(self, n: Node) -> None:
        if n.graph is not self:
            return
        n.graph = None
        for v in n._outputs:
            if v is not None and v.producer is n:
                v.producer = None
        n._set_live(False)

    # -- outputs
    @property
    def outputs(self) -> list[Value]:
        return self._outputs

    @outputs.setter
    def outputs(self, values: Iterable[Value]) -> None:
        for v in self._outputs:
            self._drop_output(v)
        self._outputs._raw_set(list(values))
        for v in self._outputs:
            self._add_output(v)

    def _add_output(self, v: Value | None) -> None:
        if v is not None and self._live:
            v._returned_by[self] = v._returned_by.get(self, 0) + 1

    def _drop_output(self, v: Value | None) -> None:
        if v is not None and self._live:
            k = v._returned_by.get(self, 0) - 1
            if k > 0:
                v._returned_by[self] = k
            else:
                v._returned_by.pop(self, None)

    def _set_live(self, live: bool) -> None:
        if self._live == live:
            return
        if not live:
            for v in self._outputs:
                self._drop_output(v)
        self._live = live
        if live:
            for v in self._outputs:
                self._add_output(v)
        for n in self.nodes:
            n._set_live(live)

    # -- queries
    def replace_all_uses(self, old: Value, new: Value, outputs: bool = False) -> int:
        """Readers of ``old`` read ``new``; this graph's own outputs change only when
        ``outputs`` (their names are the interface), nested graphs' outputs always."""
        return old.replace_all_uses_with(new, keep_outputs_of=None if outputs else self)

    def walk(self) -> Iterator[tuple[Graph, Node]]:
        """Every (graph, node) pair, descending into subgraphs."""
        for n in self.nodes:
            yield self, n
            for g in n.subgraphs():
                yield from g.walk()

    def defined(self) -> set[Value]:
        """Values defined in this graph's own scope (inputs, constants, node outputs)."""
        out = set(self.inputs) | set(self.initializers.values())
        for n in self.nodes:
            out.update(v for v in n.outputs if v is not None)
        return out

    def values_by_name(self) -> dict[str, Value]:
        """Every named value of this graph's own scope: inputs, then initializers, then
        node outputs (an initializer that is also an input is found as the input)."""
        out: dict[str, Value] = {v.name: v for v in self.inputs}
        for name, v in self.initializers.items():
            out.setdefault(name, v)
        for n in self.nodes:
            for v in n.outputs:
                if v is not None:
                    out.setdefault(v.name, v)
        return out

    def captures(self) -> list[Value]:
        """Values this graph (or its nested subgraphs) reads from enclosing scopes."""
        own = self.defined()
        seen: dict[Value, None] = {}
        for n in self.nodes:
            for v in n.inputs:
                if v is not None and v not in own:
                    seen[v] = None
            for g in n.subgraphs():
                for v in g.captures():
                    if v not in own:
                        seen[v] = None
        return list(seen)

    def __repr__(self) -> str:
        return f"Graph({self.name!r}, {len(self.nodes)} nodes)"


def check_uses(g: Graph) -> list[str]:
    """Problems with the use-lists and producers of ``g`` and its subgraphs (empty when
    consistent): every read is registered, no use is left by a node that is gone, every
    node output names its producer, and nodes belong to the graph listing them."""
    want: dict[Value, set] = {}
    returned: dict[Value, dict] = {}
    problems: list[str] = []

    def visit(graph: Graph) -> None:
        for v in graph.inputs:
            want.setdefault(v, set())
        for v in graph.initializers.values():
            want.setdefault(v, set())
        for v in graph.outputs:
            if v is not None:
                want.setdefault(v, set())
                returned.setdefault(v, {})
                returned[v][graph] = returned[v].get(graph, 0) + 1
        for n in graph.nodes:
            if n.graph is not graph:
                problems.append(f"{n} is listed by graph {graph.name!r} but belongs to "
                                f"{None if n.graph is None else n.graph.name!r}")
            if not n._live:
                problems.append(f"{n} is in a live graph but its uses are not counted")
            for i, v in enumerate(n.inputs):
                if v is not None:
                    want.setdefault(v, set()).add((n, i))
            for v in n.outputs:
                if v is not None:
                    want.setdefault(v, set())
                    if v.producer is not n:
                        problems.append(f"{v!r} is an output of {n} but its producer is "
                                        f"{v.producer}")
            for sub in n.subgraphs():
                if sub.owner is not n:
                    problems.append(f"subgraph {sub.name!r} of {n} names another owner")
                visit(sub)

    visit(g)
    for v, uses in want.items():
        have = set(v._uses)
        if have != uses:
            extra = [f"{n.op_type}[{i}]" for n, i in have - uses]
            missing = [f"{n.op_type}[{i}]" for n, i in uses - have]
            problems.append(f"{v!r}: uses not read by any live node {extra}, reads not "
                            f"registered {missing}")
        if dict(v._returned_by) != returned.get(v, {}):
            problems.append(f"{v!r}: graphs returning it are {len(v._returned_by)}, "
                            f"expected {len(returned.get(v, {}))}")
        p = v.producer
        if p is not None and (p.graph is None or v not in p.outputs):
            problems.append(f"{v!r} names a producer that is gone: {p}")
    return problems


@dataclass(eq=False)
class Function:
    """A model-local function: a named body called like an operator."""

    domain: str
    name: str
    graph: Graph
    attr_names: list[str] = field(default_factory=list)
    attr_defaults: dict[str, Any] = field(default_factory=dict)
    opset_imports: dict[str, int] = field(default_factory=dict)
    doc: str = ""
    overload: str = ""


@dataclass(eq=False)
class Model:
    """A whole model: the main graph, the opsets it was written for, its functions."""

    graph: Graph
    opset_imports: dict[str, int] = field(default_factory=lambda: {"": 21})
    functions: dict[tuple[str, str], Function] = field(default_factory=dict)
    ir_version: int = 10
    producer_name: str = ""
    producer_version: str = ""
    domain: str = ""
    model_version: int = 0
    doc: str = ""
    metadata: dict[str, str] = field(default_factory=dict)

    @property
    def opset(self) -> int:
        """The default-domain (ai.onnx) opset version."""
        return self.opset_imports.get("", self.opset_imports.get("ai.onnx", 1))

    def opset_of(self, domain: str) -> int:
        """The opset version nodes of ``domain`` run at: the one the model imports for it,
        else the default domain's."""
        v = self.opset_imports.get(domain)
        return v if v is not None else self.opset  # computed only when needed: per node

    def check_uses(self) -> list[str]:
        """:func:`check_uses` over the main graph and every function body."""
        out = check_uses(self.graph)
        for f in self.functions.values():
            out += check_uses(f.graph)
        return out
