"""The straight-line executor: a plan's steps as one generated Python function over local
variables — no environment dict, no per-step bookkeeping, intermediates deleted after
their last reader. Every backend runs its plans through it (the same source, as an
``nn.Module.forward``, is what the torch backend hands to ``torch.compile``).

A kernel error inside the generated function is reported as a ``KernelError`` naming the
layer: the traceback's line in the generated source maps back to the step, so nothing is
run twice to find out where it failed.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import Any

from kiln.errors import KernelError, KilnError
from kiln.ops.registry import KernelContext
from kiln.runtime.shape_memo import MAX_BYTES, MAX_SHAPES, nbytes, shape_steps

_ids = itertools.count()


class _RunState(threading.local):
    # A class default, not getattr(..., None): a missing thread-local attribute costs an
    # exception (microseconds) on every run.
    control: Callable[[], None] | None = None


run_state = _RunState()
"""This thread's run: ``run_state.control`` is its stop check, or None."""


def active_control() -> Callable[[], None] | None:
    """The stop check of the run this thread is in (None: the run cannot be stopped)."""
    return run_state.control


class controlled:
    """Context in which this thread's runs call ``check`` at every layer boundary;
    ``check`` raises (a KilnError) to stop the run."""

    def __init__(self, check: Callable[[], None]):
        self.check = check

    def __enter__(self):
        self.prev = run_state.control
        run_state.control = self.check

    def __exit__(self, *exc):
        run_state.control = self.prev


class Program:
    """A compiled straight-line function for a plan; call it with the graph's inputs."""

    def __init__(self, plan, module: bool = False, checked: bool = False,
                 memo: bool = False):
        self.filename = f"<kiln plan {next(_ids)}>"
        once, frontier = shape_steps(plan) if memo and not module else (frozenset(), ())
        self.source, self.globals, self.constants, self.line_step = \
            _generate(plan, module, self.filename, checked, once, frontier)
        self.steps = plan.steps
        self.fn: Callable = self.globals["forward" if module else "run"]
        self.memo: dict | None = {} if frontier else None
        """Per input shapes, the values of the steps that depend on nothing else
        (:mod:`kiln.runtime.shape_memo`); None when the plan has none."""
        self.memo_bytes = 0
        self.once, self.frontier = once, frontier
        if self.memo is not None:  # what the generated function looks up and keeps
            self.globals["_get"], self.globals["_keep"] = self.memo.get, self._keep

    def _keep(self, key: tuple, values: tuple) -> None:
        """Keep the shape-only values of a run with new input shapes, within the bounds."""
        if len(self.memo) < MAX_SHAPES:
            size = nbytes(values)
            if self.memo_bytes + size <= MAX_BYTES:
                self.memo_bytes += size
                self.memo[key] = values

    def known_values(self, inputs) -> tuple | None:
        """The kept values of the steps in ``once`` for these inputs' shapes, if a run
        with these shapes kept them (in ``frontier`` order)."""
        return None if self.memo is None else self.memo.get(_memo_key(inputs))

    def __call__(self, *inputs):
        try:
            return self.fn(*inputs)
        except KilnError:
            raise
        except Exception as e:
            step = self.failing_step(e)
            if step is None:
                raise
            raise layer_error(step.node, e) from e

    def failing_step(self, e: BaseException):
        """The step whose line of generated code raised ``e`` (None if not from here)."""
        tb, line = e.__traceback__, None
        while tb is not None:
            if tb.tb_frame.f_code.co_filename == self.filename:
                line = tb.tb_lineno
            tb = tb.tb_next
        j = None if line is None else self.line_step.get(line)
        return None if j is None else self.steps[j]


def layer_error(node, e: BaseException) -> KernelError:
    """The error a failing kernel surfaces as: which layer, which op, what went wrong."""
    return KernelError(f"layer {node.name or '(unnamed)'!r} ({node.op_type}) failed: "
                       f"{type(e).__name__}: {e}")


