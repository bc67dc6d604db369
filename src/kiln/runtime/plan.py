"""The execution plan: computed once per graph (order, kernels, attributes, when each
intermediate can be freed); ``run`` then only calls kernels and moves references."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from time import perf_counter
from typing import Any

from kiln.errors import KernelError, KilnError, UnsupportedOpError
from kiln.ir import AttrRef, Function, Graph, Node, Value
from kiln.ops import registry
from kiln.ops.registry import KernelContext
from kiln.runtime.backend import Backend


@dataclass(eq=False)
class Step:
    """One node, ready to run."""

    node: Node
    fn: Any
    inputs: tuple[Value | None, ...]
    outputs: tuple[Value | None, ...]
    attrs: dict[str, Any]
    frees: tuple[Value, ...]
    wants_ctx: bool
    opset: int
    placement: str
    variadic_outputs: bool = False


class _Compiler:
    """Shared state while compiling a model's graphs: backend, functions, missing ops."""

    def __init__(self, backend: Backend, functions: dict[tuple[str, str], Function]):
        self.backend = backend
        self.functions = functions
        self.missing: dict[tuple[str, str, int], None] = {}
        self.function_plans: dict = {}


class Plan:
    """A compiled graph. ``run(inputs, outer)`` evaluates it; ``outer`` supplies values of
    enclosing scopes for subgraphs."""

    def __init__(self, graph: Graph, opsets: dict[str, int], compiler: _Compiler,
                 bindings: dict[str, Any] | None = None):
        self.graph = graph
        self.backend = compiler.backend
        self.consts = {v: compiler.backend.constant(v) for v in graph.initializers.values()}
        self.captures = graph.captures()
        self.steps: list[Step] = [self._step(n, opsets, compiler, bindings or {})
                                  for n in graph.nodes]
        self._plan_lifetimes()

    def _step(self, node: Node, opsets, compiler: _Compiler, bindings) -> Step:
        opset = opsets.get(node.domain, opsets.get("", 1))
        attrs = {}
        for k, a in node.attrs.items():
            if isinstance(a, AttrRef):
                if a.name not in bindings:
                    continue
                a = bindings[a.name]
            attrs[k] = a
        # Subgraph attributes become compiled plans the kernel runs through ctx.run.
        for k, a in list(attrs.items()):
            if isinstance(a, Graph):
                attrs[k] = Plan(a, opsets, compiler, bindings)
        opdef = registry.lookup(node.domain, node.op_type, opset)
        common = dict(node=node, inputs=tuple(node.inputs), outputs=tuple(node.outputs),
                      frees=(), opset=opset)
        if opdef is not None:
            fn, attrs, wants_ctx, placement = compiler.backend.bind(opdef, node, opset, attrs)
            return Step(fn=fn, attrs=attrs, wants_ctx=wants_ctx, placement=placement, **common)
        func = compiler.functions.get((node.domain, node.op_type))
        if func is None:
            from kiln.onnxio.schema_functions import spec_function
            func = spec_function(node, opset)
        if func is None:
            compiler.missing[(node.domain, node.op_type, opset)] = None
            return Step(fn=None, attrs={}, wants_ctx=False, placement="?", **common)
        call = FunctionCall(func, attrs, {**opsets, **func.opset_imports}, compiler)
        return Step(fn=call, attrs={}, wants_ctx=True, placement="function", **common)

    def _plan_lifetimes(self) -> None:
        keep = set(self.graph.outputs) | set(self.consts) | set(self.captures)
        last: dict[Value, int] = {}
        for i, s in enumerate(self.steps):
            for v in s.inputs:
                if v is not None:
                    last[v] = i
            for sub in s.attrs.values():
                if isinstance(sub, Plan):
                    for v in sub.captures:
                        last[v] = i
            for g in s.node.subgraphs():  # also when a backend binds the plans elsewhere
                for v in g.captures():
                    last[v] = i
            for v in s.outputs:
                if v is not None and v not in last:
                    last[v] = i  # produced but never read: free right away
        frees: dict[int, list[Value]] = {}
        for v, i in last.items():
            if v not in keep:
                frees.setdefault(i, []).append(v)
        for i, s in enumerate(self.steps):
            s.frees = tuple(frees.get(i, ()))

    def run(self, inputs: list, outer: dict | None = None, overrides: dict | None = None,
            observer: Callable[[Step, float, float, Any], None] | None = None) -> list:
        """Evaluate the graph on positional ``inputs`` (in ``graph.inputs`` order);
        ``overrides`` replaces constants (initializers a caller may feed); ``observer`` is
        called after each step with (step, start, end, result) times from perf_counter,
        for profiling."""
        env: dict[Value, Any] = dict(self.consts)
        if overrides:
            env.update(overrides)
        if outer is not None:
            for v in self.captures:
                if v in outer:
                    env[v] = outer[v]
        for v, x in zip(self.graph.inputs, inputs):
            env[v] = x
        normalize = self.backend.normalize
        for s in self.steps:
            args = [None if v is None else env[v] for v in s.inputs]
            if observer is not None:
                t0 = perf_counter()
            try:
                if s.wants_ctx:
                    ctx = KernelContext(len(s.outputs), s.opset, env, self, s.node, self.backend)
                    result = s.fn(ctx, *args, **s.attrs)
                else:
                    result = s.fn(*args, **s.attrs)
            except KilnError:
                raise
            except Exception as e:
                raise KernelError(f"layer {s.node.name or '(unnamed)'!r} ({s.node.op_type}) "
                                  f"failed: {type(e).__name__}: {e}") from e
            if observer is not None:
                observer(s, t0, perf_counter(), result)
            if len(s.outputs) == 1 and not isinstance(result, tuple):
                env[s.outputs[0]] = normalize(result)
            else:
                for v, r in zip(s.outputs, result):
                    if v is not None:
                        env[v] = normalize(r)
            for v in s.frees:
                env.pop(v, None)
        return [env[v] for v in self.graph.outputs]


class FunctionCall:
    """Kernel for a call to a model-local or spec-defined function: the body, compiled
    once per call site with that site's attributes bound."""

    def __init__(self, func: Function, attrs: dict[str, Any], opsets: dict[str, int],
                 compiler: _Compiler):
        bindings = {**func.attr_defaults, **attrs}
        self.plan = Plan(func.graph, opsets, compiler, bindings)
        self.name = func.name

    def __call__(self, ctx: KernelContext, *args):
        out = self.plan.run(list(args))
        return tuple(out) if len(out) != 1 else out[0]


def compile_model(graph: Graph, opsets: dict[str, int], functions: dict, backend: Backend
                  ) -> Plan:
    """Compile the main graph; raises UnsupportedOpError naming every op Kiln lacks."""
    compiler = _Compiler(backend, functions)
    plan = Plan(graph, opsets, compiler)
    if not compiler.missing:
        backend.prepare(plan, graph, opsets, functions)
    if compiler.missing:
        names = ", ".join(f"{d + '.' if d else ''}{o} (opset {v})" for d, o, v in compiler.missing)
        raise UnsupportedOpError(
            f"the model uses operators Kiln cannot run on the {backend.name} backend: {names}. "
            "Register a kernel with kiln.register_op(domain, op_type, kernel) or re-export the "
            "model with a different opset.", list(compiler.missing))
    return plan
