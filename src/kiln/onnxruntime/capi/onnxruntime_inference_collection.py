"""``onnxruntime.capi.onnxruntime_inference_collection`` on Kiln: the Python classes
onnxruntime's users call (``InferenceSession``, ``IOBinding``, ``OrtValue``,
``OrtDevice``, ``SparseTensor``...), each wrapping its counterpart in the bindings layer
(``_sess``, ``_ortvalue``, ``_ort_device``...) as onnxruntime's do."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

import numpy as np

from kiln.onnxruntime.capi import _pybind_state as C
from kiln.onnxruntime.capi._session import KILN_KEYWORDS


def get_ort_device_type(device_type: str) -> int:
    """The OrtDevice type number of a device name."""
    types = {"cuda": 1, "gpu": 1, "webgpu": 1, "cpu": 0, "cann": 3, "npu": 3, "dml": 4}
    if device_type not in types:
        raise Exception("Unsupported device type: " + device_type)  # noqa: TRY002
    return types[device_type]


class OrtDeviceVendorId(IntEnum):
    """PCI vendor ids, as onnxruntime's OrtDevice reports them."""

    NONE = 0x0000
    AMD = 0x1002
    NVIDIA = 0x10DE
    ARM = 0x13B5
    MICROSOFT = 0x1414
    HUAWEI = 0x19E5
    QUALCOMM = 0x5143
    INTEL = 0x8086


_VENDORS = {"cuda": OrtDeviceVendorId.NVIDIA, "dml": OrtDeviceVendorId.MICROSOFT,
            "cann": OrtDeviceVendorId.HUAWEI}


def check_and_normalize_provider_args(providers, provider_options, available_provider_names):
    """onnxruntime's check of ``providers`` / ``provider_options``: returns the provider
    names (duplicates dropped with a warning) and their options with string keys and
    values; ValueError for anything malformed."""
    if providers is None:
        return [], []
    names: dict[str, dict[str, str]] = {}

    def add(name, options):
        if name in names:
            warnings.warn(f"Duplicate provider '{name}' encountered, ignoring.",
                          UserWarning, stacklevel=3)
            return
        names[name] = {str(k): str(v) for k, v in options.items()}

    if not isinstance(providers, Sequence) or isinstance(providers, str):
        raise ValueError("'providers' should be a sequence.")
    if provider_options is not None:
        if not isinstance(provider_options, Sequence) or isinstance(provider_options, str):
            raise ValueError("'provider_options' should be a sequence.")
        if len(providers) != len(provider_options):
            raise ValueError("'providers' and 'provider_options' should be the same length "
                             "if both are given.")
        if not all(isinstance(p, str) for p in providers):
            raise ValueError("Only string values for 'providers' are supported if "
                             "'provider_options' is given.")
        if not all(isinstance(o, dict) for o in provider_options):
            raise ValueError("'provider_options' values must be dicts.")
        for p, o in zip(providers, provider_options):
            add(p, o)
    else:
        for p in providers:
            if isinstance(p, str):
                add(p, {})
            elif isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) \
                    and isinstance(p[1], dict):
                add(p[0], p[1])
            else:
                raise ValueError("'providers' values must be either strings or "
                                 "(string, dict) tuples.")
    return list(names), list(names.values())


