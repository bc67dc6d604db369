"""Per-input-shape specialization: for each new input signature (shapes, dtypes, devices)
the model is re-optimized for exactly those shapes (so all shape arithmetic folds away),
planned on a tracing copy of the backend, and handed to the backend's compiler. Programs
are cached per signature; a signature whose program cannot be built runs the eager plan,
with a warning saying why. Serves any backend that can compile a plan.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any


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

    def __call__(self, inputs: list) -> list | None:
        """The outputs from the specialized program, or None to run the plan eagerly."""
        key = self.signature(inputs)
        if key is None:
            return None
        with self._lock:
            prog = self.programs.get(key, False)
            if prog is False:
                prog = self.programs[key] = self._build(inputs)
        if prog is None:
            return None
        try:
            return prog(inputs)
        except CompileFailed as e:  # compilers compile lazily, at the first call
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
        return lambda xs: prog([xs[i] for i in order])

    def _note(self, why: str) -> None:
        self.plan.compile_status = f"partly: {why}; running eagerly for these inputs"
        warnings.warn(f"compile=True: {why}; running eagerly for these inputs",
                      CompileWarning, stacklevel=6)


class CompileFailed(Exception):
    """A backend's compiler could not turn a plan into a program (the reason says why)."""
