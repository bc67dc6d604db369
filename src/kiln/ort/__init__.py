"""onnxruntime's Python API on Kiln: ``InferenceSession`` with ``SessionOptions``,
``RunOptions``, providers, model metadata, IO binding and profiling, so code written for
onnxruntime runs with ``kiln`` in its place. It sits above the runtime: the engine
(``kiln.runtime``) knows nothing of it."""

from kiln.ort.binding import IOBinding, OrtValue
from kiln.ort.options import (
    ExecutionMode,
    GraphOptimizationLevel,
    RunOptions,
    SessionOptions,
    get_available_providers,
    get_device,
    set_default_logger_severity,
)
from kiln.ort.session import InferenceSession, ModelMetadata

__all__ = ["ExecutionMode", "GraphOptimizationLevel", "IOBinding", "InferenceSession",
           "ModelMetadata", "OrtValue", "RunOptions", "SessionOptions",
           "get_available_providers", "get_device", "set_default_logger_severity"]
