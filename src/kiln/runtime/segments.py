"""Partial compilation: a plan that cannot be one compiled program (an If, a Loop, a layer
on the NumPy fallback) runs as compiled programs for the maximal runs of layers that can
be compiled, with the others run eagerly between them; the plans inside an eager layer's
subgraphs (an If's branches, a Loop's body) are split the same way.

What stays eager, and why, is decided per layer by the backend (``blocker``); runs too
small to be worth a program call (:data:`MIN_SEGMENT`) stay eager too. Each compiled run
is built at its first call (a branch never taken is never compiled); a run whose compile
fails runs eagerly from then on, with a note. The split plan runs through the ordinary
straight-line executor: a compiled run is one step of it.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

from kiln.runtime.executor import Program
from kiln.runtime.placement import LayerPlacement
from kiln.runtime.plan import Plan, Step
from kiln.runtime.specialize import CompileFailed, CompileWarning, compiler_output

MIN_SEGMENT = 3
"""Runs of fewer layers stay eager. One AOTInductor program call has a fixed cost (the
call, its argument and output lists) that a run of the cheapest layers (elementwise, on a
few hundred values) only repays from three or four layers on, measured on the CPU
(docs/performance.md, "compile=True on the trained models"); heavier layers (convolutions,
products) repay it sooner. So the Shape-Gather-Equal before an If or a Squeeze alone in a
branch stay eager."""

FREE_OPS = frozenset({"Identity", "Shape", "Size", "Squeeze", "Unsqueeze", "Reshape",
                      "Flatten"})
"""Layers that cost next to nothing in a compiled program and little eagerly (views and
shape reads): they do not count toward :data:`MIN_SEGMENT`."""


SMALL = f"runs of under {MIN_SEGMENT} layers (a program call costs more)"


@dataclass
class Report:
    """What a split plan runs compiled and what eagerly, for ``compile_status``."""

    programs: int = 0
    compiled_layers: int = 0
    eager: dict[str, list[str]] = field(default_factory=dict)
    """reason -> layer names (in plan order) run eagerly for that reason."""
    failed: list[str] = field(default_factory=list)
    """Compiles that failed at a run's first call (those layers then run eagerly)."""
    forced: dict = field(default_factory=dict)
    """Steps found not to trace when compiled (step -> why): eager from then on."""
    notify: Callable[[], None] | None = None
    """Once the first run is over (its notes given), called after each later change: a run
    first taken later whose compile failed (that failure is then warned about here)."""
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_eager(self, step: Step, why: str) -> None:
        """Record that ``step`` runs eagerly because of ``why``."""
        self.eager.setdefault(why, []).append(_label(step))

    def blocked(self) -> str:
        """The layers that cannot be compiled, each with why, in a line ("" when none):
        the runs left eager for being small are not named."""
        out = []
        for why, names in self.eager.items():
            if why != SMALL:
                more = f" and {len(names) - 3} more" if len(names) > 3 else ""
                out.append(f"layer {', '.join(names[:3])}{more} ({why})")
        return "; ".join(out)

    def summary(self) -> str:
        """One line: the programs, and the eager layers grouped by reason."""
        eager = sum(len(v) for v in self.eager.values())
        parts = [f"{self.programs} program(s) for {self.compiled_layers} layers (each built "
                 f"at its first call), {eager} layers run eagerly between them"]
        for why, names in self.eager.items():
            more = f" and {len(names) - 4} more" if len(names) > 4 else ""
            parts.append(f"{why}: {', '.join(names[:4])}{more}")
        return "; ".join(parts + self.failed)


def _label(step: Step) -> str:
    return f"{step.node.name or '(unnamed)'!r} ({step.node.op_type})"


