"""The op registry: one definition per operator version, keyed by (domain, op type) and
the opset range it covers. A definition (:class:`OpDef`) holds everything Kiln knows about
the op: its kernels for every backend, shape/type inference, which inputs are read on the
host, whether it is deterministic and differentiable, and its cost. Every table elsewhere
(host-read inputs, folding rules, FLOP counts, backend capabilities) is derived from these
definitions. (What fused ops apply in place as their activation, per backend, is
:data:`kiln.ops.fused.ACTIVATIONS`.)

The kernel protocol is the same for every backend. A kernel is either

* plain: ``fn(*inputs, **attrs)`` — inputs positional (missing optional ones arrive as
  None, ``*args`` takes variadic ones), attributes keyword-only with their ONNX defaults,
  and a first parameter named ``ctx`` asks for the :class:`KernelContext`; or
* prepared: ``prepare(site) -> run | None`` (registered with ``prepare=True``), called once
  per node when a session is created with a :class:`Site` (attributes, constant inputs,
  its :class:`Target`: device, compute type, tracing); it returns ``run(*inputs)`` with
  everything precomputable (packed or transformed weights, layouts, geometry) already
  computed, or None to decline the node.

A plain kernel is prepared by binding its attributes. A kernel declines in ``prepare`` a
node whose input types, known to the plan, it does not compute; at run time it may still
return ``NotImplemented`` for inputs it does not handle (a type unknown before the run, a
shape or value its fast path does not cover): the next kernel in the backend's order runs
that call instead (see ``kiln.runtime.plan``).
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

KILN_DOMAIN = "ai.kiln"
REFERENCE = "numpy"
"""The backend whose kernel every op has: NumPy, on the CPU."""

# Where a backend's own kernels are defined: modules, or packages whose every module is
# loaded (a kernel module is loaded because it exists there, not because a list names it).
# Importing them registers the kernels on the op definitions; it happens on first use (see
# :func:`load_backend`), so ``import kiln`` does not import torch, and what a backend
# supports is known without constructing it. The torch runtimes' settings come first.
BACKEND_MODULES: dict[str, tuple[str, ...]] = {
    "torch": ("kiln.ops.torch.native", "kiln.ops.torch"),
}
_loaded: set[str] = set()


@dataclass
class Kernel:
    """One backend's kernel for one op version (plain or prepared, see the module doc)."""

    fn: Callable
    prepare: bool = False
    wants_ctx: bool = False
    attr_names: frozenset[str] = frozenset()

    def __post_init__(self):
        if self.prepare:
            return
        first, keywords, any_keyword = _parameters(self.fn)
        self.wants_ctx = first == "ctx"
        self.attr_names = frozenset({"*"}) if any_keyword else keywords

    def call_attrs(self, attrs: dict[str, Any]) -> dict[str, Any]:
        """The node's attributes a plain kernel accepts (unknown ones, often deprecated
        hints like ``consumed_inputs``, are dropped)."""
        if "*" in self.attr_names:
            return dict(attrs)
        return {k: v for k, v in attrs.items() if k in self.attr_names}

    def bind(self, site: Site) -> tuple[Callable, bool] | None:
        """``(run, wants_ctx)`` for the node ``site`` describes, or None if declined."""
        if self.prepare:
            site.wants_ctx = False
            run = self.fn(site)
            return None if run is None else (run, site.wants_ctx)
        attrs = self.call_attrs(site.attrs)
        fn = self.fn
        if not attrs:
            return fn, self.wants_ctx
        return (lambda *args: fn(*args, **attrs)), self.wants_ctx


def _parameters(fn: Callable) -> tuple[str | None, frozenset[str], bool]:
    """(first parameter's name, keyword-only names, whether it takes ``**kwargs``). Read
    from a plain function's code object: ``inspect.signature`` per kernel is a noticeable
    part of a first session's creation with 100-odd kernels."""
    if not isinstance(fn, types.FunctionType) or hasattr(fn, "__wrapped__"):
        params = list(inspect.signature(fn).parameters.values())
        return (params[0].name if params else None,
                frozenset(p.name for p in params if p.kind == p.KEYWORD_ONLY),
                any(p.kind == p.VAR_KEYWORD for p in params))
    code = fn.__code__
    n, k = code.co_argcount, code.co_kwonlyargcount
    names = code.co_varnames
    order = list(names[:n])
    if code.co_flags & inspect.CO_VARARGS:
        order.append(names[n + k])
    order += names[n:n + k]
    return (order[0] if order else None, frozenset(names[n:n + k]),
            bool(code.co_flags & inspect.CO_VARKEYWORDS))


