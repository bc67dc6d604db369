"""onnxruntime's value classes at the level of its compiled bindings (``C.OrtValue``,
``C.OrtDevice``, ``C.SparseTensor``, ``OrtMemoryInfo``, ...), on NumPy arrays (and torch
tensors for CUDA). The Python-level classes in ``onnxruntime_inference_collection`` wrap
these, as onnxruntime's do."""

from __future__ import annotations

import ctypes
import enum
from typing import Any

import numpy as np

from kiln.ir import DType
from kiln.onnxruntime.capi._errors import runtime_error


class OrtSparseFormat(enum.IntEnum):
    """Sparse tensor layouts (onnxruntime's values)."""

    ORT_SPARSE_UNDEFINED = 0
    ORT_SPARSE_COO = 1
    ORT_SPARSE_CSRC = 2
    ORT_SPARSE_BLOCK_SPARSE = 4


class OrtAllocatorType(enum.IntEnum):
    INVALID = -1
    ORT_DEVICE_ALLOCATOR = 0
    ORT_ARENA_ALLOCATOR = 1


class OrtMemType(enum.IntEnum):
    CPU_INPUT = -2
    CPU_OUTPUT = -1
    CPU = -1
    DEFAULT = 0


class OrtDeviceMemoryType(enum.IntEnum):
    DEFAULT = 0
    HOST_ACCESSIBLE = 5


class OrtMemoryInfoDeviceType(enum.IntEnum):
    CPU = 0
    GPU = 1
    FPGA = 2
    NPU = 3


class OrtDevice:
    """A device: type (0 CPU, 1 GPU...), memory type, id and vendor id."""

    _TYPES = {"cpu": 0, "cuda": 1, "gpu": 1, "webgpu": 1, "fpga": 2, "cann": 3, "npu": 3,
              "dml": 4}

    def __init__(self, device_type: int, mem_type: int = 0, device_id: int = 0,
                 vendor_id: int = 0):
        self._type, self._mem, self._id, self._vendor = (int(device_type), int(mem_type),
                                                         int(device_id), int(vendor_id))

    cpu = staticmethod(lambda: 0)
    cuda = staticmethod(lambda: 1)
    gpu = staticmethod(lambda: 1)
    webgpu = staticmethod(lambda: 1)
    fpga = staticmethod(lambda: 2)
    cann = staticmethod(lambda: 3)
    npu = staticmethod(lambda: 3)
    dml = staticmethod(lambda: 4)
    default_memory = staticmethod(lambda: 0)

    def device_type(self) -> int:
        return self._type

    def device_id(self) -> int:
        return self._id

    def mem_type(self) -> int:
        return self._mem

    def vendor_id(self) -> int:
        return self._vendor

    def name(self) -> str:
        """"cpu" or "cuda", as OrtValue.device_name() says."""
        return "cpu" if self._type == 0 else "cuda"

    def __repr__(self) -> str:
        return f"OrtDevice(type={self._type}, mem={self._mem}, id={self._id})"


class OrtMemoryInfo:
    """Where a value lives, as onnxruntime describes it (name, allocator, device, memory
    type)."""

    def __init__(self, name: str, allocator_type: int = 1, device_id: int = 0,
                 mem_type: int = 0):
        self.name = str(name)
        self.allocator_type = OrtAllocatorType(int(allocator_type))
        self.device_id = int(device_id)
        self.mem_type = OrtMemType(int(mem_type))
        self.device_mem_type = OrtDeviceMemoryType.DEFAULT
        self.device_vendor_id = 0
        self.device_type = OrtMemoryInfoDeviceType.CPU

    @staticmethod
    def create_v2(name: str, device_type: int, vendor_id: int, device_id: int,
                  mem_type: int, alignment: int, allocator_type: int) -> OrtMemoryInfo:
        """onnxruntime's CreateMemoryInfo_V2."""
        m = OrtMemoryInfo(name, allocator_type, device_id, OrtMemType.DEFAULT)
        m.device_type = OrtMemoryInfoDeviceType(int(device_type))
        m.device_vendor_id = int(vendor_id)
        m.device_mem_type = OrtDeviceMemoryType(int(mem_type))
        m.alignment = int(alignment)
        return m

    def __repr__(self) -> str:
        return (f"OrtMemoryInfo(name={self.name!r}, id={self.device_id}, "
                f"mem_type={int(self.mem_type)}, allocator={int(self.allocator_type)})")