class Session:
    """What every onnxruntime session offers; ``self._sess`` is the bound session."""

    def __init__(self, enable_fallback: bool = True):
        self._sess: C.InferenceSession | None = None
        self._enable_fallback = enable_fallback

    def get_session_options(self) -> C.SessionOptions:
        return self._sess_options

    def get_inputs(self) -> list[C.NodeArg]:
        return self._inputs_meta

    def get_outputs(self) -> list[C.NodeArg]:
        return self._outputs_meta

    def get_overridable_initializers(self) -> list[C.NodeArg]:
        return self._overridable_initializers

    def get_modelmeta(self) -> C.ModelMetadata:
        return self._model_meta

    def get_input_memory_infos(self) -> list[C.OrtMemoryInfo]:
        return self._sess.input_meminfos

    def get_output_memory_infos(self) -> list[C.OrtMemoryInfo]:
        return self._sess.output_meminfos

    def get_input_epdevices(self) -> list:
        return self._sess.input_epdevices

    def get_providers(self) -> list[str]:
        return self._providers

    def get_provider_options(self) -> dict:
        return self._provider_options

    def get_provider_graph_assignment_info(self) -> list:
        """Each layer and the provider it runs on (needs the session config entry
        ``session.record_ep_graph_assignment_info`` = "1")."""
        return self._sess.get_provider_graph_assignment_info()

    def set_providers(self, providers=None, provider_options=None) -> None:
        """Rebuild the session on ``providers``."""
        self._reset_session(providers, provider_options)

    def disable_fallback(self) -> None:
        self._enable_fallback = False

    def enable_fallback(self) -> None:
        self._enable_fallback = True

    def _validate_input(self, feed_input_names) -> None:
        missing = [i.name for i in self._inputs_meta
                   if i.name not in feed_input_names and not i.type.startswith("optional")]
        if missing:
            raise ValueError(f"Required inputs ({missing}) are missing from input feed "
                             f"({feed_input_names}).")

    def run(self, output_names, input_feed, run_options=None) -> list:
        """The outputs ``output_names`` (all when None or empty) for ``input_feed``:
        arrays, lists, dicts or SparseTensors."""
        self._validate_input(list(input_feed.keys()))
        if not output_names:
            output_names = [o.name for o in self._outputs_meta]
        return [SparseTensor(x) if isinstance(x, C.SparseTensor) else x
                for x in self._sess.run(output_names, input_feed, run_options)]

    def run_async(self, output_names, input_feed, callback, user_data, run_options=None):
        """Run on another thread; then ``callback(results, user_data, error)``."""
        self._validate_input(list(input_feed.keys()))
        if not output_names:
            output_names = [o.name for o in self._outputs_meta]
        return self._sess.run_async(output_names, input_feed, callback, user_data,
                                    run_options)

    def run_with_ort_values(self, output_names, input_dict_ort_values, run_options=None
                            ) -> list[OrtValue]:
        """Like run, with OrtValues in and out."""
        self._validate_input(list(input_dict_ort_values.keys()))
        if not output_names:
            output_names = [o.name for o in self._outputs_meta]
        feed = {k: v._get_c_value() if isinstance(v, OrtValue) else v
                for k, v in input_dict_ort_values.items()}
        return [OrtValue(v) for v in self._sess.run_with_ort_values(feed, output_names,
                                                                    run_options)]

    def end_profiling(self) -> str:
        return self._sess.end_profiling()

    def get_profiling_start_time_ns(self) -> int:
        return self._sess.get_profiling_start_time_ns()

    def io_binding(self) -> IOBinding:
        return IOBinding(self)

    def run_with_iobinding(self, iobinding: IOBinding, run_options=None) -> None:
        self._sess.run_with_iobinding(iobinding._iobinding, run_options)

    def get_tuning_results(self) -> list:
        return self._sess.get_tuning_results()

    def set_tuning_results(self, results, *, error_on_invalid: bool = False) -> None:
        return self._sess.set_tuning_results(results, error_on_invalid)

    def set_ep_dynamic_options(self, options: dict[str, str]) -> None:
        raise C.runtime_error("Kiln's providers have no dynamic options")

    def create_ortvalue_from_shape_and_type(self, shape, element_type, device: OrtDevice
                                            ) -> OrtValue:
        return OrtValue.ortvalue_from_shape_and_type(shape, element_type,
                                                     device.name(), device.device_id())


