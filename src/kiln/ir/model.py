"""The graph IR: Model, Graph, Node, Value and Function.

Values are objects, not names: a Node's inputs point at the Value objects produced
elsewhere (possibly in an enclosing graph, for subgraphs of If/Loop/Scan). Names are kept
for export and messages. Constants (initializers) are Values with ``const`` set.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.ir.types import TensorType, ValueType


class Value:
    """A named value flowing between nodes: graph input, initializer or node output."""

    __slots__ = ("name", "type", "producer", "const", "meta")

    def __init__(self, name: str, type: ValueType | None = None, const: np.ndarray | None = None):
        self.name = name
        self.type = type
        self.producer: Node | None = None
        self.const = const
        self.meta: dict[str, Any] = {}

    @property
    def is_const(self) -> bool:
        return self.const is not None

    @property
    def shape(self):
        return self.type.shape if isinstance(self.type, TensorType) else None

    @property
    def dtype(self):
        return self.type.dtype if isinstance(self.type, TensorType) else None

    def __repr__(self) -> str:
        return f"Value({self.name!r}, {self.type})"


@dataclass(frozen=True)
class AttrRef:
    """Inside a function body: an attribute whose value is the caller's attribute ``name``."""

    name: str


class Node:
    """One layer: an operator application. Missing optional inputs/outputs are None."""

    __slots__ = ("name", "op_type", "domain", "inputs", "outputs", "attrs", "doc")

    def __init__(self, op_type: str, inputs: list[Value | None], outputs: list[Value | None],
                 attrs: dict[str, Any] | None = None, domain: str = "", name: str = ""):
        self.op_type = op_type
        self.domain = domain
        self.name = name
        self.inputs = list(inputs)
        self.outputs = list(outputs)
        self.attrs = dict(attrs or {})
        self.doc = ""
        for v in self.outputs:
            if v is not None:
                v.producer = self

    def subgraphs(self) -> Iterator[Graph]:
        """The graphs held in this node's attributes (If branches, Loop/Scan bodies)."""
        for a in self.attrs.values():
            if isinstance(a, Graph):
                yield a
            elif isinstance(a, list) and a and isinstance(a[0], Graph):
                yield from a

    def __repr__(self) -> str:
        ins = ", ".join(v.name if v else "" for v in self.inputs)
        outs = ", ".join(v.name if v else "" for v in self.outputs)
        dom = f"{self.domain}." if self.domain else ""
        return f"<{dom}{self.op_type} {self.name!r}: ({ins}) -> ({outs})>"


@dataclass(eq=False)
class Graph:
    """Nodes in run order plus the graph's inputs, outputs and constants."""

    nodes: list[Node] = field(default_factory=list)
    inputs: list[Value] = field(default_factory=list)
    outputs: list[Value] = field(default_factory=list)
    initializers: dict[str, Value] = field(default_factory=dict)
    name: str = ""
    doc: str = ""
    value_info: dict[str, Value] = field(default_factory=dict)

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