def onnx_dtype(element_type: Any) -> np.dtype:
    """A NumPy dtype from a NumPy type or an ONNX element type number."""
    if isinstance(element_type, (int, np.integer)) and not isinstance(element_type, bool):
        return np.dtype(DType(int(element_type)).numpy)
    return np.dtype(element_type)


def onnx_type_number(dtype: np.dtype) -> int:
    """The ONNX element type number of a NumPy dtype (strings: 8)."""
    if dtype.kind in "OUS":
        return DType.STRING.value
    return DType.from_numpy(dtype).value


def _on_cuda(value) -> bool:
    return hasattr(value, "device") and getattr(value.device, "type", "cpu") != "cpu"


class OrtValue:
    """A tensor (NumPy array, or torch tensor on a CUDA device), a sequence (list), a map
    (dict) or a sparse tensor, as onnxruntime's ``C.OrtValue``."""

    def __init__(self, value: Any, onnx_type: int | None = None):
        self.value = value
        self._onnx_type = onnx_type

    @staticmethod
    def ortvalue_from_numpy(array: Any, device: OrtDevice | None = None) -> OrtValue:
        """Wrap ``array`` (no copy on the CPU when it is contiguous)."""
        array = np.asarray(array)
        if array.dtype.kind in "OUS":
            array = strings(array)
        else:
            array = np.ascontiguousarray(array)
        if device is None or device.device_type() == 0:
            return OrtValue(array)
        import torch
        return OrtValue(torch.from_numpy(array).to(f"cuda:{device.device_id()}"))

    @staticmethod
    def ortvalue_from_shape_and_type(shape, element_type, device: OrtDevice | None = None
                                     ) -> OrtValue:
        """An uninitialised tensor of ``shape`` and ``element_type``."""
        dtype = onnx_dtype(element_type)
        arr = np.empty([int(d) for d in shape], dtype)
        return OrtValue.ortvalue_from_numpy(arr, device)

    @staticmethod
    def ort_value_from_sparse_tensor(sparse: SparseTensor) -> OrtValue:
        return OrtValue(sparse)

    @staticmethod
    def from_dlpack(data: Any, is_bool_tensor: bool = False) -> OrtValue:
        """An OrtValue sharing the memory of a DLPack capsule or of an object with
        ``__dlpack__``."""
        if hasattr(data, "__dlpack__"):
            arr = np.from_dlpack(data)
        else:
            arr = np.from_dlpack(_Capsule(data))
        if is_bool_tensor and arr.dtype == np.uint8:
            arr = arr.view(np.bool_)
        return OrtValue(arr)

    # -- what it is -------------------------------------------------------------------
    def is_tensor(self) -> bool:
        return isinstance(self.value, np.ndarray) or hasattr(self.value, "device")

    def is_sparse_tensor(self) -> bool:
        return isinstance(self.value, SparseTensor)

    def is_tensor_sequence(self) -> bool:
        return isinstance(self.value, list)

    def has_value(self) -> bool:
        return self.value is not None

    def as_sparse_tensor(self) -> SparseTensor:
        if not self.is_sparse_tensor():
            raise runtime_error("this OrtValue is not a sparse tensor")
        return self.value

    def _tensor(self):
        if not self.is_tensor():
            raise runtime_error("this OrtValue is not a tensor")
        return self.value

    def numpy(self):
        """The value on the host: an array (a view of the same memory on the CPU), a
        list or a dict."""
        v = self.value
        if _on_cuda(v):
            return v.detach().cpu().numpy()
        if hasattr(v, "detach"):
            return v.detach().numpy()
        if isinstance(v, SparseTensor):
            raise runtime_error("a sparse tensor has no numpy(); use as_sparse_tensor()")
        return v

    def shape(self) -> list[int]:
        return [int(d) for d in self._tensor().shape]

    def device_name(self) -> str:
        v = self.value
        if isinstance(v, SparseTensor):
            return v.device_name()
        return "cuda" if _on_cuda(v) else "cpu"

    def element_type(self) -> int:
        """The ONNX element type number."""
        if self._onnx_type is not None:
            return self._onnx_type
        return onnx_type_number(np.dtype(_np_dtype(self._tensor())))

    def data_type(self) -> str:
        v = self.value
        if isinstance(v, SparseTensor):
            return v.data_type()
        if isinstance(v, list):
            inner = OrtValue(v[0]).data_type() if v else "tensor(float)"
            return f"seq({inner})"
        return f"tensor({DType(self.element_type()).onnx_name})"

    def data_ptr(self) -> int:
        v = self._tensor()
        return int(v.data_ptr()) if hasattr(v, "data_ptr") else int(v.ctypes.data)

    def tensor_size_in_bytes(self) -> int:
        v = self._tensor()
        return int(v.nbytes) if isinstance(v, np.ndarray) else int(v.numel() * v.element_size())

    def to_dlpack(self):
        """A DLPack capsule of the tensor (shares its memory)."""
        return self._tensor().__dlpack__()

    def __dlpack__(self, *, stream=None, **kw):
        return self._tensor().__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        v = self._tensor()
        if isinstance(v, np.ndarray):
            return (1, 0)
        return tuple(int(x) for x in v.__dlpack_device__())

    def update_inplace(self, data: np.ndarray) -> None:
        """Copy ``data`` into this tensor's memory."""
        v = self._tensor()
        if tuple(np.shape(data)) != tuple(v.shape):
            raise runtime_error(f"update_inplace: shape {np.shape(data)} does not match "
                                f"{tuple(v.shape)}")
        if isinstance(v, np.ndarray):
            v[...] = data
        else:
            import torch
            v.copy_(torch.from_numpy(np.ascontiguousarray(data)))


