"""``kiln.onnxruntime``: onnxruntime's Python package on Kiln's engine, laid out as
onnxruntime's is (top-level names, ``capi``, ``capi.onnxruntime_pybind11_state`` with its
exception classes, ``capi.onnxruntime_inference_collection``, ``backend``, ``datasets``),
so code written for onnxruntime runs on Kiln:

    import kiln.onnxruntime as ort              # in your own code
    kiln.onnxruntime.install()                  # or: `import onnxruntime` gives this package
    python -m kiln.onnxruntime script.py        # or: run a program with the alias installed

Kiln's errors raised through it are also instances of the classes onnxruntime raises in
the same situation. ``__version__`` is the onnxruntime version whose API this follows."""

from kiln.onnxruntime.capi._pybind_state import (  # noqa: F401
    ExecutionMode,
    ExecutionOrder,
    GraphOptimizationLevel,
    LoraAdapter,
    ModelMetadata,
    NodeArg,
    OrtAllocatorType,
    OrtArenaCfg,
    OrtDeviceMemoryType,
    OrtMemoryInfo,
    OrtMemoryInfoDeviceType,
    OrtMemType,
    OrtSparseFormat,
    RunOptions,
    SessionIOBinding,
    SessionOptions,
    create_and_register_allocator,
    create_and_register_allocator_v2,
    disable_telemetry_events,
    enable_telemetry_events,
    get_all_providers,
    get_available_providers,
    get_build_info,
    get_device,
    get_ep_devices,
    get_version_string,
    has_collective_ops,
    register_execution_provider_library,
    set_default_logger_callback,
    set_default_logger_severity,
    set_default_logger_verbosity,
    set_global_thread_pool_sizes,
    set_seed,
    unregister_execution_provider_library,
)
from kiln.onnxruntime.capi.onnxruntime_inference_collection import (  # noqa: F401
    AdapterFormat,
    InferenceSession,
    IOBinding,
    ModelCompiler,
    OrtDevice,
    OrtDeviceVendorId,
    OrtValue,
    SparseTensor,
    copy_tensors,
)
from kiln.onnxruntime.capi.onnxruntime_pybind11_state import VERSION as __version__  # noqa: F401
from kiln.onnxruntime.switch import install, installed, uninstall  # noqa: F401

__author__ = "Kiln (onnxruntime's API)"