@dataclass
class OpDef:
    """One version of one operator: everything Kiln knows about it."""

    domain: str
    op_type: str
    since: int
    until: int | None
    kernel: Callable
    """The reference (NumPy) kernel, or its prepare function when ``prepare``."""
    infer: Callable | None = None
    generic: bool = False
    """The reference kernel only uses the array-API namespace of its inputs, so every
    backend can run it on its own arrays."""
    prepare: bool = False
    host_inputs: frozenset[int] = frozenset()
    """Inputs read on the host as parameters (shapes, axes, pads, sizes), not as data."""
    deterministic: bool = True
    """False for random ops: never folded into constants, never merged by CSE."""
    differentiable: bool = True
    """Whether gradients flow through the op (False for integer, boolean and index ops)."""
    cost: Callable | None = None
    """``cost(node, input_shapes, output_shapes) -> FLOPs`` with concrete shapes (None
    where unknown); a multiply-add counts 2."""
    kernels: dict[str, Kernel] = field(default_factory=dict)
    """Kernel per backend name; ``kernels["numpy"]`` is the reference kernel."""
    body: Callable | None = None
    """For Kiln's own ops: ``body(b)`` writes the node's computation in standard ONNX ops
    on a :class:`kiln.ops.function_body.Body`, saved as the op's function so that other
    runtimes can run the file."""

    def __post_init__(self):
        self.kernels.setdefault(REFERENCE, Kernel(self.kernel, self.prepare))

    @property
    def reference(self) -> Kernel:
        return self.kernels[REFERENCE]

    def covers(self, opset: int) -> bool:
        return self.since <= opset and (self.until is None or opset < self.until)

    def runs_on(self, backend: str) -> bool:
        """Whether ``backend`` has a kernel of its own for this op or can run the shared
        one (known statically: the backend's kernel modules are loaded, nothing built)."""
        load_backend(backend)
        return backend == REFERENCE or self.generic or backend in self.kernels

    def differentiable_on(self, backend: str) -> bool:
        """Whether gradients flow through this op when it runs on ``backend``: only through
        kernels made of the backend's own differentiable ops (not NumPy fallbacks)."""
        return self.differentiable and backend != REFERENCE and self.runs_on(backend)


_OPS: dict[tuple[str, str], list[OpDef]] = {}


def _norm_domain(domain: str) -> str:
    return "" if domain == "ai.onnx" else domain


def op(op_type: str, since: int = 1, *, domain: str = "", until: int | None = None,
       generic: bool = False, infer: Callable | None = None, prepare: bool = False,
       host_inputs: tuple[int, ...] = (), deterministic: bool = True,
       differentiable: bool = True,
       cost: Callable | None = None) -> Callable[[Callable], Callable]:
    """Decorator registering the reference kernel of ``op_type`` from opset ``since`` (up
    to ``until``) with the op's facts (see :class:`OpDef`)."""

    def register(fn: Callable) -> Callable:
        add(OpDef(_norm_domain(domain), op_type, since, until, fn, infer=infer,
                  generic=generic, prepare=prepare, host_inputs=frozenset(host_inputs),
                  deterministic=deterministic, differentiable=differentiable,
                  cost=cost))
        return fn

    return register


def add(opdef: OpDef) -> OpDef:
    """Add an op definition; a later one for the same (domain, op, since) replaces it."""
    versions = _OPS.setdefault((opdef.domain, opdef.op_type), [])
    versions[:] = [d for d in versions if d.since != opdef.since]
    versions.append(opdef)
    versions.sort(key=lambda d: d.since)
    return opdef


def kernel(backend: str, op_type: str, since: int = 1, *, until: int | None = None,
           domain: str = "", prepare: bool = False) -> Callable[[Callable], Callable]:
    """Decorator attaching ``backend``'s kernel to the versions of ``op_type`` from opset
    ``since`` up to ``until``. A version that ``since`` or ``until`` falls inside is split
    there (reference kernel and facts shared), so a kernel never covers part of a version."""

    def register(fn: Callable) -> Callable:
        key = (_norm_domain(domain), op_type)
        if not _OPS.get(key):
            raise KeyError(f"{backend} kernel for {op_type}: register the op first")
        for at in (since, until):
            if at is not None:
                _split(key, at)
        k = Kernel(fn, prepare)
        for d in _OPS[key]:
            if d.since >= since and (until is None or d.since < until):
                d.kernels[backend] = k
        return fn

    return register


def _split(key: tuple[str, str], at: int) -> None:
    """Make opset ``at`` the start of a version of the op, if a version covers it."""
    versions = _OPS[key]
    for i, d in enumerate(versions):
        end = d.until if d.until is not None else \
            versions[i + 1].since if i + 1 < len(versions) else None
        if d.since < at and (end is None or at < end):
            later = replace(d, since=at, kernels=dict(d.kernels))
            d.until = at
            versions.insert(i + 1, later)
            return


def backend_kernel(backend: str, op_type: str, since: int = 1, *, domain: str = ""
                   ) -> Callable[[Callable], Callable]:
    """Public API: attach your own ``backend`` kernel (plain convention) to ``op_type``'s
    version registered at ``since`` and the later ones; it replaces Kiln's."""
    load_backend(backend)
    return kernel(backend, op_type, since, domain=domain)


