"""``kiln.InferenceSession``: Kiln's :class:`~kiln.runtime.session.Session` with
onnxruntime's Python API, so code written for ``onnxruntime.InferenceSession`` runs with
``kiln`` in its place: its arguments (``sess_options``, ``providers``,
``provider_options``), ``RunOptions``, providers, model metadata, IO binding and the
profiling file."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from datetime import datetime
from time import perf_counter, time_ns
from typing import Any

import numpy as np
import onnx

from kiln.ir import Model
from kiln.onnxio import save
from kiln.runtime.plan import Plan
from kiln.runtime.session import Session
from kiln.session_api.binding import IOBinding
from kiln.session_api.options import Config, SessionOptions, configure


class InferenceSession(Session):
    """Runs one model, as ``onnxruntime.InferenceSession`` does. Build once, call ``run``
    many times, from several threads at once if you like.

    Takes onnxruntime's arguments in its order (``sess_options``, ``providers``,
    ``provider_options``) and Kiln's own by keyword: ``backend`` (unless a CUDA
    provider asks for torch: the one ``kiln tune`` stored in the file with its options,
    else "torch" when torch is installed, else "numpy"; the CPUExecutionProvider runs on
    it too, and ``placement()`` names it), ``optimize`` (True, False or an optimizer
    level), ``input_shapes`` and the backend's options."""

    config: Config

    def __init__(self, path_or_bytes: Model | str | os.PathLike | bytes | onnx.ModelProto,
                 sess_options: SessionOptions | None = None, providers: list | None = None,
                 provider_options: list[dict] | None = None, *, backend: str | None = None,
                 optimize: bool | int | str = True,
                 input_shapes: dict[str, list[int | str | None]] | None = None,
                 **backend_options: Any):
        cfg = self.config = configure(sess_options, providers, provider_options, backend,
                                      backend_options)
        # Kiln's optimize= wins over the options' level unless left at its default.
        level = optimize if cfg.level is None or optimize is not True else cfg.level
        super().__init__(path_or_bytes, backend=cfg.backend, optimize=level,
                         input_shapes=input_shapes, dims=cfg.sess_options.free_dims,
                         quiet=cfg.quiet, **cfg.options)
        self.meta = model_metadata(self.source_header)
        if cfg.save_to:
            save(self.model, cfg.save_to)
        self.profiler = None if cfg.profile_prefix is None else \
            Profiler(cfg.profile_prefix, cfg.providers[0][0])

    def run(self, output_names: list[str] | None, input_feed: dict[str, Any],
            run_options: Any = None, *, output_type: str = "numpy") -> list:
        """As onnxruntime's run: ``[]`` or None asks for every output, and an output that
        would share memory with a fed array (an input that is also an output) is a copy,
        so the caller's array and the result never alias."""
        got = super().run(output_names or None, input_feed, run_options,
                          output_type=output_type)
        fed = [v for v in input_feed.values() if isinstance(v, np.ndarray)]
        return [x.copy() if isinstance(x, np.ndarray) and
                any(np.may_share_memory(x, f) for f in fed) else x for x in got]

    def execute_plan(self, plan: Plan, inputs: list, overrides: dict | None) -> list:
        """Run ``plan`` once, recorded by the profiler while profiling is on."""
        if self.profiler is None:
            return super().execute_plan(plan, inputs, overrides)
        return self.profiler.execute(plan, inputs, overrides)

    def get_providers(self) -> list[str]:
        """The providers this session uses, as onnxruntime names them."""
        return [n for n, _ in self.config.providers]

    def get_provider_options(self) -> dict[str, dict[str, str]]:
        """Each provider's options (strings), as onnxruntime reports them."""
        return {n: dict(o) for n, o in self.config.providers}

    def get_session_options(self) -> SessionOptions:
        """The SessionOptions the session was built with."""
        return self.config.sess_options

    def get_modelmeta(self) -> ModelMetadata:
        """The model's producer, graph name, domain, description, version and custom
        metadata, as loaded."""
        return self.meta

    def end_profiling(self) -> str:
        """Write the profile of the runs so far (enable_profiling) and return its file
        name; "" when profiling is off."""
        p, self.profiler = self.profiler, None
        return "" if p is None else p.write()

    def io_binding(self) -> IOBinding:
        """A new IOBinding for this session."""
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options=None) -> None:
        """Run on ``iobinding``'s inputs into its outputs (read them with its
        ``get_outputs()`` or ``copy_outputs_to_cpu()``)."""
        iobinding.run(run_options)


# -- metadata --------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelMetadata:
    """onnxruntime's ``ModelMetadata`` of the model as loaded."""

    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str]


def model_metadata(model: Model) -> ModelMetadata:
    """The metadata onnxruntime reports for ``model`` (taken before optimization)."""
    # An unset model_version reads as 0 here; onnxruntime reports INT64_MAX for it.
    version = model.model_version or np.iinfo(np.int64).max
    return ModelMetadata(model.producer_name, model.graph.name, model.domain, model.doc,
                         model.graph.doc, int(version), dict(model.metadata))


# -- profiling -------------------------------------------------------------------------

class Profiler:
    """Records a session's runs and layers while ``enable_profiling`` is set and writes
    them, on ``end_profiling()``, as onnxruntime does: a JSON list of Chrome trace
    events (chrome://tracing, https://ui.perfetto.dev)."""

    def __init__(self, prefix: str, provider: str):
        self.path = f"{prefix}_{datetime.now():%Y-%m-%d_%H-%M-%S}.json"
        self.provider = provider
        self.t0 = perf_counter()
        self.start_ns = time_ns()
        """When profiling started, in nanoseconds since the epoch (onnxruntime's
        get_profiling_start_time_ns)."""
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def add(self, cat: str, name: str, start: float, end: float, **args: Any) -> None:
        """One complete event, times from perf_counter."""
        ev = {"cat": cat, "pid": os.getpid(), "tid": threading.get_ident() % 2**31,
              "dur": round((end - start) * 1e6), "ts": round((start - self.t0) * 1e6),
              "ph": "X", "name": name, "args": args}
        with self.lock:
            self.events.append(ev)

    def execute(self, plan, inputs: list, overrides: dict | None) -> list:
        """Run ``plan`` once through its layer observer, recording the run and each layer."""
        def observe(step, a, b, result):
            node = step.node
            self.add("Node", f"{node.name or node.op_type}_kernel_time", a, b,
                     op_name=node.op_type, provider=self.provider, placement=step.placement)

        start = perf_counter()
        with plan.backend.run_context():
            out = plan.run(inputs, None, overrides, observer=observe)
        self.add("Session", "model_run", start, perf_counter())
        return out

    def write(self) -> str:
        """Write the trace file; returns its name."""
        with self.lock:
            text = json.dumps(self.events)
        with open(self.path, "w") as f:
            f.write(text)
        return self.path
