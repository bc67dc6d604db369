"""``Session``: a model made ready to run (optimized, planned, kernels prepared) and run
on feeds, from any number of threads. ``kiln.InferenceSession`` (in ``kiln.session_api``) adds
onnxruntime's API on top of it."""

from __future__ import annotations

import contextlib
import difflib
import functools
import os
import threading
import warnings
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any

import numpy as np
import onnx

from kiln.errors import (
    InputError,
    KilnError,
    OptionError,
    RunCancelledError,
)
from kiln.ir import DType, Graph, Model, SymDim, TensorType, Value, plain_shape
from kiln.onnxio import load
from kiln.runtime import memory
from kiln.runtime.backends import make_backend
from kiln.runtime.executor import controlled
from kiln.runtime.placement import PlacementReport
from kiln.runtime.plan import Plan, compile_model
from kiln.runtime.run_settings import backend_for


@dataclass(frozen=True)
class NodeArg:
    """An input or output as onnxruntime describes it: name, shape (ints for fixed dims,
    strings for symbolic ones, None for unknown) and type string such as ``tensor(float)``."""

    name: str
    shape: list[int | str | None] | None
    type: str


def _node_arg(v: Value) -> NodeArg:
    t = v.described_type()
    shape = plain_shape(t.shape) if isinstance(t, TensorType) else None
    return NodeArg(v.name, shape, str(t) if t is not None else "unknown")


def _header(model: Model) -> Model:
    """``model`` with an empty graph: its producer, version, doc strings, metadata and
    opsets, which describe it after the graph itself was optimized in place."""
    return replace(model, graph=Graph(name=model.graph.name, doc=model.graph.doc),
                   opset_imports=dict(model.opset_imports), functions={},
                   metadata=dict(model.metadata))


@dataclass
class _Target:
    """A plan a run can use, with its outputs' positions by name and the initializers a
    feed may override."""

    plan: Plan
    outputs: dict[str, int]
    overridable: dict[str, Value]

    @classmethod
    def of(cls, plan: Plan) -> _Target:
        g = plan.graph
        return cls(plan, {v.name: i for i, v in enumerate(g.outputs)},
                   {v.name: v for v in g.initializers.values() if v.meta.get("overridable")})


