"""onnxruntime's option objects and providers on Kiln: ``SessionOptions``,
``RunOptions``, the optimization levels, provider choice, and how they map onto a Kiln
backend and its options (:func:`configure`)."""

from __future__ import annotations

import enum
import importlib.util
import warnings
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import OptionError
from kiln.runtime.backends import backend_entry, backends_where, reference_backend_name

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
    :func:`set_default_logger_severity`'s level), ``enable_cpu_mem_arena`` (False: this
    session leaves the process's malloc as it is; see :mod:`kiln.runtime.memory`).
    Met by how Kiln runs (one layer at a time, its own memory plan, deterministic
    kernels): ``inter_op_num_threads``, ``execution_mode``, ``enable_mem_pattern``,
    ``enable_mem_reuse``, ``use_deterministic_compute``, ``logid``,
    ``log_verbosity_level``. Config entries: those in :data:`SESSION_ENTRIES`, checked when
    the session is built (an unknown key or a refused value is an OptionError).
    ``add_free_dimension_override_by_name`` fixes a symbolic dim of the inputs (as
    ``input_shapes=`` does). docs/compatibility.md has the table."""

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
        """Store a config entry (read back by get_session_config_entry; checked against
        :data:`SESSION_ENTRIES` when a session is built)."""
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



_default_severity = [2]


def set_default_logger_severity(level: int) -> None:
    """The log severity of sessions whose options leave it at -1 (onnxruntime's function):
    3 (error) or more silences Kiln's warnings while sessions are built."""
    if int(level) not in range(5):
        raise OptionError(f"log severity must be 0 (verbose) to 4 (fatal), got {level!r}")
    _default_severity[0] = int(level)


# -- config entries ------------------------------------------------------------------------
# onnxruntime's documented session config keys (onnxruntime_session_options_config_keys.h)
# and what Kiln does with each. "met": the value asks for nothing Kiln would do otherwise
# (a thread-pool, allocator or onnxruntime-internal tuning with no effect on results);
# "honoured": Kiln does it; "refused": any value but the default raises at session build.
SESSION_ENTRIES: dict[str, tuple[str, str | None]] = {
    "session.optimized_model_external_initializers_file_name": ("honoured", None),
    "session.optimized_model_external_initializers_min_size_in_bytes": ("honoured", None),
    "session.record_ep_graph_assignment_info": ("honoured", None),
    "session.use_env_allocators": ("met", None),
    "session.intra_op.allow_spinning": ("met", None),
    "session.inter_op.allow_spinning": ("met", None),
    "session.force_spinning_stop": ("met", None),
    "session.disable_prepacking": ("met", None),
    "session.use_device_allocator_for_initializers": ("met", None),
    "session.intra_op_thread_affinities": ("met", None),
    "session.dynamic_block_base": ("met", None),
    "session.set_denormal_as_zero": ("refused", "0"),
    "session.load_model_format": ("refused", "ONNX"),
    "session.save_model_format": ("refused", "ONNX"),
    "session.use_ort_model_bytes_directly": ("refused", "0"),
    "session.use_ort_model_bytes_for_initializers": ("refused", "0"),
    "session.disable_quant_qdq": ("met", None),
    "session.disable_double_qdq_remover": ("met", None),
    "session.enable_quant_qdq_cleanup": ("met", None),
    "session.qdqisint8allowed": ("met", None),
    "session.x64quantprecision": ("met", None),
    "session.disable_aot_function_inlining": ("met", None),
    "session.disable_cpu_ep_fallback": ("met", None),
    "session.allow_released_opsets_only": ("met", None),
    "session.strict_shape_type_inference": ("met", None),
    "session.debug_layout_transformation": ("met", None),
    "session.minimal_build_optimizations": ("refused", ""),
    "session.graph_optimizations_loop_level": ("met", None),
    "session.model_external_initializers_file_folder_path": ("refused", ""),
    "session.save_external_prepacked_constant_initializers": ("refused", "0"),
    "session.collect_node_memory_stats_to_file": ("refused", ""),
    "session.disable_specified_optimizers": ("refused", ""),
    "session.qdq_matmulnbits_accuracy_level": ("met", None),
    "optimization.enable_gelu_approximation": ("refused", "0"),
    "optimization.enable_cast_chain_elimination": ("refused", "0"),
    "optimization.minimal_build_optimizations": ("refused", ""),
    "optimization.disable_specified_optimizers": ("refused", ""),
    "mlas.enable_gemm_fastmath_arm64_bfloat16": ("met", None),
    "ep.context_enable": ("refused", "0"),
    "ep.context_file_path": ("refused", ""),
    "ep.context_embed_mode": ("refused", "1"),
    "ep.context_node_name_prefix": ("refused", ""),
    "ep.share_ep_contexts": ("refused", "0"),
    "ep.stop_share_ep_contexts": ("refused", "0"),
    "ep.context_model_external_initializers_file_name": ("refused", ""),
    "kiln.intermediate_outputs": ("honoured", None),
}

RUN_ENTRIES: dict[str, tuple[str, str | None]] = {
    "memory.enable_memory_arena_shrinkage": ("met", None),
    "run.disable_synchronize_execution_providers": ("met", None),
    "gpu_graph_id": ("refused", "0"),
}


def check_entries(config: dict[str, str], table: dict, what: str,
                  error=OptionError) -> None:
    """Refuse unknown keys and refused values (``error``: an OptionError; onnxruntime's
    bindings raise RuntimeError)."""
    for key, value in config.items():
        kind, default = table.get(key, (None, None))
        if kind is None:
            raise error(
                f"{what} config entry {key!r}: Kiln does not know this key, and refuses "
                "what it cannot honour; see docs/compatibility.md for the keys it takes")
        if kind == "refused" and value != default:
            raise error(f"{what} config entry {key!r}={value!r} is not supported by "
                                f"Kiln (only the default {default!r})")


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

    backend: str | None  # None: the model file's stored settings, else the default
    options: dict[str, Any]
    providers: list[tuple[str, dict[str, str]]]
    level: int | None = None  # Kiln optimizer level; None: the session's optimize= decides
    quiet: bool = False
    profile_prefix: str | None = None
    save_to: str = ""
    sess_options: SessionOptions = field(default_factory=SessionOptions)


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
        gpu = backends_where(lambda e: "cuda" in e.devices)
        if backend is not None and backend not in gpu:
            raise OptionError(f"CUDAExecutionProvider runs on the {' or '.join(gpu)} "
                              f"backend, not {backend!r}; drop backend= or use the "
                              "CPUExecutionProvider")
        backend = backend or gpu[0]
        options.setdefault("device", f"cuda:{int(popts.get('device_id', 0))}")
    if so.use_deterministic_compute and backend is None:
        # asked for: settings a tuned file stores do not override it
        backend = reference_backend_name()
    if so.use_deterministic_compute and not backend_entry(backend).exact:
        exact = backends_where(lambda e: e.exact)
        raise OptionError(f"use_deterministic_compute: only the {' or '.join(exact)} "
                          "backend is known to give the same result run after run; use "
                          f"backend={exact[0]!r}")
    if so.intra_op_num_threads:
        options.setdefault("threads", int(so.intra_op_num_threads))
    options.setdefault("keep_freed_memory", bool(so.enable_cpu_mem_arena))
    on_cuda = str(options.get("device", "cpu")).startswith("cuda")
    used = [(CUDA, {"device_id": str(options["device"]).partition(":")[2] or "0"}),
            (CPU, {})] if on_cuda else [(CPU, {})]
    check_entries(so._config, SESSION_ENTRIES, "session")
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