class InferenceSession(Session):
    """onnxruntime's InferenceSession on Kiln. Besides onnxruntime's arguments it takes
    Kiln's own by keyword (``backend``, ``optimize``, ``input_shapes``, ``device``,
    ``precision``, ``compile``, ``threads``)."""

    def __init__(self, path_or_bytes: str | bytes | os.PathLike, sess_options=None,
                 providers=None, provider_options=None, **kwargs: Any):
        super().__init__(enable_fallback=int(kwargs.pop("enable_fallback", 1)) == 1)
        import onnx
        if isinstance(path_or_bytes, (str, os.PathLike)):
            self._model_path, self._model_bytes = os.fspath(path_or_bytes), None
        elif isinstance(path_or_bytes, (bytes, bytearray, memoryview)):
            self._model_path, self._model_bytes = None, bytes(path_or_bytes)
        elif isinstance(path_or_bytes, onnx.ModelProto):
            self._model_path, self._model_bytes = None, path_or_bytes
        else:
            raise TypeError(f"Unable to load from type '{type(path_or_bytes)}'")
        self._sess_options = sess_options
        self._sess_options_initial = sess_options
        self._read_config_from_model = os.environ.get("ORT_LOAD_CONFIG_FROM_MODEL") == "1"
        disabled = kwargs.pop("disabled_optimizers", None)
        unknown = [k for k in kwargs if k not in KILN_KEYWORDS]
        if unknown:
            raise C.runtime_error(f"InferenceSession got unexpected keyword argument(s) "
                                  f"{unknown}; Kiln's own are {list(KILN_KEYWORDS)}")
        self._kiln_options = kwargs
        self._create_inference_session(providers, provider_options, disabled)

    def _create_inference_session(self, providers, provider_options, disabled=None) -> None:
        available = C.get_available_providers()
        providers, provider_options = check_and_normalize_provider_args(
            providers, provider_options, available)
        for p in providers:
            if p not in C.ALL_PROVIDERS:
                raise C.runtime_error(f"Unknown Provider Type: {p}")
        usable = [(p, o) for p, o in zip(providers, provider_options) if p in available]
        skipped = [p for p in providers if p not in available]
        if skipped:
            warnings.warn(f"Specified provider(s) {skipped} are not in available provider "
                          f"names. Available providers: '{', '.join(available)}'",
                          UserWarning, stacklevel=3)
        path = self._model_path is not None
        sess = C.InferenceSession(self._sess_options, self._model_path if path else
                                  self._model_bytes, path, self._read_config_from_model,
                                  **self._kiln_options)
        sess.initialize_session([p for p, _ in usable], [o for _, o in usable], disabled)
        self._sess = sess
        self._sess_options = sess.session_options
        self._inputs_meta = sess.inputs_meta
        self._outputs_meta = sess.outputs_meta
        self._overridable_initializers = sess.overridable_initializers
        self._model_meta = sess.model_meta
        self._providers = sess.get_providers()
        self._provider_options = sess.get_provider_options()
        self._profiling_start_time_ns = sess.get_profiling_start_time_ns()

    def _reset_session(self, providers, provider_options) -> None:
        self._sess_options = self._sess_options_initial
        self._create_inference_session(providers, provider_options)


class IOBinding:
    """Inputs and outputs bound to a session ahead of its runs."""

    def __init__(self, session: Session):
        self._iobinding = C.SessionIOBinding(session._sess)
        self._numpy_obj_references: dict[str, np.ndarray] = {}

    def bind_cpu_input(self, name: str, arr_on_cpu) -> None:
        self._numpy_obj_references[name] = arr_on_cpu
        self._iobinding.bind_ortvalue_input(name, C.OrtValue.ortvalue_from_numpy(arr_on_cpu))

    def bind_input(self, name: str, device_type: str, device_id: int, element_type, shape,
                   buffer_ptr: int) -> None:
        device = C.OrtDevice(get_ort_device_type(device_type), 0, device_id)
        self._iobinding.bind_input(name, device, element_type, shape, buffer_ptr)

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._iobinding.bind_ortvalue_input(name, ortvalue._ortvalue)

    def synchronize_inputs(self) -> None:
        self._iobinding.synchronize_inputs()

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type=None, shape=None, buffer_ptr: int | None = None) -> None:
        device = C.OrtDevice(get_ort_device_type(device_type), 0, device_id)
        if buffer_ptr is None:
            self._iobinding.bind_output(name, device)
        else:
            if element_type is None or shape is None:
                raise ValueError("`element_type` and `shape` are to be provided if "
                                 "pre-allocated memory is provided")
            self._iobinding.bind_output(name, device, element_type, shape, buffer_ptr)

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        self._iobinding.bind_ortvalue_output(name, ortvalue._ortvalue)

    def synchronize_outputs(self) -> None:
        self._iobinding.synchronize_outputs()

    def get_outputs(self) -> list[OrtValue]:
        return [OrtValue(v) for v in self._iobinding.get_outputs()]

    def get_outputs_as_ortvaluevector(self) -> C.OrtValueVector:
        return self._iobinding.get_outputs()

    def copy_outputs_to_cpu(self) -> list:
        return self._iobinding.copy_outputs_to_cpu()

    def clear_binding_inputs(self) -> None:
        self._iobinding.clear_binding_inputs()

    def clear_binding_outputs(self) -> None:
        self._iobinding.clear_binding_outputs()


