"""ONNX's backend API (``onnx.backend.base.Backend``) on ``kiln.onnxruntime``:
``prepare(model)`` gives a rep whose ``run(inputs)`` returns the outputs."""

from __future__ import annotations

from typing import Any

from onnx import ModelProto
from onnx.backend.base import Backend

from kiln.onnxruntime.backend.backend_rep import OnnxRuntimeBackendRep
from kiln.onnxruntime.capi.onnxruntime_inference_collection import InferenceSession
from kiln.onnxruntime.capi.onnxruntime_pybind11_state import (
    SessionOptions,
    get_available_providers,
    get_device,
    runtime_error,
)

_SESSION_OPTIONS = frozenset({
    "enable_cpu_mem_arena", "enable_mem_pattern", "enable_mem_reuse", "execution_mode",
    "execution_order", "graph_optimization_level", "inter_op_num_threads",
    "intra_op_num_threads", "log_severity_level", "log_verbosity_level", "logid",
    "use_deterministic_compute", "use_per_session_threads"})


class OnnxRuntimeBackend(Backend):
    """ONNX's backend API with Kiln's onnxruntime-compatible session."""

    @classmethod
    def is_compatible(cls, model, device: str | None = None, **kwargs) -> bool:
        return cls.supports_device(device or get_device())

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return ("GPU" if device == "CUDA" else device) in get_device()

    @classmethod
    def prepare(cls, model, device: str | None = None, **kwargs: Any) -> OnnxRuntimeBackendRep:
        """A rep for ``model`` (path, bytes, ModelProto, session or rep)."""
        if isinstance(model, OnnxRuntimeBackendRep):
            return model
        if isinstance(model, InferenceSession):
            return OnnxRuntimeBackendRep(model)
        if isinstance(model, ModelProto):
            model = model.SerializeToString()
        options = SessionOptions()
        for k, v in kwargs.items():
            if k not in _SESSION_OPTIONS:
                raise runtime_error(f"SessionOptions attribute '{k}' is not permitted via "
                                    f"the backend API; allowed: {sorted(_SESSION_OPTIONS)}")
            setattr(options, k, v)
        if device is not None and not cls.supports_device(device):
            raise runtime_error(f"Incompatible device expected '{device}', got "
                                f"'{get_device()}'")
        sess = InferenceSession(model, sess_options=options,
                                providers=get_available_providers())
        return OnnxRuntimeBackendRep(sess)

    @classmethod
    def run_model(cls, model, inputs, device: str | None = None, **kwargs: Any):
        """``prepare(model).run(inputs)``."""
        rep = cls.prepare(model, device, **kwargs)
        return rep.run(inputs)

    @classmethod
    def run_node(cls, node, inputs, device=None, outputs_info=None, **kwargs):
        raise NotImplementedError("onnxruntime's backend does not run single nodes either")


is_compatible = OnnxRuntimeBackend.is_compatible
prepare = OnnxRuntimeBackend.prepare
run = OnnxRuntimeBackend.run_model
run_model = OnnxRuntimeBackend.run_model
supports_device = OnnxRuntimeBackend.supports_device
