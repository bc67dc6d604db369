"""onnxruntime's Python API on Kiln: ``SessionOptions``, ``RunOptions``, providers,
model metadata, IO binding and the profiling file, so code written for
``onnxruntime.InferenceSession`` runs with ``kiln`` in its place. The core session
(``runtime/session.py``) only calls :func:`configure` and mixes in :class:`OrtSessionApi`.
"""

from __future__ import annotations

import enum
import importlib.util
import json
import os
import threading
import warnings
from dataclasses import dataclass, field
from datetime import datetime
from time import perf_counter
from typing import Any

import numpy as np

from kiln.errors import InputError, OptionError, RunCancelledError
from kiln.ir import DType, Model, TensorType, plain_shape

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"


class GraphOptimizationLevel(enum.IntEnum):
    """onnxruntime's optimization levels (same values); see :data:`KILN_LEVEL`."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


KILN_LEVEL = {0: 0, 1: 1, 2: 2, 3: 2, 99: 2}
"""onnxruntime level -> Kiln optimizer level (Kiln's 2 is its default and highest)."""


class ExecutionMode(enum.IntEnum):
    """onnxruntime's execution modes; Kiln runs layers in order either way."""

    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class _Options:
    """Attributes as onnxruntime's option objects have them; setting an unknown one is an
    OptionError naming the known ones (onnxruntime: AttributeError)."""

    _fields: dict[str, Any] = {}

    def __init__(self):
        for k, v in self._fields.items():
            object.__setattr__(self, k, v)
        object.__setattr__(self, "_config", {})

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            raise OptionError(f"{type(self).__name__} has no option {name!r}; it has "
                              f"{', '.join(sorted(self._fields))}")
        object.__setattr__(self, name, value)

    def _set_entry(self, key: str, value: str) -> None:
        self._config[str(key)] = str(value)

    def _get_entry(self, key: str) -> str:
        if key not in self._config:
            raise OptionError(f"no config entry {key!r} was set")
        return self._config[key]


class SessionOptions(_Options):
    """onnxruntime's ``SessionOptions``. Honoured: ``intra_op_num_threads`` (0: as many as
    the usable cores), ``graph_optimization_level``, ``enable_profiling`` with
    ``profile_file_prefix``, ``optimized_model_filepath``, ``log_severity_level`` (3 or
    more silences Kiln's warnings while the session is built; -1, the default, takes
    :func:`set_default_logger_severity`'s level). Accepted with no effect
    (Kiln runs layers in order and plans memory itself): ``inter_op_num_threads``,
    ``execution_mode``, ``enable_mem_pattern``, ``enable_cpu_mem_arena``,
    ``enable_mem_reuse``, ``use_deterministic_compute``, ``logid``,
    ``log_verbosity_level`` and config entries. ``add_free_dimension_override_by_name``
    fixes a symbolic dim of the inputs (as ``input_shapes=`` does)."""

    _fields = {"intra_op_num_threads": 0,
               "graph_optimization_level": GraphOptimizationLevel.ORT_ENABLE_ALL,
               "enable_profiling": False, "profile_file_prefix": "onnxruntime_profile_",
               "optimized_model_filepath": "", "log_severity_level": -1,
               "inter_op_num_threads": 0, "execution_mode": ExecutionMode.ORT_SEQUENTIAL,
               "enable_mem_pattern": True, "enable_cpu_mem_arena": True,
               "enable_mem_reuse": True, "use_deterministic_compute": False, "logid": "",
               "log_verbosity_level": 0}

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "free_dims", {})

    def add_free_dimension_override_by_name(self, dim_name: str, dim_value: int) -> None:
        """Fix the inputs' symbolic dim ``dim_name`` to ``dim_value``."""
        self.free_dims[str(dim_name)] = int(dim_value)

    def add_session_config_entry(self, key: str, value: str) -> None:
        """Store a config entry (read back by get_session_config_entry; no effect)."""
        self._set_entry(key, value)

    def get_session_config_entry(self, key: str) -> str:
        """A config entry stored before."""
        return self._get_entry(key)


