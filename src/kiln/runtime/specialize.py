"""Per-input-shape specialization: for each new input signature (shapes, dtypes, devices)
the model is re-optimized for exactly those shapes (so all shape arithmetic folds away),
planned on a tracing copy of the backend, and handed to the backend's compiler. Programs
are cached per signature; a signature whose program cannot be built runs the eager plan,
with a warning saying why. Serves any backend that can compile a plan.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("kiln.compile")
"""What compilers printed while Kiln compiled (FX graphs, guard failures): debug level."""


class CompileWarning(UserWarning):
    """compile=True could not be honoured for some inputs; those run eagerly."""


class Specializer:
    """The cache of compiled programs of one main plan, keyed by input signature."""

    MAX_PROGRAMS = 8

    def __init__(self, plan, opsets: dict, functions: dict,
                 compile_plan: Callable[[Any], Callable[[list], list]],
                 signature: Callable[[list], tuple | None]):
        self.plan = plan
        self.opsets, self.functions = dict(opsets), functions
        self.compile_plan = compile_plan
        self.signature = signature
        self.programs: dict[tuple, Callable | None] = {}
        self._lock = threading.Lock()
        self._pending: list[str] = []  # warnings to give once the compiler is done

    def __call__(self, inputs: list) -> list | None:
        """The outputs from the specialized program, or None to run the plan eagerly."""
        key = self.signature(inputs)
        if key is None:
            return None
        with self._lock:
            prog = self.programs.get(key, False)
            if prog is False:
                with compiler_output():
                    prog = self.programs[key] = self._build(inputs)
                    # Compilers compile lazily, at the first call.
                    out = None if prog is None else self._first(key, prog, inputs)
                for why in self._pending:  # after compiler_output: on the user's stderr
                    warnings.warn(f"compile=True: {why}; running eagerly for these inputs",
                                  CompileWarning, stacklevel=5)
                self._pending.clear()
                report = getattr(getattr(prog, "inner", None), "report", None)
                if out is not None and report is not None:
                    self._in_parts(report)
                return out
        if prog is None:
            return None
        return prog(inputs)

    def _in_parts(self, report) -> None:
        """A program built in parts: the status says what runs compiled and what eagerly,
        one warning line names the layers that cannot be compiled and why (a run first
        taken later whose compile fails warns on its own: ``report.notify``)."""
        plan = self.plan

        def status() -> None:
            plan.compile_status = "yes, in parts: " + report.summary()
        status()
        blocked = report.blocked()
        failed = f" ({'; '.join(report.failed)})" if report.failed else ""
        if blocked or failed:
            warnings.warn(f"compile=True: running eagerly between compiled programs: "
                          f"{blocked}{failed}", CompileWarning, stacklevel=6)
        report.notify = status

    def _first(self, key: tuple, prog: Callable, inputs: list) -> list | None:
        try:
            return prog(inputs)
        except CompileFailed as e:
            self.programs[key] = None
            self._note(str(e))
            return None

    def _build(self, inputs: list) -> Callable | None:
        if len(self.programs) > self.MAX_PROGRAMS:
            self._note(f"more than {self.MAX_PROGRAMS} input signatures; new ones run eagerly")
            return None
        from kiln.ir import Model
        from kiln.optimizer import optimize
        from kiln.runtime.plan import compile_model

        graph, be = self.plan.graph, self.plan.backend
        shapes = {v.name: list(x.shape) for v, x in zip(graph.inputs, inputs)}
        try:
            model = optimize(Model(graph, dict(self.opsets), dict(self.functions)),
                             input_shapes=shapes, backend=be.name)
            plan = compile_model(model.graph, model.opset_imports, model.functions,
                                 be.tracer())
            prog = self.compile_plan(plan)
        except CompileFailed as e:
            self._note(f"for shapes {shapes}: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - a failure to specialize means: run eagerly
            self._note(f"specializing for shapes {shapes} failed: {type(e).__name__}: {e}")
            return None
        pos = {v.name: i for i, v in enumerate(graph.inputs)}
        order = [pos[v.name] for v in plan.graph.inputs]

        def run(xs: list) -> list:
            return prog([xs[i] for i in order])
        run.inner = prog  # type: ignore[attr-defined]  # its report, once it has run
        return run

    def _note(self, why: str) -> None:
        self.plan.compile_status = f"partly: {why}; running eagerly for these inputs"
        self._pending.append(why)


@contextlib.contextmanager
def compiler_output() -> Iterator[None]:
    """Keep what compilers print while compiling (a whole FX graph when a guard fails,
    torch's own warnings) off the user's stderr: it goes to the ``kiln.compile`` logger at
    debug level, and the user sees Kiln's one-line CompileWarning. sys.stderr is swapped
    for the whole process meanwhile: another thread's stderr lines written during a
    compile land in that log too."""
    buf = io.StringIO()
    # torch gives its module loggers their own stderr handlers (torch._logging).
    loggers = [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)
               if n == "torch" or n.startswith("torch.")]
    handlers = {h for lg in loggers for h in lg.handlers
                if isinstance(h, logging.StreamHandler) and h.stream in (sys.stderr,
                                                                        sys.__stderr__)}
    streams = {h: h.setStream(buf) for h in handlers}
    try:
        with contextlib.redirect_stderr(buf):
            yield
    finally:
        for h, stream in streams.items():
            h.setStream(stream)
        if buf.getvalue().strip():
            log.debug("compiler output:\n%s", buf.getvalue())


class CompileFailed(Exception):
    """A backend's compiler could not turn a plan into a program (the reason says why;
    ``step``: the plan's step whose kernel failed while it was traced, when known)."""

    step = None