def _np_dtype(v) -> np.dtype:
    if isinstance(v, np.ndarray):
        return v.dtype
    import torch
    return torch.empty((), dtype=v.dtype).numpy().dtype


class OrtValueVector(list):
    """A list of OrtValues (what run_with_ort_values returns)."""

    def push_back(self, v: OrtValue) -> None:
        self.append(v)

    def reserve(self, n: int) -> None:
        """Nothing to reserve in a Python list."""

    def numpy_arrays(self) -> list:
        return [v.numpy() for v in self]


class _Capsule:
    """A bare DLPack capsule presented as an object NumPy's from_dlpack takes."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kw):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


def is_dlpack_uint8_tensor(capsule) -> bool:
    """Whether a DLPack capsule holds uint8 data (read without consuming it)."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    ptr = get(capsule, b"dltensor")
    t = _DLTensor.from_address(ptr)
    return t.code == 1 and t.bits == 8  # kDLUInt, 8 bits


def strings(array: np.ndarray) -> np.ndarray:
    """A string tensor as onnxruntime takes it: an object array of str (bytes and
    NumPy void items decoded as UTF-8, as they are)."""
    out = np.empty(array.shape, dtype=object)
    flat = array.reshape(-1)
    dst = out.reshape(-1)
    for i, x in enumerate(flat):
        if isinstance(x, np.void):
            x = bytes(x)
        dst[i] = x.decode("utf-8") if isinstance(x, bytes) else str(x)
    return out


class SparseCooView:
    def __init__(self, indices: np.ndarray):
        self._indices = indices

    def indices(self) -> np.ndarray:
        return self._indices