class RunOptions(_Options):
    """onnxruntime's ``RunOptions``: set ``terminate = True`` from any thread and the run
    using these options stops at the next layer boundary (RunCancelledError). Kiln's own
    ``time_limit_s`` stops a run that takes longer than that many seconds."""

    _fields = {"terminate": False, "time_limit_s": None, "log_severity_level": 2,
               "log_verbosity_level": 0, "logid": "", "only_execute_path_to_fetches": False}

    def add_run_config_entry(self, key: str, value: str) -> None:
        """Store a config entry (read back by get_run_config_entry; no effect)."""
        self._set_entry(key, value)

    def get_run_config_entry(self, key: str) -> str:
        """A config entry stored before."""
        return self._get_entry(key)


def stop_check(run_options: Any):
    """The check a run with ``run_options`` makes between layers (None: nothing to check).
    Any object with ``terminate`` works, onnxruntime's own RunOptions included."""
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


_default_severity = [2]


def set_default_logger_severity(level: int) -> None:
    """The log severity of sessions whose options leave it at -1 (onnxruntime's function):
    3 (error) or more silences Kiln's warnings while sessions are built."""
    if int(level) not in range(5):
        raise OptionError(f"log severity must be 0 (verbose) to 4 (fatal), got {level!r}")
    _default_severity[0] = int(level)


# -- providers -------------------------------------------------------------------------

def get_available_providers() -> list[str]:
    """The providers a session can use here, as onnxruntime names them (CUDA when torch
    sees a CUDA device)."""
    out = [CPU]
    if importlib.util.find_spec("torch") is not None:
        import torch
        if torch.cuda.is_available():
            out.insert(0, CUDA)
    return out


def get_device() -> str:
    """"GPU" when a CUDA provider is available, else "CPU" (as onnxruntime.get_device)."""
    return "GPU" if CUDA in get_available_providers() else "CPU"


@dataclass
class Config:
    """What a session is built with, from onnxruntime's arguments and Kiln's own."""

    backend: str
    options: dict[str, Any]
    providers: list[tuple[str, dict[str, str]]]
    level: int | None = None  # Kiln optimizer level; None: the session's optimize= decides
    quiet: bool = False
    profile_prefix: str | None = None
    save_to: str = ""
    sess_options: SessionOptions = field(default_factory=SessionOptions)

    def input_shapes(self, model: Model, given: dict | None) -> dict | None:
        """``given`` (Kiln's input_shapes), plus the inputs whose symbolic dims the
        options' free-dimension overrides fix."""
        dims = self.sess_options.free_dims
        out = {}
        for v in model.graph.inputs if dims else ():
            shape = plain_shape(v.type.shape) if isinstance(v.type, TensorType) and \
                v.type.shape is not None else None
            if shape and any(d in dims for d in shape if isinstance(d, str)):
                out[v.name] = [dims.get(d, d) if isinstance(d, str) else d for d in shape]
        return {**out, **(given or {})} or None


def configure(sess_options: SessionOptions | None, providers, provider_options,
              backend: str | None, options: dict[str, Any]) -> Config:
    """Map onnxruntime's session arguments onto a Kiln backend and its options; an
    unavailable provider warns and falls back to the next one, then the CPU, as
    onnxruntime does."""
    so = SessionOptions() if sess_options is None else sess_options
    if not isinstance(so, SessionOptions):
        hint = f"; for a backend write backend={so!r}" if isinstance(so, str) else ""
        raise OptionError("sess_options must be a kiln.SessionOptions (got "
                          f"{type(so).__name__}); build one with kiln.SessionOptions(){hint}")
    options = dict(options)
    chosen = _choose_provider(providers, provider_options)
    name, popts = chosen
    if name == CUDA:
        if backend not in (None, "torch"):
            raise OptionError(f"CUDAExecutionProvider runs on the torch backend, not "
                              f"{backend!r}; drop backend= or use the CPUExecutionProvider")
        backend = "torch"
        options.setdefault("device", f"cuda:{int(popts.get('device_id', 0))}")
    backend = backend or "numpy"
    if so.intra_op_num_threads:
        options.setdefault("threads", int(so.intra_op_num_threads))
    on_cuda = str(options.get("device", "cpu")).startswith("cuda")
    used = [(CUDA, {"device_id": str(options["device"]).partition(":")[2] or "0"}),
            (CPU, {})] if on_cuda else [(CPU, {})]
    level = None
    if sess_options is not None:
        try:
            level = KILN_LEVEL.get(int(so.graph_optimization_level))
        except (TypeError, ValueError):
            level = None
        if level is None:
            raise OptionError(f"graph_optimization_level {so.graph_optimization_level!r} is "
                              "not one of kiln.GraphOptimizationLevel's")
    severity = int(so.log_severity_level)
    quiet = (_default_severity[0] if severity < 0 else severity) >= 3
    return Config(backend, options, used, level, quiet,
                  so.profile_file_prefix if so.enable_profiling else None,
                  so.optimized_model_filepath or "", so)


