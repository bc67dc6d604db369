"""The execution plan: computed once per graph when a session is created — order, each
node's prepared kernel (``prepare`` ran here, once), where it runs, when each
intermediate can be freed. ``run`` then only calls kernels and moves references.

The plan owns all per-node state (prepared kernels hold their packed weights in their
closures); backends own only arrays, devices and transfers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any

from kiln.errors import KilnError, UnsupportedOpError
from kiln.ir import AttrRef, Function, Graph, Node, Value, collector_paused
from kiln.ops import registry
from kiln.ops.registry import KernelContext, OpDef, Site, Target
from kiln.runtime.backend import Backend, Candidate, Link
from kiln.runtime.executor import Program, can_run, layer_error, run_state
from kiln.runtime.placement import LayerPlacement

EAGER_PROGRAM_STEPS = 20_000
"""Plans up to this many steps get their straight-line program when the session is made.
Compiling the generated source costs CPython more per step than one run through it saves
(docs/performance.md), so a bigger plan first runs step by step and builds its
program once it has run :data:`PROGRAM_AFTER_RUNS` times: never more than about twice
what compiling at once would have cost, and nothing for a model run only a few times."""
PROGRAM_AFTER_RUNS = 16


@dataclass(eq=False)
class Step:
    """One node, ready to run."""

    node: Node
    fn: Any
    inputs: tuple[Value | None, ...]
    outputs: tuple[Value | None, ...]
    wants_ctx: bool
    opset: int
    layer: LayerPlacement
    host_inputs: frozenset[int] = frozenset()
    frees: tuple[Value, ...] = ()
    subplans: tuple[Plan, ...] = ()
    rest: Callable | None = None
    """Called on the same arguments when ``fn`` returns NotImplemented (:class:`Link`)."""
    params: frozenset[int] = frozenset()
    """Inputs whose constants reach the kernels as tuples of Python numbers (host
    parameters of a backend's own and shared kernels, :attr:`Link.params`)."""
    transfers: tuple[Callable, Callable] | None = None
    """(to the kernel's device, back): transfer steps the plan runs around ``fn`` on each
    input and on the result (:meth:`Backend.transfers`); None: values are used as they
    are."""

    @property
    def placement(self) -> str:
        """How the step runs: "numpy", "torch", "torch-generic", "cpu-fallback",
        "function", or "?" for an op Kiln lacks."""
        return self.layer.how


@dataclass
class Compiler:
    """What compiling a model's graphs shares: the backend, the model's functions, the ops
    found missing (all named at once), and whether missing ops raise."""

    backend: Backend
    functions: dict[tuple[str, str], Function]
    missing: dict[tuple[str, str, int], None] = field(default_factory=dict)
    target: Target = field(init=False)
    """What every kernel's ``prepare`` is told of where it runs (decided once)."""

    def __post_init__(self):
        self.target = self.backend.target()


class Plan:
    """A compiled graph. ``run(inputs, outer)`` evaluates it; ``outer`` supplies values of
    enclosing scopes for subgraphs."""

    def __init__(self, graph: Graph, opsets: dict[str, int], compiler: Compiler,
                 bindings: dict[str, Any] | None = None):
        self.graph = graph
        self.backend = compiler.backend
        self.target = compiler.target
        self.consts = {v: compiler.backend.constant(v) for v in graph.initializers.values()}
        self.captures = graph.captures()
        self.steps: list[Step] = [_step(n, opsets, compiler, bindings or {})
                                  for n in graph.nodes]
        self._plan_lifetimes()
        self.program: Program | None = None
        self.checked_program: Program | None = None  # built by the first cancellable run
        self.runs_before_program = 0  # > 0: runs left before a big plan builds its program
        self.specializer: Callable[[list], list | None] | None = None
        self.compile_status = ""
        self.shape_memo = False
        """Whether the program computes shape-only values once per input shape
        (:mod:`kiln.runtime.shape_memo`): for optimized models, whose types Kiln inferred."""

    def finish(self) -> None:
        """Once every kernel is prepared: the backend's last word (constants placement),
        then the straight-line program when the plan allows one."""
        self.backend.finish(self)
        if can_run(self):
            if len(self.steps) <= EAGER_PROGRAM_STEPS:
                self.program = Program(self, memo=self.shape_memo)
            else:
                self.runs_before_program = PROGRAM_AFTER_RUNS

    def _plan_lifetimes(self) -> None:
        keep = set(self.graph.outputs) | set(self.consts) | set(self.captures)
        last: dict[Value, int] = {}
        for i, s in enumerate(self.steps):
            for v in s.inputs:
                if v is not None:
                    last[v] = i
            for g in s.node.subgraphs():
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

    def walk(self):
        """Every step, descending into the plans of subgraphs and function bodies."""
        for s in self.steps:
            yield s
            for sub in s.subplans:
                yield from sub.walk()

    def param_constants(self) -> dict[Value, tuple]:
        """Constants some step reads as a host parameter (shapes, axes, sizes;
        :attr:`Step.params`), as tuples: those steps get the tuple, other readers of the same
        constant (exporters share one scalar between an axis and arithmetic) the array."""
        out = {}
        for s in self.steps:
            for i, v in enumerate(s.inputs):
                if v is None or v in out or v not in self.consts or i not in s.params:
                    continue
                c = v.const
                if c.dtype.kind in "iuf" and c.ndim <= 1:
                    cast = float if c.dtype.kind == "f" else int
                    out[v] = tuple(cast(x) for x in c.reshape(-1))
        return out

    def run_main(self, inputs: list, overrides: dict | None = None) -> list:
        """Run as the session's main graph: the shape-specialized program when there is
        one for these inputs, else the plan's straight-line program (called here, with
        no layer in between: a failing kernel's error names its layer), else the plan
        step by step, in the backend's run context."""
        be = self.backend
        st = be.start_run()
        try:
            if self.specializer is not None and not overrides:
                with be.compiled_context(self.specializer, inputs):
                    out = self.specializer(inputs)
                if out is not None:
                    be.stats().compiled = True
                    return out
            prog = self.program
            with be.run_context(self, inputs):
                if prog is None or overrides or run_state.control is not None:
                    return self.run(inputs, None, overrides)
                try:
                    return prog.fn(*inputs)
                except KilnError:
                    raise
                except Exception as e:
                    step = prog.failing_step(e)
                    if step is None:
                        raise
                    raise layer_error(step.node, e) from e
        finally:
            be.end_run(st)

    def run(self, inputs: list, outer: dict | None = None, overrides: dict | None = None,
            observer: Callable[[Step, float, float, Any], None] | None = None) -> list:
        """Evaluate the graph on positional ``inputs`` (in ``graph.inputs`` order);
        ``overrides`` replaces constants (initializers a caller may feed); ``observer`` is
        called after each step with (step, start, end, result) times from perf_counter,
        for profiling. Inside ``executor.controlled`` the run's stop check is called between
        steps (here and in every subgraph), so another thread can cancel it."""
        control = run_state.control
        if control is not None:
            control()
        if self.runs_before_program > 0:
            self.runs_before_program -= 1  # concurrent runs may both count: harmless
            if self.runs_before_program == 0:
                self.program = Program(self, memo=self.shape_memo)
        if self.program is not None and not overrides and observer is None and (
                outer is not None or not self.captures):
            if self.captures:  # a subgraph: the enclosing scope's values it reads
                inputs = [*inputs, *[outer[v] for v in self.captures]]
            if control is None:
                return self.program(*inputs)
            if self.checked_program is None:
                self.checked_program = Program(self, checked=True, memo=self.shape_memo)
            return self.checked_program(*inputs)
        env: dict[Value, Any] = dict(self.consts)
        if overrides:
            env.update(overrides)
        if outer is not None:
            for v in self.captures:
                if v in outer:
                    env[v] = outer[v]
        for v, x in zip(self.graph.inputs, inputs):
            env[v] = x
        skip: frozenset[int] = frozenset()
        known = self.program.known_values(inputs) if self.program is not None \
            and not overrides and outer is None else None
        if known is not None:  # observed runs skip what the program would skip
            env.update(zip(self.program.frontier, known))
            skip = self.program.once
        normalize = self.backend.normalize
        for j, s in enumerate(self.steps):
            if j in skip:
                continue
            args = [None if v is None else env[v] for v in s.inputs]
            if observer is not None:
                t0 = perf_counter()
            try:
                if s.transfers is not None:  # never with a context (Backend.transfers)
                    down, up = s.transfers
                    result = up(s.fn(*[None if a is None else down(a) for a in args]))
                elif s.wants_ctx:
                    ctx = KernelContext(len(s.outputs), s.opset, env, s.node, self.target)
                    result = s.fn(ctx, *args)
                    if result is NotImplemented and s.rest is not None:
                        result = s.rest(ctx, *args)
                else:
                    result = s.fn(*args)
                    if result is NotImplemented and s.rest is not None:
                        result = s.rest(*args)
            except KilnError:
                raise
            except Exception as e:
                raise layer_error(s.node, e) from e
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
            if control is not None:
                control()
        return [env[v] for v in self.graph.outputs]


def _step(node: Node, opsets: dict[str, int], compiler: Compiler, bindings: dict) -> Step:
    opset = opsets.get(node.domain, opsets.get("", 1))
    attrs = {}
    subs = []
    for k, a in node.attrs.items():
        if isinstance(a, AttrRef):
            if a.name not in bindings:
                continue
            a = bindings[a.name]
        if isinstance(a, Graph):
            # Subgraph attributes become compiled plans the kernel runs through ctx.run.
            a = Plan(a, opsets, compiler, bindings)
            a.finish()
            subs.append(a)
        attrs[k] = a
    common = dict(node=node, inputs=tuple(node.inputs), outputs=tuple(node.outputs),
                  opset=opset, subplans=tuple(subs))
    be = compiler.backend
    opdef = registry.lookup(node.domain, node.op_type, opset)
    if opdef is not None:
        link, moves = bind(opdef, Site(node, opset, attrs, compiler.target, opsets=opsets), be)
        return Step(fn=link.fn, wants_ctx=link.wants_ctx, layer=link.layer,
                    host_inputs=opdef.host_inputs, rest=link.rest,
                    params=opdef.host_inputs if link.params else frozenset(),
                    transfers=moves, **common)
    func = compiler.functions.get((node.domain, node.op_type))
    if func is None:
        from kiln.onnxio.schema_functions import spec_function
        func = spec_function(node, opset)
    if func is None:
        compiler.missing[(node.domain, node.op_type, opset)] = None
        return Step(fn=None, wants_ctx=False,
                    layer=LayerPlacement.of(node, "", "?", "no kernel"), **common)
    call = FunctionCall(func, attrs, {**opsets, **func.opset_imports}, compiler)
    common["subplans"] = (call.plan,)
    return Step(fn=call, wants_ctx=True, layer=LayerPlacement.of(
        node, be.device, "function", f"body of function {func.name}"), **common)


def bind(opdef: OpDef, site: Site, backend: Backend) -> tuple[Link, tuple | None]:
    """Prepare ``site``'s node on ``backend``: each kernel the backend would use, in its
    order of preference, prepared once; the backend links those that accepted (what the
    step calls, and on a NotImplemented what next) and says which transfers the plan
    runs around it (``Step.transfers``)."""
    chain: list[Candidate] = []
    for how, kernel, why in backend.candidates(opdef):
        site.notes = []
        bound = kernel.bind(site)
        if bound is not None:
            note = "; ".join(site.notes)
            chain.append(Candidate(how, bound[0], bound[1], f"{why}; {note}" if note else why))
    if not chain:
        raise UnsupportedOpError(f"no kernel accepts layer {site.node.name!r} "
                                 f"({site.node.op_type})", [site.node.op_type])
    return backend.chain(chain, site.node, opdef.host_inputs), \
        backend.transfers(chain, site.node)


class FunctionCall:
    """Kernel for a call to a model-local or spec-defined function: the body, compiled
    once per call site with that site's attributes bound."""

    def __init__(self, func: Function, attrs: dict[str, Any], opsets: dict[str, int],
                 compiler: Compiler):
        bindings = {**func.attr_defaults, **attrs}
        self.plan = Plan(func.graph, opsets, compiler, bindings)
        self.plan.finish()
        self.name = func.name

    def __call__(self, ctx: KernelContext, *args):
        out = self.plan.run(list(args))
        return tuple(out) if len(out) != 1 else out[0]


def plan_graph(graph: Graph, opsets: dict[str, int], functions: dict, backend: Backend
               ) -> tuple[Plan, list[tuple[str, str, int]]]:
    """The plan of ``graph`` and the ops Kiln lacks for it (their steps have no kernel)."""
    compiler = Compiler(backend, functions)
    plan = Plan(graph, opsets, compiler)
    return plan, list(compiler.missing)


def compile_model(graph: Graph, opsets: dict[str, int], functions: dict, backend: Backend,
                  shape_memo: bool = False) -> Plan:
    """Compile the main graph; raises UnsupportedOpError naming every op Kiln lacks.
    ``shape_memo``: see :attr:`Plan.shape_memo`."""
    with collector_paused():
        return _compile_model(graph, opsets, functions, backend, shape_memo)


def _compile_model(graph: Graph, opsets: dict[str, int], functions: dict, backend: Backend,
                   shape_memo: bool) -> Plan:
    plan, missing = plan_graph(graph, opsets, functions, backend)
    plan.shape_memo = shape_memo
    if missing:
        names = ", ".join(f"{d + '.' if d else ''}{o} (opset {v})" for d, o, v in missing)
        raise UnsupportedOpError(
            f"the model uses operators Kiln cannot run on the {backend.name} backend: {names}. "
            "Register a kernel with kiln.register_op(domain, op_type, kernel) or re-export the "
            "model with a different opset.", missing)
    plan.finish()
    backend.specialize(plan, opsets, functions)
    return plan
