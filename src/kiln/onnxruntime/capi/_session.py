"""onnxruntime's ``C.InferenceSession`` and ``C.SessionIOBinding`` on Kiln: a
``kiln.session_api.InferenceSession`` built from the model as onnxruntime would prepare it, run
with onnxruntime's rules for feeds and results, its errors raised as onnxruntime's."""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np
import onnx

from kiln.errors import InputError, ModelLoadError, UnsupportedOpError
from kiln.onnxio import load, to_proto
from kiln.onnxruntime.capi import _model
from kiln.onnxruntime.capi._errors import Fail, as_ort, runtime_error, translated
from kiln.onnxruntime.capi._logging import log
from kiln.onnxruntime.capi._options import (
    RUN_ENTRIES,
    SESSION_ENTRIES,
    SessionOptions,
    check_entries,
)
from kiln.onnxruntime.capi._values import (
    OrtDevice,
    OrtMemoryInfo,
    OrtValue,
    OrtValueVector,
    SparseTensor,
    onnx_dtype,
    strings,
)
from kiln.runtime import NodeArg
from kiln.session_api import InferenceSession as KilnSession
from kiln.session_api import OrtValue as KilnOrtValue

ALL_PROVIDERS = ["TensorrtExecutionProvider", "CUDAExecutionProvider",
                 "MIGraphXExecutionProvider", "OpenVINOExecutionProvider",
                 "DnnlExecutionProvider", "VitisAIExecutionProvider", "QNNExecutionProvider",
                 "NnapiExecutionProvider", "VSINPUExecutionProvider", "JsExecutionProvider",
                 "CoreMLExecutionProvider", "DmlExecutionProvider", "RknpuExecutionProvider",
                 "WebNNExecutionProvider", "WebGpuExecutionProvider",
                 "XnnpackExecutionProvider", "CANNExecutionProvider", "AzureExecutionProvider",
                 "CPUExecutionProvider"]
"""Every provider onnxruntime 1.32 knows, highest priority first (get_all_providers)."""

GLOBAL_THREADS: dict[str, int] = {}
"""set_global_thread_pool_sizes: the process's shared pools ("intra", "inter")."""

KILN_KEYWORDS = ("backend", "optimize", "input_shapes", "device", "precision", "compile",
                 "threads")


def default_session_options() -> SessionOptions:
    return SessionOptions()


class _EpSubgraph:
    """Nodes assigned to one execution provider (one node each, as onnxruntime's CPU
    provider reports them)."""

    def __init__(self, ep_name: str, nodes: list):
        self.ep_name = ep_name
        self._nodes = nodes

    def get_nodes(self) -> list:
        return list(self._nodes)


class _EpNode:
    def __init__(self, domain: str, op_type: str, name: str):
        self.domain, self.op_type, self.name = domain, op_type, name