def load_backend(backend: str) -> None:
    """Register ``backend``'s own kernels (imports their modules once)."""
    if backend in _loaded:
        return
    for name in BACKEND_MODULES.get(backend, ()):
        m = importlib.import_module(name)
        for sub in sorted(pkgutil.iter_modules(getattr(m, "__path__", ())),
                          key=lambda s: s.name):
            if not sub.name.startswith("_"):
                importlib.import_module(f"{name}.{sub.name}")
    _loaded.add(backend)


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


class Mode:
    """Switches a caller flips between runs, never during one: ``training`` is set by
    kiln.train's modules before each run (BatchNormalization then uses batch statistics,
    Dropout drops)."""

    training: bool = False


def _same(x):
    return x


@dataclass
class Target:
    """Where the plan runs a node, decided before the first run: what a ``prepare``
    function may know of its backend. Kernels read this, never the backend object."""

    backend: str = REFERENCE
    """The backend's name."""
    device: Any = "cpu"
    """The device its arrays live on (a ``torch.device`` on torch)."""
    compute_dtype: Any = None
    """The reduced type matmul/conv compute in (``precision``), or None."""
    tracing: bool = False
    """Kernels are traced into one program (``compile=True``): plain traceable ops only."""
    channels_last: bool = False
    """2-D convolutions run in NHWC."""
    module: bool = False
    """The node runs inside a kiln.train module: the module's train()/eval() flag (``mode``)
    decides what training-mode nodes do."""
    put: Callable = _same
    """A NumPy array as an array of the backend on its device (types it lacks stay NumPy)."""
    take: Callable = _same
    """An array of the backend as a NumPy array (what a kernel reads on the host)."""
    mode: Mode = field(default_factory=Mode)
    """Switches between runs (shared by every node of the backend)."""


@dataclass
class Site:
    """What a kernel's ``prepare`` sees about one node while a session is created."""

    node: Any
    opset: int
    attrs: dict[str, Any]
    target: Target = field(default_factory=Target)
    """Where the plan runs the node: device, compute type, tracing, layout."""
    wants_ctx: bool = False
    """A prepare function sets this when its ``run`` takes a KernelContext first."""
    notes: list[str] = field(default_factory=list)
    """Shown in the placement report."""
    opsets: dict[str, int] = field(default_factory=dict)
    """The plan's opset per domain: what a kernel that runs other nodes of the graph (the
    Gradient) needs to look their definitions up (:meth:`opset_of`)."""

    @property
    def num_outputs(self) -> int:
        return len(self.node.outputs)

    def output_used(self, i: int) -> bool:
        outs = self.node.outputs
        return i < len(outs) and outs[i] is not None

    def attr(self, name: str, default: Any = None) -> Any:
        return self.attrs.get(name, default)

    def opset_of(self, node) -> int:
        """The opset ``node`` of this plan's graph runs at: its domain's, else the
        default domain's."""
        return self.opsets.get(node.domain, self.opsets.get("", 1))

    def has_input(self, i: int) -> bool:
        ins = self.node.inputs
        return i < len(ins) and ins[i] is not None

    def const(self, i: int):
        """Input ``i`` as a NumPy array when it is a constant no feed can replace, else None."""
        if not self.has_input(i):
            return None
        v = self.node.inputs[i]
        if v.const is None or v.meta.get("overridable"):
            return None
        return v.const


class KernelContext:
    """What a ``ctx`` kernel sees: node facts plus a way to run its subgraphs."""

    __slots__ = ("num_outputs", "opset", "env", "node", "target")

    def __init__(self, num_outputs: int, opset: int, env: dict, node,
                 target: Target | None = None):
        self.num_outputs = num_outputs
        self.opset = opset
        self.env = env
        self.node = node
        self.target = Target() if target is None else target
        """Where the node runs (:class:`Target`): its ``put``/``take`` move values in and
        out of the backend's arrays."""

    def run(self, subgraph, inputs: list) -> list:
        """Run a subgraph attribute (given to the kernel already compiled) on ``inputs``,
        with this node's enclosing values visible to it."""
        return subgraph.run(inputs, outer=self.env)


def evaluate(node, opset: int, inputs: list) -> list:
    """The node's outputs computed by its reference kernel from NumPy ``inputs`` (for
    constant folding). Raises KeyError when no op definition covers it and ValueError for
    nodes holding subgraphs (those need a plan, see ``kiln.runtime``)."""
    opdef = lookup(node.domain, node.op_type, opset)
    if opdef is None:
        raise KeyError(f"no kernel for {node.op_type} (opset {opset})")
    if any(True for _ in node.subgraphs()):
        raise ValueError(f"{node.op_type} holds subgraphs; it needs a plan to run")
    bound = opdef.reference.bind(Site(node, opset, dict(node.attrs)))
    if bound is None:
        raise ValueError(f"{node.op_type}: the reference kernel declined this node")
    fn, wants_ctx = bound
    if wants_ctx:
        r = fn(KernelContext(len(node.outputs), opset, {}, node), *inputs)
    else:
        r = fn(*inputs)
    return list(r) if isinstance(r, tuple) else [r]
