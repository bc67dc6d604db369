"""Running models: the precomputed plan, backends, and the InferenceSession."""

from kiln.runtime.ort_api import (
    ExecutionMode,
    GraphOptimizationLevel,
    IOBinding,
    ModelMetadata,
    OrtValue,
    RunOptions,
    SessionOptions,
    get_available_providers,
    get_device,
    set_default_logger_severity,
)
from kiln.runtime.session import InferenceSession, NodeArg

__all__ = ["ExecutionMode", "GraphOptimizationLevel", "IOBinding", "InferenceSession",
           "ModelMetadata", "NodeArg", "OrtValue", "RunOptions", "SessionOptions",
           "get_available_providers", "get_device", "set_default_logger_severity"]
