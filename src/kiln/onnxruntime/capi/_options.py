"""onnxruntime's ``SessionOptions`` and ``RunOptions`` at the level of its bindings, on
``kiln.session_api``'s: every field and config entry onnxruntime documents is honoured, met by the
way Kiln runs, or refused when the session is built (docs/compatibility.md lists which)."""

from __future__ import annotations

import enum
from typing import Any

from kiln.errors import OptionError
from kiln.onnxruntime.capi._errors import both, runtime_error
from kiln.session_api import RunOptions as KilnRunOptions
from kiln.session_api import SessionOptions as KilnSessionOptions
from kiln.session_api.options import RUN_ENTRIES, SESSION_ENTRIES  # noqa: F401 - re-exported
from kiln.session_api.options import check_entries as _check


def check_entries(config: dict[str, str], table: dict, what: str) -> None:
    """Kiln's check of config entries, failing as onnxruntime's bindings do (RuntimeError)."""
    _check(config, table, what, error=runtime_error)


class ExecutionOrder(enum.IntEnum):
    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


_REFUSED = {
    "register_custom_ops_library": "Kiln cannot load onnxruntime's C++ custom-op libraries; "
    "register a Python kernel with kiln.register_op instead",
    "add_provider": "providers are chosen with InferenceSession(providers=...)",
    "add_provider_for_devices": "providers are chosen with InferenceSession(providers=...)",
    "set_provider_selection_policy": "providers are chosen with InferenceSession(providers=)",
    "set_provider_selection_policy_delegate": "providers are chosen with "
    "InferenceSession(providers=...)",
    "set_ep_context_data_read_func": "Kiln has no compiled EP contexts",
    "set_load_cancellation_flag": "Kiln cannot cancel a model load",
}


class _AttributeChecked:
    """Setting an option that does not exist is an AttributeError, as in onnxruntime (and
    Kiln's OptionError)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._fields:
            raise both(OptionError, AttributeError)(
                f"{type(self).__name__} has no option {name!r}; it has "
                f"{', '.join(sorted(self._fields))}")
        object.__setattr__(self, name, value)

    def _get_entry(self, key: str) -> str:
        if key not in self._config:
            raise runtime_error(f"{self._what} does not have configuration with key: {key}")
        return self._config[key]


class SessionOptions(_AttributeChecked, KilnSessionOptions):
    """onnxruntime's SessionOptions (the same class as ``onnxruntime.SessionOptions``)."""

    _what = "SessionOptions"
    _fields = {**KilnSessionOptions._fields, "use_per_session_threads": True,
               "execution_order": ExecutionOrder.DEFAULT}

    def __init__(self):
        super().__init__()
        for k, v in {"initializers": {}, "external_initializers": {},
                     "files_in_memory": {}, "denotation_dims": {}, "refused": []}.items():
            object.__setattr__(self, k, v)

    def add_free_dimension_override_by_denotation(self, denotation: str, value: int) -> None:
        """Fix every input dim with this denotation to ``value``."""
        self.denotation_dims[str(denotation)] = int(value)

    def add_initializer(self, name: str, ortvalue) -> None:
        """Use ``ortvalue`` for the model's initializer ``name``."""
        self.initializers[str(name)] = _array_of(ortvalue)

    def add_external_initializers(self, names: list[str], ortvalues: list) -> None:
        """Values for initializers the model keeps as external data (by name)."""
        if len(names) != len(ortvalues):
            raise runtime_error("add_external_initializers: names and values differ in length")
        for n, v in zip(names, ortvalues):
            self.external_initializers[str(n)] = _array_of(v)

    def add_external_initializers_from_files_in_memory(self, names: list[str], buffers: list,
                                                       lengths: list[int]) -> None:
        """The contents of external-data files, by the file name the model gives."""
        if not len(names) == len(buffers) == len(lengths):
            raise runtime_error("add_external_initializers_from_files_in_memory: names, "
                                "buffers and lengths differ in length")
        for n, b, size in zip(names, buffers, lengths):
            self.files_in_memory[str(n)] = bytes(memoryview(b)[:int(size)])

    def _refuse(what: str):  # noqa: N805 - builds methods
        def method(self, *args, **kwargs):
            raise runtime_error(f"{what} is not available in Kiln: {_REFUSED[what]}")
        method.__name__ = what
        method.__doc__ = f"Refused: {_REFUSED[what]}"
        return method

    register_custom_ops_library = _refuse("register_custom_ops_library")
    add_provider = _refuse("add_provider")
    add_provider_for_devices = _refuse("add_provider_for_devices")
    set_provider_selection_policy = _refuse("set_provider_selection_policy")
    set_provider_selection_policy_delegate = _refuse("set_provider_selection_policy_delegate")
    set_ep_context_data_read_func = _refuse("set_ep_context_data_read_func")
    set_load_cancellation_flag = _refuse("set_load_cancellation_flag")
    del _refuse

    def clear_ep_context_data_read_func(self) -> None:
        """Nothing to clear: Kiln reads no EP context data."""

    def has_providers(self) -> bool:
        return False


class RunOptions(_AttributeChecked, KilnRunOptions):
    """onnxruntime's RunOptions (the same class as ``onnxruntime.RunOptions``)."""

    _what = "RunOptions"

    def __init__(self):
        super().__init__()
        object.__setattr__(self, "adapters", [])

    def add_active_adapter(self, adapter) -> None:
        """Apply a LoRA adapter's parameters in runs with these options."""
        self.adapters.append(adapter)


def _array_of(ortvalue):
    get = getattr(ortvalue, "_get_c_value", None)
    v = get() if get is not None else ortvalue
    return v.numpy() if hasattr(v, "numpy") else v