def can_run(plan) -> bool:
    """Whether ``plan`` can run straight-line: every step has a kernel. Steps that run
    subgraphs (If, Loop, Scan) get a context holding the values their subgraphs read from
    this scope, and a plan that reads values of enclosing scopes (a branch, a loop body)
    takes them as arguments after its inputs, in ``plan.captures`` order."""
    return all(s.fn is not None for s in plan.steps)


def subgraph_reads(step) -> list:
    """The values of the enclosing scope that ``step``'s subgraphs read."""
    return list(dict.fromkeys(v for g in step.node.subgraphs() for v in g.captures()))


def _generate(plan, module: bool, filename: str, checked: bool = False,
              once: frozenset[int] = frozenset(), frontier: tuple = ()
              ) -> tuple[str, dict, dict, dict[int, int]]:
    """(source, globals, constants by name, line -> step index). ``module``: a
    ``forward(self, ...)`` reading constants from buffers, results as kernels return them;
    else ``run(...)`` with constants as globals, results normalized by the backend.
    ``checked``: the run's stop check is called after every step (cancellable runs).
    ``once``/``frontier``: steps that depend on the inputs' shapes alone and the values of
    theirs other steps read; ``run`` then looks those values up by its inputs' shapes and
    dtypes (``_get``, from an earlier run with the same shapes: the ``once`` steps are
    skipped) and keeps them after a run with new shapes (``_keep``); the Program binds
    both to its memo."""
    names: dict = {}
    glb: dict[str, Any] = {"_one": _one, "_n": plan.backend.normalize, "_ctl": active_control,
                           "_T": plan.backend.array_type, "_NI": NotImplemented}
    lines: list[str] = []
    line_step: dict[int, int] = {}
    for i, v in enumerate(plan.graph.inputs):
        names[v] = f"x{i}"
    outer = [] if module else list(plan.captures)
    for i, v in enumerate(outer):
        names.setdefault(v, f"o{i}")
    reads = {} if module else {j: subgraph_reads(s) for j, s in enumerate(plan.steps)}
    params = plan.param_constants()
    as_param = {(j, k) for j, s in enumerate(plan.steps) for k, v in enumerate(s.inputs)
                if v in params and k in s.params}
    used = {v for j, s in enumerate(plan.steps) for k, v in enumerate(s.inputs)
            if v is not None and (j, k) not in as_param} | set(plan.graph.outputs) | {
                v for vs in reads.values() for v in vs}
    pnames: dict = {}
    consts = {}
    for i, (v, t) in enumerate(plan.consts.items()):
        if v in params:  # host parameters as plain Python: nothing to trace
            pnames[v] = f"p{i}"
            glb[f"p{i}"] = params[v]
        if v in used:
            consts[f"c{i}"] = t
            names[v] = f"c{i}"
            if module:
                lines.append(f"    c{i} = self.c{i}")
    glb.update({} if module else consts)
    wrap = "{}" if module else "_n({})"
    if checked:
        lines.append("    _chk = _ctl()")
    kept = set(frontier)
    if frontier:  # every step's outputs are named v{step}_{output}
        where = {v: f"v{j}_{k}" for j, s in enumerate(plan.steps)
                 for k, v in enumerate(s.outputs) if v is not None}
        known = ", ".join(where[v] for v in frontier)
        key = ", ".join(f"({names[v]}.shape, {names[v]}.dtype)" for v in plan.graph.inputs)
        lines.append(f"    _k = ({key},)" if key else "    _k = ()")
        lines.append("    _m = _get(_k)")
        lines.append(f"    if _m is not None: {known}, = _m")
    for j, s in enumerate(plan.steps):
        glb[f"f{j}"] = s.fn
        args = ", ".join("None" if v is None else pnames[v] if (j, k) in as_param else names[v]
                         for k, v in enumerate(s.inputs))
        if s.wants_ctx and reads.get(j):
            # Subgraphs see this scope's values they read: a context per call holding them
            glb["_KC"], glb[f"s{j}"], glb["_tg"] = KernelContext, s.node, plan.target
            env = []
            for i, v in enumerate(reads[j]):
                glb[f"e{j}_{i}"] = v
                env.append(f"e{j}_{i}: {names[v]}")
            ctx = f"_KC({len(s.outputs)}, {s.opset}, {{{', '.join(env)}}}, s{j}, _tg)"
            args = f"{ctx}, {args}" if args else ctx
        elif s.wants_ctx:  # facts only: one context per step, made now
            glb[f"k{j}"] = KernelContext(len(s.outputs), s.opset, {}, s.node, plan.target)
            args = f"k{j}, {args}" if args else f"k{j}"
        outs = list(s.outputs)
        body: list[str] = []
        fcall = f"f{j}({args})"
        if s.transfers is not None:  # the kernel of another device: values moved around it
            glb[f"t{j}"], glb[f"u{j}"] = s.transfers
            moved = ", ".join("None" if v is None else f"t{j}({names[v]})" for v in s.inputs)
            fcall = f"u{j}(f{j}({moved}))"
        rest = s.rest  # what takes the calls the kernel declines (NotImplemented)
        if rest is not None:
            glb[f"n{j}"] = rest
        if len(outs) == 1 and not module:
            # Most kernels return the backend's array: one class test inline instead of
            # two calls (unwrap a 1-tuple, normalize) per layer.
            names[outs[0]] = v = f"v{j}_0"
            body.append(f"{v} = {fcall}")
            if rest is None:
                body.append(f"if {v}.__class__ is not _T: {v} = _n(_one({v}))")
            else:
                body.append(f"if {v}.__class__ is not _T: "
                            f"{v} = _n(_one(n{j}({args}) if {v} is _NI else {v}))")
        elif len(outs) == 1:
            names[outs[0]] = f"v{j}_0"
            if rest is None:
                body.append(f"v{j}_0 = _one({fcall})")
            else:
                body.append(f"v{j}_0 = {fcall}")
                body.append(f"v{j}_0 = _one(n{j}({args}) if v{j}_0 is _NI else v{j}_0)")
        else:
            body.append(f"r{j} = {fcall}")
            if rest is not None:
                body.append(f"if r{j} is _NI: r{j} = n{j}({args})")
            for k, v in enumerate(outs):
                if v is not None:
                    names[v] = f"v{j}_{k}"
                    body.append(f"v{j}_{k} = " + wrap.format(f"r{j}[{k}]"))
        if not module:
            dead = [names[v] for v in s.frees
                    if v in names and v not in plan.consts and v not in kept]
            if dead:
                body.append(f"del {', '.join(dead)}")
        indent = "    "
        if j in once:
            lines.append("    if _m is None:")
            indent = "        "
        for text in body:
            line_step[len(lines) + 2] = j  # +1: the def line, +1: lines count from 1
            lines.append(indent + text)
        if checked:
            lines.append("    _chk()")
    ins = ", ".join((["self"] if module else []) + [names[v] for v in plan.graph.inputs]
                    + [f"o{i}" for i in range(len(outer))])
    outs = ", ".join(names[v] for v in plan.graph.outputs)
    head = "forward" if module else "run"
    result = f"[{outs}]"
    if frontier:  # a run with new input shapes keeps their shape-only values
        lines.append(f"    if _m is None: _keep(_k, ({known},))")
    src = f"def {head}({ins}):\n" + "\n".join(lines) + f"\n    return {result}\n"
    exec(compile(src, filename, "exec"), glb)
    return src, glb, consts, line_step


def _memo_key(inputs) -> tuple:
    return tuple((x.shape, x.dtype) for x in inputs)


def _one(r):
    return r[0] if isinstance(r, tuple) else r
