"""Torch kernels for the torch backend (``kiln.runtime.torch_backend``).

Importing this package does not import torch (``kiln.ops`` imports it with the NumPy ops);
the backend calls :func:`install`, which imports the kernel modules. Kernels live in a
table of their own, looked up by the model's opset, so they neither depend on how the
NumPy kernels split an op's versions nor on import order. A third party's kernel attached
with ``kiln.ops.backend_kernel("torch", ...)`` takes precedence over these.

Two kernel styles:

* plain: ``@kernel("Relu", 6)`` on ``fn(*inputs, **attrs)`` — same convention as the
  NumPy kernels (optional ``ctx`` first);
* builder: ``@kernel("Conv", 1, build=True)`` on ``fn(site) -> callable | None``: called
  once per node when the plan is built, with a :class:`Site` (attributes, constant
  inputs, output count, backend options); it returns ``run(*inputs)`` with everything
  precomputable already computed, or None when it cannot handle the node (the backend
  then uses the generic or NumPy kernel).

At run time a kernel may return ``NotImplemented`` for inputs it does not handle (a dtype,
say); the backend then runs the next kernel in line (generic, else NumPy) for that call.
Returning :data:`USE_NUMPY` goes straight to the NumPy kernel (counted as a fallback call).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.ops import registry
from kiln.ops.registry import OpDef

USE_NUMPY = type("UseNumpy", (), {"__repr__": lambda self: "USE_NUMPY"})()
_MODULES = ("elementwise", "nn", "shape", "fused", "control")
_TABLE: dict[tuple[str, str], list[TorchKernel]] = {}
_installed = False


@dataclass
class TorchKernel:
    """One torch kernel: the opset range it covers and how it is called."""

    domain: str
    op_type: str
    since: int
    until: int | None
    fn: Callable
    build: bool
    opdef: OpDef | None = None  # plain kernels: signature facts (ctx, attribute names)


@dataclass
class Site:
    """What a builder sees about one node while the plan is built."""

    node: Any
    opset: int
    attrs: dict[str, Any]
    backend: Any
    wants_ctx: bool = False  # a builder sets this when its callable takes a ctx first
    notes: list[str] = field(default_factory=list)  # shown in the placement report

    @property
    def num_outputs(self) -> int:
        return len(self.node.outputs)

    def output_used(self, i: int) -> bool:
        outs = self.node.outputs
        return i < len(outs) and outs[i] is not None

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def const(self, i: int):
        """Input ``i`` as a NumPy array when it is a constant no feed can replace, else None."""
        ins = self.node.inputs
        if i >= len(ins) or ins[i] is None:
            return None
        v = ins[i]
        if v.const is None or v.meta.get("overridable"):
            return None
        return v.const

    def has_input(self, i: int) -> bool:
        ins = self.node.inputs
        return i < len(ins) and ins[i] is not None


def kernel(op_type: str, since: int = 1, *, until: int | None = None, domain: str = "",
           build: bool = False) -> Callable[[Callable], Callable]:
    """Decorator adding a torch kernel for ``op_type`` on opsets ``[since, until)``."""

    def register(fn: Callable) -> Callable:
        dom = "" if domain == "ai.onnx" else domain
        tk = TorchKernel(dom, op_type, since, until, fn, build)
        if not build:
            tk.opdef = OpDef(dom, op_type, since, until, fn)
        versions = _TABLE.setdefault((dom, op_type), [])
        versions[:] = [k for k in versions if k.since != since]
        versions.append(tk)
        versions.sort(key=lambda k: k.since)
        return fn

    return register


def find(domain: str, op_type: str, opset: int) -> TorchKernel | None:
    """The torch kernel for ``op_type`` at ``opset``: newest ``since <= opset`` in range."""
    best = None
    for k in _TABLE.get(("" if domain == "ai.onnx" else domain, op_type), ()):
        if k.since <= opset:
            best = k
    if best is not None and best.until is not None and opset >= best.until:
        return None
    return best


def install() -> None:
    """Import the kernel modules (and so torch), and announce them in the op registry
    (``OpDef.backend_kernels["torch"]``, which the optimizer consults before creating a
    fused op for a backend); idempotent."""
    global _installed
    if _installed:
        return
    for m in _MODULES:
        importlib.import_module(f"{__name__}.{m}")
    for d in registry.registered():
        tk = find(d.domain, d.op_type, d.since)
        if tk is not None and "torch" not in d.backend_kernels:
            d.backend_kernels["torch"] = tk.fn
    _installed = True


def is_builtin(fn) -> bool:
    """Whether ``fn`` is one of these kernels (not a third party's override)."""
    return any(k.fn is fn for ks in _TABLE.values() for k in ks)


def covered() -> list[tuple[str, str, int]]:
    """(domain, op_type, since) of every torch kernel, for reports and tests."""
    install()
    return [(k.domain, k.op_type, k.since) for ks in _TABLE.values() for k in ks]