class SparseCsrView:
    def __init__(self, inner: np.ndarray, outer: np.ndarray):
        self._inner, self._outer = inner, outer

    def inner(self) -> np.ndarray:
        return self._inner

    def outer(self) -> np.ndarray:
        return self._outer


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.array(a, copy=True)
    a.flags.writeable = False
    return a


class SparseTensor:
    """A sparse tensor in COO (linear or 2-D indices) or CSR format, on the CPU."""

    def __init__(self, fmt: OrtSparseFormat, dense_shape, values, *index_arrays):
        self._format = OrtSparseFormat(fmt)
        self._shape = [int(d) for d in dense_shape]
        values = np.asarray(values)
        self._values = _frozen(strings(values) if values.dtype.kind in "OUS" else values)
        self._str = values.dtype.kind in "OUS"
        self._index = [_frozen(np.asarray(a, np.int64)) for a in index_arrays]

    @staticmethod
    def sparse_coo_from_numpy(dense_shape, values, indices, device: OrtDevice | None = None
                              ) -> SparseTensor:
        _cpu_only(device)
        return SparseTensor(OrtSparseFormat.ORT_SPARSE_COO, dense_shape, values, indices)

    @staticmethod
    def sparse_csr_from_numpy(dense_shape, values, inner, outer,
                              device: OrtDevice | None = None) -> SparseTensor:
        _cpu_only(device)
        return SparseTensor(OrtSparseFormat.ORT_SPARSE_CSRC, dense_shape, values, inner, outer)

    @staticmethod
    def from_dense(dense: np.ndarray) -> SparseTensor:
        """The COO form (linear indices) of a dense array."""
        flat = np.asarray(dense).reshape(-1)
        idx = np.flatnonzero(flat if flat.dtype.kind not in "OUS" else flat != "")
        return SparseTensor(OrtSparseFormat.ORT_SPARSE_COO, np.shape(dense), flat[idx], idx)

    def format(self) -> OrtSparseFormat:
        return self._format

    def dense_shape(self) -> list[int]:
        return list(self._shape)

    def values(self) -> np.ndarray:
        return self._values

    def as_coo_view(self) -> SparseCooView:
        if self._format != OrtSparseFormat.ORT_SPARSE_COO:
            raise runtime_error("this sparse tensor is not in COO format")
        return SparseCooView(self._index[0])

    def as_csrc_view(self) -> SparseCsrView:
        if self._format != OrtSparseFormat.ORT_SPARSE_CSRC:
            raise runtime_error("this sparse tensor is not in CSR format")
        return SparseCsrView(*self._index)

    def as_blocksparse_view(self):
        raise runtime_error("Kiln has no block-sparse tensors")

    def data_type(self) -> str:
        name = "string" if self._str else DType.from_numpy(self._values.dtype).onnx_name
        return f"sparse_tensor({name})"

    def device_name(self) -> str:
        return "cpu"

    def to_cuda(self, device: OrtDevice):
        raise runtime_error("Kiln keeps sparse tensors on the CPU; no CUDA copy "
                            "(onnxruntime: CUDA builds only, never for strings)")

    def to_dense(self) -> np.ndarray:
        """The dense array this sparse tensor stands for."""
        dtype = object if self._str else self._values.dtype
        out = np.zeros(self._shape, dtype=dtype)
        if self._str:
            out[...] = ""
        flat = out.reshape(-1)
        if self._format == OrtSparseFormat.ORT_SPARSE_COO:
            idx = self._index[0]
            if idx.ndim == 2:
                idx = np.ravel_multi_index(tuple(idx.T), self._shape)
            flat[idx.reshape(-1)] = self._values
        else:
            inner, outer = self._index
            cols = self._shape[1]
            for row in range(len(outer) - 1):
                for k in range(outer[row], outer[row + 1]):
                    flat[row * cols + inner[k]] = self._values[k]
        return out


def _cpu_only(device: OrtDevice | None) -> None:
    if device is not None and device.device_type() != 0:
        raise runtime_error("Kiln builds sparse tensors on the CPU only")