class Session:
    """Runs one model. Build once (the plan is computed here), call ``run`` many times,
    from several threads at once if you like.

    ``backend``: "numpy" or "torch"; None: the backend and options the model file
    stores (``kiln tune`` writes them; options given here win), else the default
    backend: "torch" when torch is installed, else "numpy" (``session.backend.name`` and
    ``placement()`` say which);
    ``optimize``: True, False or an optimizer level;
    ``input_shapes``: fixed shapes for inputs by name; ``dims``: sizes for symbolic dims
    by name (in every input that has them); ``quiet``: no warnings while building;
    ``keep_freed_memory``: once built, switch the process's malloc to keep freed memory
    for the next run (:mod:`kiln.runtime.memory`; process-wide); the rest are the
    backend's options (``threads``, torch's ``device``, ``precision``...)."""

    def __init__(self, model: Model | str | os.PathLike | bytes | onnx.ModelProto, *,
                 backend: str | None = None, optimize: bool | int | str = True,
                 input_shapes: dict[str, list[int | str | None]] | None = None,
                 dims: dict[str, int] | None = None, quiet: bool = False,
                 keep_freed_memory: bool = True, **backend_options: Any):
        self._level = optimize
        self._quiet = quiet
        with _silenced(quiet):
            if backend is not None:  # before any I/O: a wrong option fails at once
                self.backend = make_backend(backend, **backend_options)
            loaded = model if isinstance(model, Model) else load(model)
            self.backend_chosen = "asked for"
            """Why the session runs on its backend, as placement() reports it."""
            if backend is None:  # what the file stores (kiln tune), else the default
                self.backend, self.backend_chosen = backend_for(loaded.metadata,
                                                                backend_options)
            # Kept to build plans that expose intermediate values (run(["name"])): the
            # loaded model rather than bytes, as it shares its arrays with the optimized one.
            self._source = loaded if isinstance(model, bytes) else model
            self.source_header = _header(loaded)
            """The model's header as loaded, before optimization (producer, version, doc
            strings, metadata, opsets); its graph keeps only its name and doc string."""
            self._input_shapes = _fixed_shapes(loaded, input_shapes, dims or {})
            # Read here from a path or a ModelProto, the model is nobody else's: it is
            # optimized in place instead of copied (a copy was a twentieth of ShuffleNetV2's).
            self.model = self._optimized(loaded, owned=loaded is not self._source)
            g = self.model.graph
            self.plan: Plan = compile_model(g, self.model.opset_imports,
                                            self.model.functions, self.backend,
                                            shape_memo=_types_inferred(self.model))
        self._inputs = list(g.inputs)
        self._main = _Target.of(self.plan)
        self._overridable = self._main.overridable
        self._by_name = {v.name: v for v in self._inputs}
        self._shared_dims = _shared_dims(self._inputs)
        # Feeds of these (dtype, shape)s per input passed every check before (see check_feed)
        self._fits: set[tuple] = set()
        self._outputs = self._main.outputs
        self._variants: dict[tuple[str, ...], _Target] = {}
        self._lock = threading.Lock()
        if keep_freed_memory:  # after loading: the protobuf's memory goes back to the OS
            memory.keep_freed_memory()

    def _optimized(self, model: Model, owned: bool) -> Model:
        """``model`` optimized (optimize=False with input_shapes only fixes the shapes);
        ``owned``: in place, else on a copy, leaving the caller's Model untouched."""
        if not (self._level or self._input_shapes):
            return model
        from kiln.optimizer import optimize_for_session
        return optimize_for_session(model, self._level, self._input_shapes,
                                    self.backend.name,
                                    fallback=self._read_source if owned else None)

    def _read_source(self) -> Model:
        """A new copy of the model as loaded, for this session alone to change."""
        src = self._source
        if isinstance(src, Model):
            from kiln.passes.base import clone_model
            return clone_model(src)
        return load(src)

    def get_inputs(self) -> list[NodeArg]:
        """The inputs a caller feeds (initializers are not listed)."""
        return [_node_arg(v) for v in self._inputs]

    def get_outputs(self) -> list[NodeArg]:
        """The model's outputs, in order."""
        return [_node_arg(v) for v in self.model.graph.outputs]

    def get_overridable_initializers(self) -> list[NodeArg]:
        """Initializers also declared as inputs: a feed may replace their value."""
        return [_node_arg(v) for v in self._overridable.values()]

    def run(self, output_names: list[str] | None, input_feed: dict[str, Any],
            run_options: Any = None, *, output_type: str = "numpy") -> list:
        """Compute ``output_names`` (all outputs when None) from ``input_feed``
        (name -> array); returns the outputs in the order asked for, as NumPy arrays or,
        with ``output_type="torch"``, as torch tensors left where they were computed
        (zero-copy; they also speak DLPack)."""
        plan, inputs, overrides, picks, convert, check = self._prepare_run(
            output_names, input_feed, output_type, run_options)
        # Inline rather than through _execute: a run is Session.run -> execute_plan ->
        # Plan.run_main -> the plan's program -> the kernel.
        if check is None:
            values = self.execute_plan(plan, inputs, overrides)
        else:
            with controlled(check):
                check()  # also stops runs of compiled programs, which have no layers
                values = self.execute_plan(plan, inputs, overrides)
        if picks is not None:
            values = [values[i] for i in picks]
        return [convert(x) for x in values]

    def execute_plan(self, plan: Plan, inputs: list, overrides: dict | None) -> list:
        """Run ``plan`` once on checked inputs: the step every run goes through (a
        subclass wraps it to record runs, as onnxruntime's profiling does)."""
        return plan.run_main(inputs, overrides)

    def check_input(self, name: str, value: Any):
        """``value`` as this backend's array for input ``name``, checked against its
        declared type and shape (InputError if it does not fit)."""
        v = self._by_name.get(name)
        if v is None:
            raise InputError(f"unknown input name {name!r}; the model's inputs are "
                             f"{[v.name for v in self._inputs]}")
        return self._check_one(v, value)

    def run_async(self, output_names: list[str] | None, input_feed: dict[str, Any],
                  run_options: Any = None, *, output_type: str = "numpy"):
        """Queue a run and return at once an :class:`~kiln.runtime.async_run.AsyncRun`
        handle (``done()``, ``result()``, ``readback()``); runs execute in order. Feeds
        are checked now, so bad feeds raise here."""
        job = functools.partial(self._execute, *self._prepare_run(
            output_names, input_feed, output_type, run_options))
        if getattr(self, "_async", None) is None:
            from kiln.runtime.async_run import AsyncRunner
            self._async = AsyncRunner(self.backend)
        return self._async.submit(job)

    def placement(self) -> PlacementReport:
        """Where each layer runs and why (subgraph and function layers included), and
        what the last run moved between devices."""
        be = self.backend
        return PlacementReport(be.name, be.device, [s.layer for s in self.plan.walk()],
                               be.last_run_stats(), self.plan.compile_status,
                               self.backend_chosen)

    def _prepare_run(self, output_names, input_feed, output_type: str, run_options=None):
        if output_type not in ("numpy", "torch"):
            raise InputError(f"output_type must be 'numpy' or 'torch', got {output_type!r}")
        inputs = self.check_feed(input_feed)
        target = self._main
        if output_names is not None and any(n not in self._outputs for n in output_names):
            target = self._variant(output_names)
        overrides = {v: self.backend.from_numpy(np.asarray(input_feed[n], v.const.dtype))
                     for n, v in target.overridable.items() if n in input_feed}
        picks = None if output_names is None else [target.outputs[n] for n in output_names]
        if output_type == "torch":
            from kiln.runtime.torch_backend import as_torch as convert
        else:
            convert = functools.partial(_c_ordered, self.backend.to_numpy)
        check = None if run_options is None else stop_check(run_options)
        return target.plan, inputs, overrides, picks, convert, check

    def _execute(self, plan: Plan, inputs: list, overrides: dict, picks: list[int] | None,
                 convert, check) -> list:
        """What :meth:`run` does with what :meth:`_prepare_run` returned (queued runs)."""
        if check is None:
            values = self.execute_plan(plan, inputs, overrides)
        else:
            with controlled(check):
                check()
                values = self.execute_plan(plan, inputs, overrides)
        if picks is not None:
            values = [values[i] for i in picks]
        return [convert(x) for x in values]

    def _variant(self, output_names: list[str]) -> _Target:
        """The plan of the model with the intermediate values ``output_names`` kept as
        outputs before optimization (so no fusion hides them), built once per set."""
        key = tuple(sorted({n for n in output_names if n not in self._outputs}))
        with self._lock:
            hit = self._variants.get(key)
        if hit is not None:
            return hit
        model = self._read_source()
        values = model.graph.values_by_name()
        for n in key:
            if n not in values:
                close = difflib.get_close_matches(n, list(values), n=5)
                raise InputError(f"unknown output name {n!r}: no tensor of the model has it"
                                 + (f"; close matches: {close}" if close else
                                    f"; the model's outputs are {list(self._outputs)}"))
            model.graph.outputs.append(values[n])
        with _silenced(self._quiet):
            # on a copy: should optimizing fail, the fallback must keep the outputs added
            model = self._optimized(model, owned=False)
            plan = compile_model(model.graph, model.opset_imports, model.functions,
                                 self.backend, shape_memo=_types_inferred(model))
        if [v.name for v in plan.graph.inputs] != [v.name for v in self._inputs]:
            raise KilnError("intermediate outputs: the model's inputs changed when it was "
                            "re-read; build a new session")
        with self._lock:
            return self._variants.setdefault(key, _Target.of(plan))

    def check_feed(self, feed: dict[str, Any]) -> list:
        """The graph inputs of ``feed`` (name -> array), in order, as this backend's arrays,
        each checked against its declared type and shape (InputError if one does not fit,
        is missing or unknown, or inputs sharing a symbolic dim disagree on it)."""
        if not isinstance(feed, dict):
            raise InputError("input_feed must be a dict mapping input names to arrays")
        # A feed of exactly the inputs, as native NumPy arrays of dtypes and shapes that
        # passed before, passes again: skip the per-input checks (a visible part of a tiny
        # model's run)
        sig = self._signature(feed)
        if sig is not None and sig in self._fits:
            from_numpy = self.backend.from_numpy
            return [from_numpy(feed[v.name]) for v in self._inputs]
        values = self._check_feed(feed)
        if sig is not None and len(self._fits) < 64:
            self._fits.add(sig)
        return values

    def _signature(self, feed: dict[str, Any]) -> tuple | None:
        """The feed's (dtype, shape) per input when it feeds exactly the inputs, each a
        NumPy array in native byte order (what the backends accept as it is), else None."""
        if len(feed) != len(self._inputs):
            return None
        sig = []
        for v in self._inputs:
            x = feed.get(v.name)
            if x.__class__ is not np.ndarray or not x.dtype.isnative:
                return None
            sig.append((x.dtype, x.shape))
        return tuple(sig)

    def _check_feed(self, feed: dict[str, Any]) -> list:
        unknown = [n for n in feed if n not in self._by_name and n not in self._overridable]
        if unknown:
            raise InputError(f"unknown input name(s) {unknown}; the model's inputs are "
                             f"{[v.name for v in self._inputs]}")
        missing = [v.name for v in self._inputs if v.name not in feed]
        if missing:
            raise InputError(f"missing input(s) {missing}: feed a value for each of "
                             f"{[v.name for v in self._inputs]}")
        values = [self._check_one(v, feed[v.name]) for v in self._inputs]
        for name, places in self._shared_dims.items():
            sizes = {(i, d): int(values[i].shape[d]) for i, d in places}
            if len(set(sizes.values())) > 1:
                said = ", ".join(f"{self._inputs[i].name!r} dim {d} is {n}"
                                 for (i, d), n in sizes.items())
                raise InputError(f"inputs share the dim {name!r} but disagree on it: {said}; "
                                 "feed arrays of matching sizes")
        return values

    def _check_one(self, v: Value, x: Any):
        t = v.type
        if not isinstance(t, TensorType):
            return x  # sequences, optionals: passed through as given
        x = self.backend.accept_feed(x, t.dtype)
        dtype = self.backend.dtype_of(x)
        if t.dtype != DType.UNDEFINED and dtype != t.dtype:
            raise InputError(
                f"input {v.name!r} expects {t} but got an array of {dtype.onnx_name}; convert "
                f"it with .astype({t.dtype.numpy.name!r})")
        if t.shape is not None:
            shape = tuple(x.shape)
            if len(shape) != len(t.shape):
                raise InputError(
                    f"input {v.name!r} expects rank {len(t.shape)} {_fmt(t.shape)} but got "
                    f"shape {shape}")
            for i, (want, got) in enumerate(zip(t.shape, shape)):
                if isinstance(want, int) and want != got:
                    raise InputError(
                        f"input {v.name!r} dim {i} is fixed to {want} {_fmt(t.shape)} but got "
                        f"shape {shape}")
        return x


