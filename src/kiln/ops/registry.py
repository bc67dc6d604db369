"""The op registry: one definition per operator version, keyed by (domain, op type) and
the opset range it covers. A definition holds the kernel and the shape/type inference.

Kernels are plain functions. Positional parameters are the op's inputs (missing optional
inputs arrive as None; ``*args`` takes variadic ones), keyword-only parameters are its
attributes with their ONNX defaults, and a first parameter named ``ctx`` asks for the
:class:`KernelContext` (number of outputs, opset, subgraph execution).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

KILN_DOMAIN = "ai.kiln"


@dataclass
class OpDef:
    """One version of one operator: its kernel, and what the plan needs to call it."""

    domain: str
    op_type: str
    since: int
    until: int | None
    kernel: Callable
    infer: Callable | None = None
    generic: bool = False
    backend_kernels: dict[str, Callable] = field(default_factory=dict)
    wants_ctx: bool = False
    attr_names: frozenset[str] = frozenset()

    def __post_init__(self):
        params = list(inspect.signature(self.kernel).parameters.values())
        self.wants_ctx = bool(params) and params[0].name == "ctx"
        self.attr_names = frozenset(p.name for p in params if p.kind == p.KEYWORD_ONLY)
        if any(p.kind == p.VAR_KEYWORD for p in params):
            self.attr_names = frozenset({"*"})

    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset < self.until)

    def call_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """The node's attributes this kernel accepts (unknown ones, often deprecated
        hints like ``consumed_inputs``, are dropped)."""
        if "*" in self.attr_names:
            return dict(attrs)
        return {k: v for k, v in attrs.items() if k in self.attr_names}


_OPS: dict[tuple[str, str], list[OpDef]] = {}


def _norm_domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def op(op_type: str, since: int = 1, *, domain: str = "", until: int | None = None,
       generic: bool = False, infer: Callable | None = None) -> Callable[[Callable], Callable]:
    """Decorator registering a kernel for ``op_type`` from opset ``since`` (up to ``until``).

    ``generic=True`` promises the kernel uses only the array-API namespace of its inputs
    (``xp = namespace(x)``), so every backend can run it as it is.
    """

    def register(fn: Callable) -> Callable:
        add(OpDef(_norm_domain(domain), op_type, since, until, fn, infer=infer, generic=generic))
        return fn

    return register


def add(opdef: OpDef) -> OpDef:
    """Add an op definition; a later one for the same (domain, op, since) replaces it."""
    versions = _OPS.setdefault((opdef.domain, opdef.op_type), [])
    versions[:] = [d for d in versions if d.since != opdef.since]
    versions.append(opdef)
    versions.sort(key=lambda d: d.since)
    return opdef


def backend_kernel(backend: str, op_type: str, since: int = 1, *, domain: str = ""
                   ) -> Callable[[Callable], Callable]:
    """Decorator attaching a backend-specific kernel to an already registered op version."""

    def register(fn: Callable) -> Callable:
        d = lookup(_norm_domain(domain), op_type, since)
        if d is None:
            raise KeyError(f"register {op_type} (opset {since}) before its {backend} kernel")
        d.backend_kernels[backend] = fn
        return fn

    return register


def infer(op_type: str, since: int = 1, *, domain: str = "") -> Callable[[Callable], Callable]:
    """Decorator attaching a shape/type inference function to a registered op version."""

    def register(fn: Callable) -> Callable:
        for d in _OPS.get((_norm_domain(domain), op_type), []):
            if d.since >= since:
                d.infer = fn
        return fn

    return register


def lookup(domain: str, op_type: str, opset: int) -> OpDef | None:
    """The definition covering ``opset``: the newest version whose ``since`` is <= opset."""
    best = None
    for d in _OPS.get((_norm_domain(domain), op_type), ()):
        if d.since <= opset:
            best = d
    return best if best is not None and best.covers(opset) else None


def registered() -> list[OpDef]:
    """Every registered op version."""
    return [d for versions in _OPS.values() for d in versions]


def register_op(domain: str, op_type: str, kernel: Callable, shape_fn: Callable | None = None,
                since: int = 1) -> OpDef:
    """Public API for custom operators: run ``kernel`` for nodes ``domain.op_type``.

    ``kernel`` follows the kernel convention (inputs positional, attributes keyword-only)
    and gets NumPy arrays; ``shape_fn(*input_types, **attrs)`` optionally returns the
    output types (a TensorType or a list of them) for shape inference.
    """
    return add(OpDef(_norm_domain(domain), op_type, since, None, kernel, infer=shape_fn))


class KernelContext:
    """What a ``ctx`` kernel sees: node facts plus a way to run its subgraphs."""

    __slots__ = ("num_outputs", "opset", "env", "runner", "node", "backend")

    def __init__(self, num_outputs: int, opset: int, env: dict, runner, node, backend):
        self.num_outputs = num_outputs
        self.opset = opset
        self.env = env
        self.runner = runner
        self.node = node
        self.backend = backend

    def run(self, subgraph, inputs: list) -> list:
        """Run a subgraph attribute (given to the kernel already compiled) on ``inputs``,
        with this node's enclosing values visible to it."""
        return subgraph.run(inputs, outer=self.env)
