"""onnxruntime's ``OrtValue`` and ``IOBinding`` on Kiln: values on a device, and inputs
and outputs bound to a session ahead of its runs."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kiln.errors import InputError, OptionError
from kiln.ir import DType


def _torch():
    import torch
    return torch


class OrtValue:
    """A value on a device, as onnxruntime's ``OrtValue``: a NumPy array or, on the torch
    backend's devices, a torch tensor."""

    def __init__(self, value: Any):
        self.value = value

    @staticmethod
    def ortvalue_from_numpy(array: np.ndarray, device_type: str = "cpu",
                            device_id: int = 0) -> OrtValue:
        """Wrap ``array`` (copied to the CUDA device when ``device_type`` is "cuda")."""
        array = np.ascontiguousarray(array)
        if device_type == "cpu":
            return OrtValue(array)
        return OrtValue(_torch().from_numpy(array).to(f"{device_type}:{device_id}"))

    def numpy(self) -> np.ndarray:
        """The value as a NumPy array (copied to the host if on a device)."""
        v = self.value
        if hasattr(v, "detach"):  # a torch tensor: bfloat16 too, which .numpy() refuses
            from kiln.ops.torch.arrays import to_numpy
            return to_numpy(v)
        return np.asarray(v)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """``np.asarray(v)``: the value as an array (the same memory on the CPU)."""
        arr = self.numpy()
        if dtype is not None and np.dtype(dtype) != arr.dtype:
            return arr.astype(dtype)
        return arr.copy() if copy else arr

    def shape(self) -> list[int]:
        return [int(d) for d in self.value.shape]

    def device_name(self) -> str:
        v = self.value
        return "cpu" if isinstance(v, np.ndarray) or v.device.type == "cpu" else v.device.type

    def element_type(self):
        v = self.value
        return v.dtype.type if isinstance(v, np.ndarray) else self.numpy().dtype.type

    def data_type(self) -> str:
        dt = np.dtype(self.element_type())
        return f"tensor({DType.from_numpy(dt).onnx_name})"

    def data_ptr(self) -> int:
        v = self.value
        return int(v.data_ptr()) if hasattr(v, "data_ptr") else int(v.ctypes.data)

    def is_tensor(self) -> bool:
        return True

    def has_value(self) -> bool:
        return True


def _at_pointer(device_type: str, device_id: int, element_type, shape, ptr: int):
    """An array viewing ``ptr`` (no copy): NumPy on the CPU, a torch tensor on CUDA."""
    dtype = np.dtype(element_type)
    # ml_dtypes' types (bfloat16, float8) have typestrs NumPy's interface cannot read
    typestr = dtype.str if dtype.type.__module__ == "numpy" else f"|V{dtype.itemsize}"
    iface = {"shape": tuple(int(d) for d in shape), "typestr": typestr,
             "data": (int(ptr), False), "version": 3}
    if device_type == "cpu":
        arr = np.asarray(type("Buffer", (), {"__array_interface__": iface})())
        # bfloat16 and float8 (ml_dtypes) travel as raw void items: view them as what they are
        return arr if arr.dtype == dtype else arr.view(dtype)
    if device_type != "cuda":
        raise OptionError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    holder = type("Buffer", (), {"__cuda_array_interface__": iface})()
    return _torch().as_tensor(holder, device=f"cuda:{device_id}")


class IOBinding:
    """Inputs and outputs bound to a session ahead of runs (``session.io_binding()``):
    bound inputs are converted to the backend's arrays once, when bound; outputs bound to
    a device stay there (torch tensors), outputs bound to a buffer are written into it."""

    def __init__(self, session):
        self.session = session
        self.inputs: dict[str, Any] = {}
        self.outputs: dict[str, tuple[str, Any]] = {}  # name -> (device, buffer or None)
        self.results: list[Any] = []

    def bind_cpu_input(self, name: str, arr_on_cpu) -> None:
        """Bind a NumPy array to input ``name``."""
        self._bind(name, np.asarray(arr_on_cpu))

    def bind_input(self, name: str, device_type: str, device_id: int, element_type, shape,
                   buffer_ptr: int) -> None:
        """Bind the memory at ``buffer_ptr`` (``shape`` of ``element_type``, on
        ``device_type``/``device_id``) to input ``name``, without copying."""
        self._bind(name, _at_pointer(device_type, device_id, element_type, shape, buffer_ptr))

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._bind(name, ortvalue.value)

    def _bind(self, name: str, value) -> None:
        self.inputs[name] = self.session.check_input(name, value)

    def bind_output(self, name: str, device_type: str = "cpu", device_id: int = 0,
                    element_type=None, shape=None, buffer_ptr: int | None = None) -> None:
        """Compute output ``name`` (any tensor of the model) onto ``device_type``, or into
        the buffer at ``buffer_ptr`` when given."""
        buf = None if buffer_ptr is None else \
            _at_pointer(device_type, device_id, element_type, shape, buffer_ptr)
        dev = "cpu" if device_type == "cpu" else f"{device_type}:{device_id}"
        self.outputs[name] = (dev, buf)

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        """Write output ``name`` into ``ortvalue``'s memory."""
        v = ortvalue.value
        self.outputs[name] = ("cpu" if isinstance(v, np.ndarray) else str(v.device), v)

    def clear_binding_inputs(self) -> None:
        self.inputs.clear()

    def clear_binding_outputs(self) -> None:
        self.outputs.clear()

    def synchronize_inputs(self) -> None:
        self._sync()

    def synchronize_outputs(self) -> None:
        self._sync()

    def _sync(self) -> None:
        if getattr(self.session.backend, "is_cuda", False):
            _torch().cuda.synchronize(self.session.backend.tdevice)

    def get_outputs(self) -> list[OrtValue]:
        """The last run's outputs, where they were bound."""
        return [OrtValue(x) for x in self.results]

    def copy_outputs_to_cpu(self) -> list[np.ndarray]:
        """The last run's outputs as NumPy arrays."""
        return [OrtValue(x).numpy() for x in self.results]

    def run(self, run_options=None) -> None:
        """Run the session on the bound inputs into the bound outputs."""
        s = self.session
        names = list(self.outputs) or [v.name for v in s.model.graph.outputs]
        torch = sys.modules.get("torch")  # a backend whose arrays are torch tensors
        as_torch = torch is not None and issubclass(s.backend.array_type, torch.Tensor)
        got = s.run(names, self.inputs, run_options,
                    output_type="torch" if as_torch else "numpy")
        results = []
        for name, x in zip(names, got):
            dev, buf = self.outputs.get(name, ("cpu", None))
            if buf is not None:
                _copy_into(buf, x)
                x = buf
            elif dev == "cpu":
                x = OrtValue(x).numpy()
            elif getattr(x, "device", None) is None or str(x.device) != dev:
                x = _torch().as_tensor(OrtValue(x).numpy() if not as_torch else x, device=dev)
            results.append(x)
        self.results = results


def _copy_into(buf, x) -> None:
    if tuple(buf.shape) != tuple(x.shape):
        raise InputError(f"a bound output buffer has shape {tuple(buf.shape)} but the output "
                         f"has shape {tuple(x.shape)}")
    if isinstance(buf, np.ndarray):
        buf[...] = OrtValue(x).numpy()
    else:
        buf.copy_(x if hasattr(x, "device") else _torch().from_numpy(np.asarray(x)))