@contextlib.contextmanager
def _silenced(quiet: bool):
    """Warnings off inside (log_severity_level >= 3); else nothing: catch_warnings swaps
    process-wide state, which threads building sessions at once should not race on."""
    if not quiet:
        yield
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _shared_dims(inputs: list[Value]) -> dict[str, list[tuple[int, int]]]:
    """Symbolic dim names that two or more input positions share, with those positions
    (input index, axis): a run must give them one size."""
    places: dict[str, list[tuple[int, int]]] = {}
    for i, v in enumerate(inputs):
        if isinstance(v.type, TensorType) and v.type.shape is not None:
            for axis, d in enumerate(v.type.shape):
                if isinstance(d, SymDim) and d.symbol is not None:
                    places.setdefault(d.symbol, []).append((i, axis))
    return {name: p for name, p in places.items() if len(p) > 1}


def stop_check(run_options: Any):
    """The check a run with ``run_options`` makes between layers (None: nothing to check).
    Any object with ``terminate`` (set from another thread to stop the run) works,
    onnxruntime's RunOptions included; an optional ``time_limit_s`` bounds the run."""
    if run_options is None:
        return None
    limit = getattr(run_options, "time_limit_s", None)
    if limit is not None and not limit > 0:
        raise OptionError(f"time_limit_s must be a positive number of seconds, got {limit!r}")
    deadline = None if limit is None else perf_counter() + float(limit)

    def check() -> None:
        if run_options.terminate:
            raise RunCancelledError("the run was cancelled: run_options.terminate was set")
        if deadline is not None and perf_counter() > deadline:
            raise RunCancelledError(f"the run was cancelled: it took longer than its "
                                    f"time_limit_s of {limit} s")
    return check


