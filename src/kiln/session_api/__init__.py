"""onnxruntime's Python API on Kiln: ``InferenceSession`` with ``SessionOptions``,
``RunOptions``, providers, model metadata, IO binding and profiling, so code written for
onnxruntime runs with ``kiln`` in its place. It sits above the runtime: the engine
(``kiln.runtime``) knows nothing of it. (It was ``kiln.ort``, a name that read as
onnxruntime's usual alias; :mod:`kiln.ort` remains as a re-export.)"""

from kiln.session_api.binding import IOBinding, OrtValue
from kiln.session_api.options import (
    ExecutionMode,
    GraphOptimizationLevel,
    RunOptions,
    SessionOptions,
    get_available_providers,
    get_device,
    set_default_logger_severity,
)
from kiln.session_api.session import InferenceSession, ModelMetadata

__all__ = ["ExecutionMode", "GraphOptimizationLevel", "IOBinding", "InferenceSession",
           "ModelMetadata", "OrtValue", "RunOptions", "SessionOptions",
           "get_available_providers", "get_device", "set_default_logger_severity"]