class _View:
    """What :class:`Program` and the compile cache read of a plan: its graph's inputs and
    outputs, steps, constants, captures, backend and target."""

    param_constants = Plan.param_constants

    def __init__(self, plan, steps: list, inputs: list, outputs: list, consts: dict,
                 captures: list):
        self.graph = SimpleNamespace(inputs=list(inputs), outputs=list(outputs))
        self.steps = steps
        self.consts = consts
        self.captures = list(captures)
        self.backend, self.target = plan.backend, plan.target


def _reads(step) -> list:
    """The values ``step`` reads: its inputs, and what its subgraphs read of its scope."""
    out = [v for v in step.inputs if v is not None]
    for g in step.node.subgraphs():
        out += g.captures()
    return out


def _frees(steps: list, keep: set) -> None:
    """Set each step's ``frees``: the values read or made last there (not in ``keep``)."""
    last: dict = {}
    for i, s in enumerate(steps):
        for v in _reads(s):
            last[v] = i
        for v in s.outputs:
            if v is not None and v not in last:
                last[v] = i
    frees: dict[int, list] = {}
    for v, i in last.items():
        if v not in keep:
            frees.setdefault(i, []).append(v)
    for i, s in enumerate(steps):
        s.frees = tuple(frees.get(i, ()))


def split(plan, blocker: Callable[[Step, dict], str],
          compile_view: Callable[[_View], Callable[[list], list]], report: Report,
          outer_consts: dict | None = None) -> Program:
    """``plan`` as a straight-line program whose runs of compilable layers are compiled
    programs (each built by ``compile_view`` at its first call) and whose other layers run
    eagerly; the plans of eager layers' subgraphs are split the same way (their programs
    replaced). ``blocker(step, consts)`` says why a layer cannot be compiled ("" when it
    can); ``outer_consts``: the enclosing plans' constants a subgraph reads (compiled in
    as constants, not passed in)."""
    consts = {**(outer_consts or {}), **plan.consts}
    groups, whys = _groups(plan, blocker, consts, report.forced)
    later: list[set] = [set() for _ in groups]  # what the groups after each one read
    seen = set(plan.graph.outputs)
    for i in range(len(groups) - 1, -1, -1):
        later[i] = set(seen)
        for s in groups[i]:
            seen.update(_reads(s))
    steps: list[Step] = []
    for g, why, after in zip(groups, whys, later):
        made = {v for s in g for v in s.outputs if v is not None}
        outputs = list(dict.fromkeys(v for s in g for v in s.outputs
                                     if v is not None and v in after))
        if why or not outputs:
            for s in g:
                report.add_eager(s, why or "outputs unused")
                for sub in s.subplans:
                    sub.program = split(sub, blocker, compile_view, report, consts)
                    sub.runs_before_program = 0  # a big plan would build its own later
            steps += [dataclasses.replace(s) for s in g]  # their own frees (below)
            continue
        inputs = list(dict.fromkeys(v for s in g for v in s.inputs
                                    if v is not None and v not in made and v not in consts))
        used = {v: consts[v] for s in g for v in s.inputs if v in consts}
        view = _View(plan, g, inputs, outputs, used, [])
        report.programs += 1
        report.compiled_layers += len(g)
        steps.append(_segment_step(view, blocker, compile_view, report))
    _frees(steps, set(plan.graph.outputs) | set(plan.consts) | set(plan.captures))
    return Program(_View(plan, steps, plan.graph.inputs, plan.graph.outputs, plan.consts,
                         plan.captures))


def _groups(plan, blocker: Callable[[Step, dict], str], consts: dict,
            forced: dict | None = None) -> tuple[list[list[Step]], list[str]]:
    """``plan``'s steps in runs: each layer that cannot be compiled alone, with why, and
    the maximal runs of those that can ("" when worth a program, else :data:`SMALL`);
    ``forced``: steps that run eagerly whatever ``blocker`` says, with why."""
    forced = forced or {}
    groups: list[list[Step]] = []
    whys: list[str] = []
    for s in plan.steps:
        why = forced.get(s) or blocker(s, consts)
        if not why and groups and not whys[-1]:
            groups[-1].append(s)
            continue
        groups.append([s])
        whys.append(why)
    for i, g in enumerate(groups):
        if not whys[i] and sum(s.node.op_type not in FREE_OPS for s in g) < MIN_SEGMENT:
            whys[i] = SMALL
    return groups, whys