def _types_inferred(model: Model) -> bool:
    """Whether Kiln's optimizer ran its rewrites on ``model`` (its value types are then
    what Kiln's shape inference, not only the file, says)."""
    from kiln.optimizer import MARK
    try:
        return int(model.metadata.get(MARK, -1)) >= 1
    except ValueError:
        return False


def _fixed_shapes(model: Model, given: dict | None, dims: dict[str, int]) -> dict | None:
    """``given`` shapes, plus those of the inputs whose symbolic dims ``dims`` sizes."""
    out = {}
    for v in model.graph.inputs if dims else ():
        shape = plain_shape(v.type.shape) if isinstance(v.type, TensorType) and \
            v.type.shape is not None else None
        if shape and any(d in dims for d in shape if isinstance(d, str)):
            out[v.name] = [dims.get(d, d) if isinstance(d, str) else d for d in shape]
    return {**out, **(given or {})} or None


def _fmt(shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"


def _c_ordered(to_numpy, x):
    """A result as onnxruntime hands it out: a C-ordered array, whatever layout a kernel
    left it in (torch's channels-last convolutions, NumPy's transposed views), because
    callers pass results on to ctypes, buffers and ``tobytes`` without looking."""
    a = to_numpy(x)
    if isinstance(a, np.ndarray) and not a.flags.c_contiguous:
        return np.ascontiguousarray(a)
    return a