def _choose_provider(providers, provider_options) -> tuple[str, dict]:
    if providers is None:
        return CPU, {}
    if isinstance(providers, str):
        raise OptionError("providers must be a list, e.g. ['CPUExecutionProvider']")
    listed = []
    for p in providers:
        if isinstance(p, tuple) and len(p) == 2:
            listed.append((str(p[0]), dict(p[1])))
        elif isinstance(p, str):
            listed.append((p, {}))
        else:
            raise OptionError(f"a provider is a name or a (name, options dict) pair, not {p!r}")
    if provider_options is not None:
        if len(provider_options) != len(listed):
            raise OptionError("providers and provider_options must have the same length")
        listed = [(n, {**o, **dict(po)}) for (n, o), po in zip(listed, provider_options)]
    available = get_available_providers()
    for n, o in listed:
        if n in available:
            return n, o
        warnings.warn(f"Specified provider {n!r} is not in available provider names. "
                      f"Available providers: {', '.join(available)}; Kiln falls back to "
                      f"the next one listed, else {CPU}", UserWarning, stacklevel=4)
    return CPU, {}


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


# -- values and IO binding -----------------------------------------------------------

def _torch():
    import torch
    return torch


class OrtValue:
    """A value on a device, as onnxruntime's ``OrtValue``: a NumPy array or, on the torch
    backend's devices, a torch tensor."""

    def __init__(self, value: Any):
        self.value = value

    @staticmethod
    def ortvalue_from_numpy(array: np.ndarray, device_type: str = "cpu",
                            device_id: int = 0) -> OrtValue:
        """Wrap ``array`` (copied to the CUDA device when ``device_type`` is "cuda")."""
        array = np.ascontiguousarray(array)
        if device_type == "cpu":
            return OrtValue(array)
        return OrtValue(_torch().from_numpy(array).to(f"{device_type}:{device_id}"))

    def numpy(self) -> np.ndarray:
        """The value as a NumPy array (copied to the host if on a device)."""
        v = self.value
        return v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)

    def shape(self) -> list[int]:
        return [int(d) for d in self.value.shape]

    def device_name(self) -> str:
        v = self.value
        return "cpu" if isinstance(v, np.ndarray) or v.device.type == "cpu" else v.device.type

    def element_type(self):
        v = self.value
        return v.dtype.type if isinstance(v, np.ndarray) else self.numpy().dtype.type

    def data_type(self) -> str:
        dt = np.dtype(self.element_type())
        return f"tensor({DType.from_numpy(dt).onnx_name})"

    def data_ptr(self) -> int:
        v = self.value
        return int(v.data_ptr()) if hasattr(v, "data_ptr") else int(v.ctypes.data)

    def is_tensor(self) -> bool:
        return True

    def has_value(self) -> bool:
        return True


def _at_pointer(device_type: str, device_id: int, element_type, shape, ptr: int):
    """An array viewing ``ptr`` (no copy): NumPy on the CPU, a torch tensor on CUDA."""
    dtype = np.dtype(element_type)
    iface = {"shape": tuple(int(d) for d in shape), "typestr": dtype.str,
             "data": (int(ptr), False), "version": 3}
    if device_type == "cpu":
        return np.asarray(type("Buffer", (), {"__array_interface__": iface})())
    if device_type != "cuda":
        raise OptionError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    holder = type("Buffer", (), {"__cuda_array_interface__": iface})()
    return _torch().as_tensor(holder, device=f"cuda:{device_id}")


