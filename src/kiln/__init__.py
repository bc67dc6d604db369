"""Kiln: import ONNX models, optimize them, run them fast on CPU and GPU, fine-tune them
and save them back.

    import kiln
    sess = kiln.InferenceSession("model.onnx")          # numpy backend by default
    (y,) = sess.run(None, {"x": x})
"""

from kiln import model_names
from kiln.edit import add_tail, compose, cut, preprocess, rename, set_batch
from kiln.errors import (
    ExternalDataError,
    InputError,
    KernelError,
    KilnError,
    ModelLoadError,
    RunCancelledError,
    ShapeError,
    UnsupportedOpError,
)
from kiln.ir import DType, Model
from kiln.onnxio import load, save
from kiln.ops import register_op
from kiln.optimize import optimize  # loads the old module name first: it never shadows this
from kiln.quantize import convert_float16, quantize
from kiln.runtime import NodeArg, Session
from kiln.serving import serve
from kiln.session_api import (
    ExecutionMode,
    GraphOptimizationLevel,
    InferenceSession,
    IOBinding,
    OrtValue,
    RunOptions,
    SessionOptions,
    get_available_providers,
    get_device,
    set_default_logger_severity,
)
from kiln.tools import bench, inspect, profile, report, tune
from kiln.train import to_torch

__version__ = "0.1.0"

model_names.register()  # zoo names for the tools (the zoo is above them)

__all__ = ["DType", "ExecutionMode", "ExternalDataError", "GraphOptimizationLevel",
           "IOBinding", "OrtValue", "RunCancelledError", "RunOptions", "SessionOptions",
           "get_available_providers", "get_device", "set_default_logger_severity",
           "InferenceSession", "InputError", "KernelError",
           "KilnError", "Model", "ModelLoadError", "NodeArg", "Session", "ShapeError",
           "UnsupportedOpError", "add_tail", "bench", "compose", "convert_float16", "cut",
           "inspect", "load", "optimize", "preprocess", "profile", "quantize", "register_op",
           "report", "rename", "save", "serve", "set_batch", "to_torch", "tune"]