class OrtValue:
    """A value for or from a session: a tensor on a device, a sequence, a map or a
    sparse tensor. ``np.asarray(v)`` views a CPU tensor's memory."""

    def __init__(self, ortvalue: C.OrtValue, numpy_obj: np.ndarray | None = None):
        self._ortvalue = ortvalue
        self._numpy_obj = numpy_obj

    def _get_c_value(self) -> C.OrtValue:
        return self._ortvalue

    @classmethod
    def ortvalue_from_numpy(cls, numpy_obj, device_type: str = "cpu", device_id: int = 0,
                            vendor_id: int = -1) -> OrtValue:
        device = C.OrtDevice(get_ort_device_type(device_type), 0, device_id)
        v = C.OrtValue.ortvalue_from_numpy(numpy_obj, device)
        return cls(v, numpy_obj if device_type.lower() == "cpu" else None)

    @classmethod
    def ortvalue_from_numpy_with_onnx_type(cls, data: np.ndarray, /, onnx_element_type: int
                                           ) -> OrtValue:
        return cls(C.OrtValue(np.ascontiguousarray(data), int(onnx_element_type)), data)

    @classmethod
    def ortvalue_from_shape_and_type(cls, shape, element_type, device_type: str = "cpu",
                                     device_id: int = 0, vendor_id: int = -1) -> OrtValue:
        device = C.OrtDevice(get_ort_device_type(device_type), 0, device_id)
        return cls(C.OrtValue.ortvalue_from_shape_and_type(shape, element_type, device))

    @classmethod
    def ort_value_from_sparse_tensor(cls, sparse_tensor: SparseTensor) -> OrtValue:
        return cls(C.OrtValue.ort_value_from_sparse_tensor(sparse_tensor._get_c_tensor()))

    def as_sparse_tensor(self) -> SparseTensor:
        return SparseTensor(self._ortvalue.as_sparse_tensor())

    def data_ptr(self) -> int:
        return self._ortvalue.data_ptr()

    def device_name(self) -> str:
        return self._ortvalue.device_name().lower()

    def shape(self) -> list[int]:
        return self._ortvalue.shape()

    def data_type(self) -> str:
        return self._ortvalue.data_type()

    def element_type(self) -> int:
        return self._ortvalue.element_type()

    def tensor_size_in_bytes(self) -> int:
        return self._ortvalue.tensor_size_in_bytes()

    def has_value(self) -> bool:
        return self._ortvalue.has_value()

    def is_tensor(self) -> bool:
        return self._ortvalue.is_tensor()

    def is_sparse_tensor(self) -> bool:
        return self._ortvalue.is_sparse_tensor()

    def is_tensor_sequence(self) -> bool:
        return self._ortvalue.is_tensor_sequence()

    def numpy(self):
        return self._ortvalue.numpy()

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        arr = self._ortvalue.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            return arr.astype(dtype)
        return np.array(arr, copy=True) if copy else arr

    def __dlpack__(self, *, stream=None, **kw):
        return self._ortvalue.__dlpack__(stream=stream, **kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._ortvalue.__dlpack_device__()

    @classmethod
    def from_dlpack(cls, data, /) -> OrtValue:
        """An OrtValue sharing the memory of ``data`` (a DLPack capsule or an object with
        ``__dlpack__``)."""
        if isinstance(data, OrtValue):
            data = data._ortvalue
        return cls(C.OrtValue.from_dlpack(data, False))

    def update_inplace(self, np_arr) -> None:
        self._ortvalue.update_inplace(np_arr)


def copy_tensors(src: Sequence[OrtValue], dst: Sequence[OrtValue], stream=None) -> None:
    """Copy each source tensor into its destination's memory."""
    for s, d in zip(src, dst):
        d.update_inplace(s.numpy())


class OrtDevice:
    """A device (type, id, memory type, vendor)."""

    def __init__(self, c_ort_device: C.OrtDevice):
        if not isinstance(c_ort_device, C.OrtDevice):
            raise ValueError("`Provided object` needs to be of type "
                             "`onnxruntime.capi.onnxruntime_pybind11_state.OrtDevice`")
        self._ort_device = c_ort_device

    def _get_c_device(self) -> C.OrtDevice:
        return self._ort_device

    @staticmethod
    def make(ort_device_name: str, device_id: int, vendor_id: int = -1) -> OrtDevice:
        name = ort_device_name.lower()
        if vendor_id < 0:
            vendor_id = int(_VENDORS.get(name, OrtDeviceVendorId.NONE))
        return OrtDevice(C.OrtDevice(get_ort_device_type(name), C.OrtDevice.default_memory(),
                                     device_id, vendor_id))

    def device_id(self) -> int:
        return self._ort_device.device_id()

    def device_type(self) -> int:
        return self._ort_device.device_type()

    def device_vendor_id(self) -> int:
        return self._ort_device.vendor_id()

    def device_mem_type(self) -> int:
        return self._ort_device.mem_type()

    def name(self) -> str:
        return self._ort_device.name()


class SparseTensor:
    """A sparse tensor (COO or CSR) on the CPU; sessions take and give them where the
    model declares sparse inputs and outputs."""

    def __init__(self, sparse_tensor: C.SparseTensor):
        if not isinstance(sparse_tensor, C.SparseTensor):
            raise TypeError(f"Unsupported type: {type(sparse_tensor)}")
        self._tensor = sparse_tensor

    def _get_c_tensor(self) -> C.SparseTensor:
        return self._tensor

    @staticmethod
    def sparse_coo_from_numpy(dense_shape, values, coo_indices, ort_device: OrtDevice
                              ) -> SparseTensor:
        return SparseTensor(C.SparseTensor.sparse_coo_from_numpy(
            dense_shape, values, coo_indices, ort_device._get_c_device()))

    @staticmethod
    def sparse_csr_from_numpy(dense_shape, values, inner_indices, outer_indices,
                              ort_device: OrtDevice) -> SparseTensor:
        return SparseTensor(C.SparseTensor.sparse_csr_from_numpy(
            dense_shape, values, inner_indices, outer_indices, ort_device._get_c_device()))

    def values(self) -> np.ndarray:
        return self._tensor.values()

    def as_coo_view(self):
        return self._tensor.as_coo_view()

    def as_csrc_view(self):
        return self._tensor.as_csrc_view()

    def as_blocksparse_view(self):
        return self._tensor.as_blocksparse_view()

    def to_cuda(self, ort_device: OrtDevice) -> SparseTensor:
        return SparseTensor(self._tensor.to_cuda(ort_device._get_c_device()))

    def format(self) -> C.OrtSparseFormat:
        return self._tensor.format()

    def dense_shape(self) -> list[int]:
        return self._tensor.dense_shape()

    def data_type(self) -> str:
        return self._tensor.data_type()

    def device_name(self) -> str:
        return self._tensor.device_name().lower()


class AdapterFormat(C.AdapterFormat):
    """onnxruntime's LoRA adapter file format (``.onnx_adapter``), read and written."""

    def get_parameters(self) -> dict[str, OrtValue]:
        return {k: OrtValue(v) for k, v in super().get_parameters().items()}


class ModelCompiler:
    """onnxruntime's ahead-of-time compiler for execution providers: Kiln has none."""

    def __init__(self, *args, **kwargs):
        raise C.runtime_error("Kiln has no compiling execution providers (ModelCompiler)")