class InferenceSession:
    """onnxruntime's bound session: built by ``initialize_session``; runs take and give
    what onnxruntime's bindings do."""

    def __init__(self, sess_options: SessionOptions | None, model: Any, is_path: bool,
                 read_config_from_model: bool = False, **kiln_options: Any):
        so = sess_options if sess_options is not None else SessionOptions()
        if not isinstance(so, SessionOptions):
            raise runtime_error(f"sess_options must be an onnxruntime SessionOptions, not "
                                f"{type(so).__name__}")
        self._so = so
        self._model = model
        self._is_path = is_path
        self._read_config = read_config_from_model
        self._kiln = kiln_options
        self.engine: KilnSession | None = None
        self.prepared = _model.Prepared(model)

    # -- building ---------------------------------------------------------------------
    def initialize_session(self, providers: list[str], provider_options: list[dict],
                           disabled_optimizers: Any = None) -> None:
        """Build the session on ``providers`` (with their options)."""
        if disabled_optimizers:
            raise runtime_error("disabled_optimizers: Kiln's optimizer has no switch per "
                                "rewrite; use graph_optimization_level")
        for p in providers:
            if p not in ALL_PROVIDERS:
                raise runtime_error(f"Unknown Provider Type: {p}")
        so = self._effective_options()
        log(1, "Session", so.logid, "kiln.onnxruntime", "building a session on "
            f"{providers or ['CPUExecutionProvider']}")
        with translated():
            save_to = so.optimized_model_filepath
            object.__setattr__(so, "optimized_model_filepath", "")  # saved below
            try:
                prepared = self._build(so, providers, provider_options)
            finally:
                object.__setattr__(so, "optimized_model_filepath", save_to)
            if save_to:
                self._save_optimized(save_to, so)
        self.prepared = prepared
        self._effective = so
        log(0, "Session", so.logid, "kiln.onnxruntime",
            f"session ready: {len(self.engine.get_inputs())} inputs, "
            f"{len(self.engine.get_outputs())} outputs, providers {self.get_providers()}")

    def _effective_options(self) -> SessionOptions:
        """The options the session runs with: the caller's, checked, with the model's
        ort_config applied when asked (on a copy, as onnxruntime copies them)."""
        so = self._so
        check_entries(so._config, SESSION_ENTRIES, "session")
        if int(so.execution_order) != 0:
            raise runtime_error("execution_order: Kiln runs layers in its plan's order "
                                "only (ExecutionOrder.DEFAULT)")
        if GLOBAL_THREADS and so.use_per_session_threads:
            raise runtime_error("the process has global thread pools "
                                "(set_global_thread_pool_sizes): set "
                                "use_per_session_threads = False")
        if not self._read_config and not (GLOBAL_THREADS and not so.use_per_session_threads):
            return so
        copy = SessionOptions()
        for k in so._fields:
            object.__setattr__(copy, k, getattr(so, k))
        for k in ("_config", "free_dims", "initializers", "external_initializers",
                  "files_in_memory", "denotation_dims"):
            object.__setattr__(copy, k, dict(getattr(so, k)))
        if not so.use_per_session_threads and GLOBAL_THREADS.get("intra"):
            object.__setattr__(copy, "intra_op_num_threads", GLOBAL_THREADS["intra"])
        if self._read_config:
            with translated():
                for k, v in _model.ort_config(self._model, self._is_path).items():
                    if k not in copy._fields:
                        raise runtime_error(f"the model's ort_config sets {k!r}, which is "
                                            "not a SessionOptions field")
                    kind = type(copy._fields[k])
                    object.__setattr__(copy, k, kind(v) if kind in (bool, int, str) else
                                       type(getattr(copy, k))(v))
        return copy

    def _prepared(self, so: SessionOptions) -> _model.Prepared:
        """The model as Kiln will load it: edited when the options change it; parsed
        here when given as bytes (sparse parts made dense)."""
        src, is_path = self._model, self._is_path
        if isinstance(src, os.PathLike):
            src = os.fspath(src)
        if _model.needs_edit(so):
            return _model.prepare(src, is_path, so)
        if is_path and not isinstance(src, onnx.ModelProto):
            return _model.Prepared(src)
        proto = _model.read_proto(src if isinstance(src, onnx.ModelProto) else bytes(src),
                                  False)
        return _model.prepare(proto, False, so) if _model.has_sparse(proto) else \
            _model.Prepared(proto)

    def _build(self, so: SessionOptions, providers, provider_options) -> _model.Prepared:
        prepared = self._prepared(so)
        plist = [(p, dict(o)) for p, o in zip(providers, provider_options)] or None
        try:
            self.engine = KilnSession(_loaded(prepared), so, plist, **self._kiln)
        except (ModelLoadError, UnsupportedOpError):
            # A file with sparse parts: onnxruntime's sparse Constant spelling, its
            # SparseToDenseMatMul. Parsed again only then, so other files load once.
            if not (isinstance(prepared.source, str) and _sparse_file(prepared.source)):
                raise
            prepared = _model.prepare(prepared.source, True, so)
            self.engine = KilnSession(_loaded(prepared), so, plist, **self._kiln)
        return prepared

    def _save_optimized(self, path: str, so: SessionOptions) -> None:
        name = so._config.get("session.optimized_model_external_initializers_file_name")
        if not name:
            from kiln.onnxio import save
            save(self.engine.model, path)
            return
        size = int(so._config.get(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024"))
        proto = to_proto(self.engine.model)
        onnx.save_model(proto, path, save_as_external_data=True,
                        all_tensors_to_one_file=True, location=name, size_threshold=size)

    def set_providers(self, providers: list[str], provider_options: list[dict]) -> None:
        self.initialize_session(providers, provider_options)

    # -- describing -------------------------------------------------------------------
    @property
    def inputs_meta(self) -> list[NodeArg]:
        return [_arg(a) for a in self.engine.get_inputs()]

    @property
    def outputs_meta(self) -> list[NodeArg]:
        return [_arg(a) for a in self.engine.get_outputs()]

    @property
    def overridable_initializers(self) -> list[NodeArg]:
        return [_arg(a) for a in self.engine.get_overridable_initializers()]

    @property
    def model_meta(self):
        return self.engine.get_modelmeta()

    @property
    def session_options(self) -> SessionOptions:
        return self._effective

    def get_providers(self) -> list[str]:
        return self.engine.get_providers()

    def get_provider_options(self) -> dict:
        return self.engine.get_provider_options()

    @property
    def input_meminfos(self) -> list[OrtMemoryInfo]:
        return [OrtMemoryInfo("Cpu", 1, 0, 0) for _ in self.engine.get_inputs()]

    @property
    def output_meminfos(self) -> list[OrtMemoryInfo]:
        return [OrtMemoryInfo("Cpu", 1, 0, 0) for _ in self.engine.get_outputs()]

    @property
    def input_epdevices(self) -> list:
        return [None for _ in self.engine.get_inputs()]

    def get_provider_graph_assignment_info(self) -> list[_EpSubgraph]:
        """Each layer of the plan with the provider it runs on."""
        if self._effective._config.get("session.record_ep_graph_assignment_info") != "1":
            raise as_ort(InputError("Session configuration entry "
                                    "'session.record_ep_graph_assignment_info' must be set "
                                    "to \"1\" to retrieve EP graph assignment information."),
                         Fail)
        ep = self.get_providers()[0]
        nodes = {n.name: n for n in self.engine.model.graph.nodes}
        out = []
        for layer in self.engine.placement().layers:
            n = nodes.get(layer.name)
            domain = n.domain if n is not None else ""
            out.append(_EpSubgraph(ep, [_EpNode(domain, layer.op_type, layer.name)]))
        return out

    def end_profiling(self) -> str:
        return self.engine.end_profiling()

    def get_profiling_start_time_ns(self) -> int:
        p = self.engine.profiler
        return 0 if p is None else p.start_ns

    def get_tuning_results(self) -> list:
        return []

    def set_tuning_results(self, results, error_on_invalid: bool = False) -> None:
        raise runtime_error("Kiln has no tunable ops (onnxruntime: CUDA/ROCm only)")

    def is_webgpu_graph_capture_enabled(self) -> bool:
        return False

    # -- running ----------------------------------------------------------------------
    def run(self, output_names: list[str], input_feed: dict, run_options=None) -> list:
        """Outputs as onnxruntime's bindings return them: arrays (strings as object
        arrays of str), lists, dicts, C SparseTensors."""
        names = self._output_names(output_names)
        feed = {k: self._feed_value(k, v) for k, v in input_feed.items()}
        if run_options is not None:
            check_entries(getattr(run_options, "_config", {}), RUN_ENTRIES, "run")
            if getattr(run_options, "adapters", None):
                feed = {**_adapter_params(run_options.adapters), **feed}
        with translated():
            got = self.engine.run(names, feed, run_options)
        arrays = [v for v in feed.values() if isinstance(v, np.ndarray)]
        return [self._result(n, x, arrays) for n, x in zip(names, got)]

    def run_with_ort_values(self, feed: dict, output_names: list[str], run_options=None
                            ) -> OrtValueVector:
        values = {k: (v.value if isinstance(v, OrtValue) else v) for k, v in feed.items()}
        return OrtValueVector(OrtValue(x) for x in self.run(output_names, values,
                                                             run_options))

    def run_async(self, output_names, input_feed, callback, user_data, run_options=None):
        """Run on a thread; ``callback(results, user_data, error_message)`` after."""
        def job():
            try:
                res = self.run(output_names, input_feed, run_options)
            except Exception as e:  # noqa: BLE001 - reported to the callback, as onnxruntime
                callback(None, user_data, str(e))
                return
            callback(res, user_data, "")
        threading.Thread(target=job, daemon=True).start()

    def run_with_iobinding(self, binding: SessionIOBinding, run_options=None) -> None:
        if run_options is not None:
            check_entries(getattr(run_options, "_config", {}), RUN_ENTRIES, "run")
        with translated():
            binding.binding.run(run_options)

    def _output_names(self, output_names) -> list[str]:
        outs = [a.name for a in self.engine.get_outputs()]
        names = list(output_names) if output_names else outs
        if self._effective._config.get("kiln.intermediate_outputs") != "1":
            for n in names:
                if n not in outs:
                    raise as_ort(InputError(
                        f"Invalid output name: {n}; the model's outputs are {outs} (Kiln "
                        "returns any tensor of the model with the session config entry "
                        "kiln.intermediate_outputs = 1)"))
        return names

    def _feed_value(self, name: str, v: Any):
        if hasattr(v, "_get_c_value"):
            v = v._get_c_value()
        if isinstance(v, OrtValue):
            v = v.value
        if hasattr(v, "_get_c_tensor"):
            v = v._get_c_tensor()
        if isinstance(v, SparseTensor):
            return v.to_dense()
        if isinstance(v, (list, tuple)) and self._input_type(name).startswith("tensor("):
            if self._input_type(name) == "tensor(string)":
                return strings(np.array(v, dtype=object))
            return v
        if isinstance(v, np.ndarray) and v.dtype.kind in "OUSV":
            return strings(v)
        return v

    def _input_type(self, name: str) -> str:
        for a in self.engine.get_inputs():
            if a.name == name:
                return a.type
        return ""

    def _result(self, name: str, x: Any, fed: list[np.ndarray]):
        if name in self.prepared.sparse_outputs and isinstance(x, np.ndarray):
            return SparseTensor.from_dense(x)
        if not isinstance(x, np.ndarray):
            return x
        if x.dtype.kind in "US" or (x.dtype.kind == "O" and x.size
                                    and not isinstance(x.flat[0], str)):
            return strings(x)
        if any(np.may_share_memory(x, f) for f in fed):
            return x.copy()  # onnxruntime never hands back the caller's own buffer
        return x if x.base is not None else x.view()  # a view of the engine's buffer


def _arg(a: NodeArg) -> NodeArg:
    return NodeArg(a.name, [] if a.shape is None else a.shape, a.type)


def _loaded(prepared: _model.Prepared):
    src = prepared.source
    return load(src, base_dir=prepared.base_dir) if isinstance(src, onnx.ModelProto) else src


def _sparse_file(path: str) -> bool:
    """Whether a model file has sparse parts (checked only for small files: onnxruntime's
    sparse models are small, and parsing a big file twice would cost its load time)."""
    try:
        if os.path.getsize(path) > 16 << 20:
            return False
        return _model.has_sparse(onnx.load(path, load_external_data=False))
    except Exception:  # noqa: BLE001 - Kiln's own load reports what is wrong with the file
        return False


def _adapter_params(adapters: list) -> dict:
    out = {}
    for a in adapters:
        out.update(a.parameters())
    return out


class SessionIOBinding:
    """onnxruntime's ``C.SessionIOBinding`` on ``kiln.session_api``'s IOBinding."""

    def __init__(self, session: InferenceSession):
        self.session = session
        self.binding = session.engine.io_binding()

    def bind_input(self, name: str, device: OrtDevice, element_type, shape, ptr: int) -> None:
        with translated():
            self.binding.bind_input(name, device.name(), device.device_id(),
                                    onnx_dtype(element_type), shape, ptr)

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        with translated():
            self.binding.bind_ortvalue_input(name, KilnOrtValue(ortvalue.value))

    def bind_output(self, name: str, device: OrtDevice | None = None, element_type=None,
                    shape=None, ptr: int | None = None) -> None:
        device = device or OrtDevice(0)
        dtype = None if element_type is None else onnx_dtype(element_type)
        with translated():
            self.binding.bind_output(name, device.name(), device.device_id(), dtype, shape, ptr)

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        with translated():
            self.binding.bind_ortvalue_output(name, KilnOrtValue(ortvalue.value))

    def get_outputs(self) -> OrtValueVector:
        return OrtValueVector(OrtValue(x) for x in self.binding.results)

    def copy_outputs_to_cpu(self) -> list:
        return [OrtValue(x).numpy() for x in self.binding.results]

    def clear_binding_inputs(self) -> None:
        self.binding.clear_binding_inputs()

    def clear_binding_outputs(self) -> None:
        self.binding.clear_binding_outputs()

    def synchronize_inputs(self) -> None:
        self.binding.synchronize_inputs()

    def synchronize_outputs(self) -> None:
        self.binding.synchronize_outputs()
