"""``InferenceSession``: the onnxruntime-compatible way to run a model."""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from kiln.errors import InputError, MissingDependencyError, OptionError
from kiln.ir import DType, Model, SymDim, TensorType, Value, plain_shape
from kiln.onnxio import load
from kiln.runtime.backend import Backend
from kiln.runtime.placement import PlacementReport
from kiln.runtime.plan import Plan, compile_model


@dataclass(frozen=True)
class NodeArg:
    """An input or output as onnxruntime describes it: name, shape (ints for fixed dims,
    strings for symbolic ones, None for unknown) and type string such as ``tensor(float)``."""

    name: str
    shape: list[int | str | None] | None
    type: str


def _node_arg(v: Value) -> NodeArg:
    shape = plain_shape(v.type.shape) if isinstance(v.type, TensorType) else None
    return NodeArg(v.name, shape, str(v.type) if v.type is not None else "unknown")


TORCH_INSTALL = 'pip install -e ".[torch]"'
"""How to get the torch backend's dependency (named when it is missing)."""


def make_backend(name: str, **options: Any) -> Backend:
    """The backend object for ``name`` ("numpy", or "torch" when installed)."""
    if name == "numpy":
        device = options.pop("device", "cpu")
        if device != "cpu":
            raise OptionError(f"the numpy backend runs on the CPU only; for device "
                              f"{device!r} use backend='torch'")
        if options:
            raise OptionError(f"the numpy backend takes no options (got {sorted(options)}); "
                              "threads, precision and compile are the torch backend's")
        return Backend()
    if name == "torch":
        try:
            from kiln.runtime.torch_backend import TorchBackend
        except ImportError as e:  # torch missing, or an install that cannot be imported
            if (e.name or "torch").split(".")[0] != "torch":
                raise
            raise MissingDependencyError("torch", TORCH_INSTALL, "the torch backend") from None
        unknown = sorted(set(options) - set(inspect.signature(TorchBackend).parameters))
        if unknown:
            raise OptionError(f"the torch backend has no option {', '.join(unknown)}; it takes "
                              "device, precision, compile, threads and channels_last")
        return TorchBackend(**options)
    hint = " (a GPU is backend='torch', device='cuda')" if name.startswith("cuda") else ""
    raise OptionError(f"unknown backend {name!r}; choose 'numpy' or 'torch'{hint}")


class InferenceSession:
    """Runs one model. Build once (the plan is computed here), call ``run`` many times,
    from several threads at once if you like."""

    def __init__(self, model: Model | str | os.PathLike | bytes | onnx.ModelProto,
                 backend: str = "numpy", optimize: bool = True,
                 input_shapes: dict[str, list[int | str | None]] | None = None,
                 **backend_options: Any):
        self.backend = make_backend(backend, **backend_options)  # bad options before any I/O
        self.model = model if isinstance(model, Model) else load(model)
        if optimize or input_shapes:
            # Kiln's optimizer (kiln.optimize); it works on a copy, so the caller's Model
            # is untouched. optimize=False with input_shapes only fixes the shapes.
            from kiln.optimize import optimize_for_session
            self.model = optimize_for_session(self.model, optimize, input_shapes,
                                              self.backend.name)
        g = self.model.graph
        self.plan: Plan = compile_model(g, self.model.opset_imports, self.model.functions,
                                        self.backend)
        self._inputs = list(g.inputs)
        self._overridable = {v.name: v for v in g.initializers.values()
                             if v.meta.get("overridable")}
        self._by_name = {v.name: v for v in self._inputs}
        self._shared_dims = _shared_dims(self._inputs)
        self._outputs = {v.name: i for i, v in enumerate(g.outputs)}

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
        return self._prepare_run(output_names, input_feed, output_type)()

    def run_async(self, output_names: list[str] | None, input_feed: dict[str, Any],
                  run_options: Any = None, *, output_type: str = "numpy"):
        """Queue a run and return at once an :class:`~kiln.runtime.async_run.AsyncRun`
        handle (``done()``, ``result()``, ``readback()``); runs execute in order. Feeds
        are checked now, so bad feeds raise here."""
        job = self._prepare_run(output_names, input_feed, output_type)
        if getattr(self, "_async", None) is None:
            from kiln.runtime.async_run import AsyncRunner
            self._async = AsyncRunner(self.backend)
        return self._async.submit(job)

    def placement(self) -> PlacementReport:
        """Where each layer runs and why (subgraph and function layers included), and
        what the last run moved between devices."""
        be = self.backend
        return PlacementReport(be.name, be.device, [s.layer for s in self.plan.walk()],
                               be.last_run_stats(), self.plan.compile_status)

    def _prepare_run(self, output_names, input_feed, output_type: str):
        if output_type not in ("numpy", "torch"):
            raise InputError(f"output_type must be 'numpy' or 'torch', got {output_type!r}")
        inputs = self._check_feed(input_feed)
        overrides = {v: self.backend.from_numpy(np.asarray(input_feed[n], v.const.dtype))
                     for n, v in self._overridable.items() if n in input_feed}
        try:
            picks = None if output_names is None else [self._outputs[n] for n in output_names]
        except KeyError as e:
            raise InputError(f"unknown output name {e.args[0]!r}; the model's outputs are "
                             f"{list(self._outputs)}") from None
        if output_type == "torch":
            from kiln.runtime.torch_backend import as_torch as convert
        else:
            convert = self.backend.to_numpy

        def job() -> list:
            values = self.backend.execute(self.plan, inputs, overrides)
            if picks is not None:
                values = [values[i] for i in picks]
            return [convert(x) for x in values]
        return job

    def _check_feed(self, feed: dict[str, Any]) -> list:
        if not isinstance(feed, dict):
            raise InputError("input_feed must be a dict mapping input names to arrays")
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


def _fmt(shape) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in shape) + ")"
