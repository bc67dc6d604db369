"""``onnxruntime.capi.onnxruntime_pybind11_state`` on Kiln: what onnxruntime's compiled
bindings offer (exception classes, enums, the session, values, options and the process-wide
functions), written in Python over Kiln's engine."""

from __future__ import annotations

import numpy as np

from kiln.onnxruntime.capi._errors import (  # noqa: F401 - re-exported, as onnxruntime's
    EngineError,
    EPFail,
    Fail,
    InvalidArgument,
    InvalidGraph,
    InvalidProtobuf,
    ModelLoadCancelled,
    ModelLoaded,
    ModelRequiresCompilation,
    NoModel,
    NoSuchFile,
    NotFound,
    NotImplemented,
    RuntimeException,
    runtime_error,
)
from kiln.onnxruntime.capi._logging import (  # noqa: F401
    set_default_logger_callback,
    set_default_logger_severity,
    set_default_logger_verbosity,
)
from kiln.onnxruntime.capi._lora import AdapterFormat, LoraAdapter  # noqa: F401
from kiln.onnxruntime.capi._options import ExecutionOrder, RunOptions, SessionOptions  # noqa
from kiln.onnxruntime.capi._session import (  # noqa: F401
    ALL_PROVIDERS,
    GLOBAL_THREADS,
    InferenceSession,
    SessionIOBinding,
)
from kiln.onnxruntime.capi._session import default_session_options as get_default_session_options  # noqa: E501, F401
from kiln.onnxruntime.capi._values import (  # noqa: F401
    OrtAllocatorType,
    OrtDevice,
    OrtDeviceMemoryType,
    OrtMemoryInfo,
    OrtMemoryInfoDeviceType,
    OrtMemType,
    OrtSparseFormat,
    OrtValue,
    OrtValueVector,
    SparseCooView,
    SparseCsrView,
    SparseTensor,
    is_dlpack_uint8_tensor,
)
from kiln.runtime import NodeArg  # noqa: F401
from kiln.session_api import (  # noqa: F401
    ExecutionMode,
    GraphOptimizationLevel,
    ModelMetadata,
    get_device,  # noqa: F401
)
from kiln.session_api import get_available_providers as _providers

ModelLoadCanceled = ModelLoadCancelled

VERSION = "1.32.0"
"""The onnxruntime version whose Python API this package follows."""


def get_available_providers() -> list[str]:
    """The providers a session can use here (CPU; CUDA when torch sees a device)."""
    return _providers()


def get_all_providers() -> list[str]:
    """Every provider onnxruntime knows, in its default priority order (CPU last)."""
    return list(ALL_PROVIDERS)


def get_version_string() -> str:
    return VERSION


def get_build_info() -> str:
    import kiln
    return (f"ORT Build Info: Kiln {kiln.__version__} (a Python engine offering "
            f"onnxruntime {VERSION}'s API), numpy {np.__version__}")


def set_seed(seed: int) -> None:
    """Seed the generator random ops without a ``seed`` attribute draw from."""
    from kiln.ops.random import set_seed as seed_ops
    seed_ops(seed)


def set_global_thread_pool_sizes(intra_op_num_threads: int = 0,
                                 inter_op_num_threads: int = 0) -> None:
    """Thread pools shared by sessions built with ``use_per_session_threads = False``
    (their intra-op size becomes those sessions' thread count)."""
    GLOBAL_THREADS["intra"] = int(intra_op_num_threads)
    GLOBAL_THREADS["inter"] = int(inter_op_num_threads)


def enable_telemetry_events() -> None:
    """Kiln sends no telemetry; nothing to enable."""


def disable_telemetry_events() -> None:
    """Kiln sends no telemetry; nothing to disable."""


def has_collective_ops() -> bool:
    return False


def get_ep_devices() -> list:
    """No plugin execution-provider devices (onnxruntime's EP library API)."""
    return []


def register_execution_provider_library(name: str, path: str) -> None:
    raise runtime_error("Kiln cannot load onnxruntime's execution-provider libraries")


def unregister_execution_provider_library(name: str) -> None:
    raise runtime_error(f"no execution-provider library {name!r} was registered")


class OrtArenaCfg:
    """An arena configuration (kept as given; Kiln has no arenas of its own)."""

    _KEYS = ("max_mem", "arena_extend_strategy", "initial_chunk_size_bytes",
             "max_dead_bytes_per_chunk", "initial_growth_chunk_size_bytes",
             "max_power_of_two_extend_bytes")

    def __init__(self, *args):
        values = dict.fromkeys(self._KEYS, -1)
        if len(args) == 1 and isinstance(args[0], dict):
            for k, v in args[0].items():
                if k not in values:
                    raise runtime_error(f"Invalid OrtArenaCfg option: {k}")
                values[k] = int(v)
        else:
            values.update(zip(self._KEYS[:4], (int(a) for a in args)))
        for k, v in values.items():
            setattr(self, k, v)


def create_and_register_allocator(mem_info: OrtMemoryInfo, arena_cfg=None) -> None:
    """Accepted: sessions with ``session.use_env_allocators`` then share it. Kiln's
    arrays come from NumPy (and malloc's kept freed memory, enable_cpu_mem_arena), so a
    shared allocator changes nothing they compute."""
    if not isinstance(mem_info, OrtMemoryInfo):
        raise runtime_error("create_and_register_allocator takes an OrtMemoryInfo")


def create_and_register_allocator_v2(provider: str, mem_info: OrtMemoryInfo,
                                     options: dict, arena_cfg=None) -> None:
    if provider != "CPUExecutionProvider":
        raise runtime_error(f"Kiln registers no allocator for {provider}")
    create_and_register_allocator(mem_info, arena_cfg)