def worth_compiling(plan, blocker: Callable[[Step, dict], str],
                    outer_consts: dict | None = None) -> bool:
    """Whether :func:`split` would compile any run of ``plan`` (or of its subgraphs)."""
    consts = {**(outer_consts or {}), **plan.consts}
    groups, whys = _groups(plan, blocker, consts)
    return any(not why for why in whys) or any(
        worth_compiling(sub, blocker, consts) for g in groups for s in g for sub in s.subplans)


def _segment_step(view: _View, blocker: Callable, compile_view: Callable, report: Report
                  ) -> Step:
    """One step running ``view``'s layers as a compiled program (eagerly once its compile
    failed)."""
    first, last = view.steps[0].node, view.steps[-1].node
    name = f"{first.name or first.op_type}..{last.name or last.op_type}"
    node = SimpleNamespace(name=name, op_type="compiled program", domain="",
                           subgraphs=lambda: [], attrs={})
    run = _Segment(view, blocker, compile_view, report)
    many = len(view.graph.outputs) != 1
    fn = (lambda *xs: tuple(run(xs))) if many else (lambda *xs: run(xs)[0])
    return Step(node=node, fn=fn, inputs=tuple(view.graph.inputs),
                outputs=tuple(view.graph.outputs), wants_ctx=False, opset=0,
                layer=LayerPlacement.of(node, "", "compiled", f"{len(view.steps)} layers"))


class _Segment:
    """A run of layers: compiled at its first call for the shapes of that call's inputs;
    eager for other shapes (a Loop body whose values grow) and once its compile failed."""

    def __init__(self, view: _View, blocker: Callable, compile_view: Callable,
                 report: Report):
        self.view, self.compile_view, self.report = view, compile_view, report
        self.blocker = blocker
        self.run: Callable[[list], list] | None = None
        self.shapes: list | None = None
        self._eager: Program | None = None
        self.lock = threading.Lock()

    def eager(self, xs: list) -> list:
        """The layers run eagerly, as the plan would."""
        if self._eager is None:
            v = self.view
            self._eager = Program(_View(v, v.steps, v.graph.inputs, v.graph.outputs,
                                        v.consts, []))
        return self._eager(*xs)

    def __call__(self, xs) -> list:
        run = self.run
        if run is not None:
            if [x.shape for x in xs] == self.shapes:
                return run(list(xs))
            return self.eager(list(xs))
        with self.lock:
            if self.run is None:
                return self._first(list(xs))
        return self(xs)

    def _first(self, xs: list) -> list:
        try:
            with compiler_output():
                run = self.compile_view(self.view)
                out = run(xs)
        except CompileFailed as e:
            steps, report = self.view.steps, self.report
            if e.step in steps:  # that layer eager, the layers around it compiled
                why = str(e)
                with report.lock:
                    report.forced[e.step] = "its kernel cannot be traced"
                    report.programs -= 1
                    report.compiled_layers -= len(steps)
                    report.failed.append(why)
                part = split(self.view, self.blocker, self.compile_view, report)
                self.shapes, self.run = [x.shape for x in xs], lambda ins: part(*ins)
            else:
                why = (f"layers {_label(steps[0])} to {_label(steps[-1])} ({len(steps)}) "
                       f"run eagerly: {e}")
                with report.lock:
                    report.failed.append(why)
                self.shapes, self.run = None, self.eager
            if report.notify is not None:  # a later run: nobody else says it
                warnings.warn(f"compile=True: {why}; running that layer eagerly",
                              CompileWarning, stacklevel=2)
                report.notify()
            return self.run(xs)
        self.shapes, self.run = [x.shape for x in xs], run
        return out