class IOBinding:
    """Inputs and outputs bound to a session ahead of runs (``session.io_binding()``):
    bound inputs are converted to the backend's arrays once, when bound; outputs bound to
    a device stay there (torch tensors), outputs bound to a buffer are written into it."""

    def __init__(self, session):
        self.session = session
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, tuple[str, Any]] = {}  # name -> (device, buffer or None)
        self.results: list[Any] = []

    def bind_cpu_input(self, name: str, arr_on_cpu) -> None:
        """Bind a NumPy array to input ``name``."""
        self._bind(name, np.asarray(arr_on_cpu))

    def bind_input(self, name: str, device_type: str, device_id: int, element_type, shape,
                   buffer_ptr: int) -> None:
        """Bind the memory at ``buffer_ptr`` (``shape`` of ``element_type``, on
        ``device_type``/``device_id``) to input ``name``, without copying."""
        self._bind(name, _at_pointer(device_type, device_id, element_type, shape, buffer_ptr))

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._bind(name, ortvalue.value)

    def _bind(self, name: str, value) -> None:
        arg = {v.name: v for v in self.session._inputs}.get(name)
        if arg is None:
            raise InputError(f"unknown input name {name!r}; the model's inputs are "
                             f"{[v.name for v in self.session._inputs]}")
        self.inputs[name] = self.session._check_one(arg, value)

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type=None, shape=None, buffer_ptr: int | None = None) -> None:
        """Compute output ``name`` (any tensor of the model) onto ``device_type``, or into
        the buffer at ``buffer_ptr`` when given."""
        buf = None if buffer_ptr is None else \
            _at_pointer(device_type, device_id, element_type, shape, buffer_ptr)
        dev = "cpu" if device_type == "cpu" else f"{device_type}:{device_id}"
        self.outputs[name] = (dev, buf)

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        """Write output ``name`` into ``ortvalue``'s memory."""
        v = ortvalue.value
        self.outputs[name] = ("cpu" if isinstance(v, np.ndarray) else str(v.device), v)

    def clear_binding_inputs(self) -> None:
        self.inputs.clear()

    def clear_binding_outputs(self) -> None:
        self.outputs.clear()

    def synchronize_inputs(self) -> None:
        self._sync()

    def synchronize_outputs(self) -> None:
        self._sync()

    def _sync(self) -> None:
        if getattr(self.session.backend, "is_cuda", False):
            _torch().cuda.synchronize(self.session.backend.tdevice)

    def get_outputs(self) -> list[OrtValue]:
        """The last run's outputs, where they were bound."""
        return [OrtValue(x) for x in self.results]

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        """The last run's outputs as NumPy arrays."""
        return [OrtValue(x).numpy() for x in self.results]

    def run(self, run_options=None) -> None:
        """Run the session on the bound inputs into the bound outputs."""
        s = self.session
        names = list(self.outputs) or [v.name for v in s.model.graph.outputs]
        as_torch = s.backend.name == "torch"
        got = s.run(names, self.inputs, run_options,
                    output_type="torch" if as_torch else "numpy")
        results = []
        for name, x in zip(names, got):
            dev, buf = self.outputs.get(name, ("cpu", None))
            if buf is not None:
                _copy_into(buf, x)
                x = buf
            elif dev == "cpu":
                x = OrtValue(x).numpy()
            elif getattr(x, "device", None) is None or str(x.device) != dev:
                x = _torch().as_tensor(OrtValue(x).numpy() if not as_torch else x, device=dev)
            results.append(x)
        self.results = results


def _copy_into(buf, x) -> None:
    if tuple(buf.shape) != tuple(x.shape):
        raise InputError(f"a bound output buffer has shape {tuple(buf.shape)} but the output "
                         f"has shape {tuple(x.shape)}")
    if isinstance(buf, np.ndarray):
        buf[...] = OrtValue(x).numpy()
    else:
        buf.copy_(x if hasattr(x, "device") else _torch().from_numpy(np.asarray(x)))


class OrtSessionApi:
    """The onnxruntime methods of ``InferenceSession`` beyond running (mixed in)."""

    config: Config
    meta: ModelMetadata
    profiler: Profiler | None

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


__all__ = ["CPU", "CUDA", "Config", "ExecutionMode", "GraphOptimizationLevel", "IOBinding",
           "ModelMetadata", "OrtSessionApi", "OrtValue", "Profiler", "RunOptions",
           "SessionOptions", "configure", "get_available_providers", "get_device",
           "model_metadata", "set_default_logger_severity", "stop_check"]
