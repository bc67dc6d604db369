"""LoRA adapters as onnxruntime writes them (``.onnx_adapter``: a FlatBuffer with file
identifier "TORT", an ``Adapter`` table of format, adapter and model versions and a vector
of ``Parameter`` tables: name, dims, ONNX element type, raw little-endian data), read and
written here without the flatbuffers package. A run whose RunOptions activate an adapter
feeds its parameters in place of the model's initializers of the same names."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from kiln.onnxruntime.capi._errors import runtime_error
from kiln.onnxruntime.capi._values import OrtValue, onnx_dtype, onnx_type_number

FORMAT_VERSION = 1


def _u32(b: bytes, at: int) -> int:
    return struct.unpack_from("<I", b, at)[0]


class _Table:
    """A FlatBuffer table at ``pos``: field ``i``'s position, or None when absent."""

    def __init__(self, b: bytes, pos: int):
        self.b, self.pos = b, pos
        vt = pos - struct.unpack_from("<i", b, pos)[0]
        size = struct.unpack_from("<H", b, vt)[0]
        self.offsets = struct.unpack_from(f"<{(size - 4) // 2}H", b, vt + 4)

    def at(self, i: int) -> int | None:
        off = self.offsets[i] if i < len(self.offsets) else 0
        return self.pos + off if off else None

    def int32(self, i: int, default: int = 0) -> int:
        at = self.at(i)
        return default if at is None else struct.unpack_from("<i", self.b, at)[0]

    def vector(self, i: int) -> tuple[int, int]:
        """(start of the elements, count) of vector field ``i``."""
        at = self.at(i)
        if at is None:
            return 0, 0
        p = at + _u32(self.b, at)
        return p + 4, _u32(self.b, p)


def read(path: str) -> tuple[int, int, int, dict[str, np.ndarray]]:
    """(format version, adapter version, model version, parameters) of an adapter file."""
    b = Path(path).read_bytes()
    if len(b) < 8 or b[4:8] != b"TORT":
        raise runtime_error(f"{path} is not an onnxruntime adapter file (no TORT identifier)")
    root = _Table(b, _u32(b, 0))
    params = {}
    start, n = root.vector(3)
    for k in range(n):
        at = start + 4 * k
        t = _Table(b, at + _u32(b, at))
        s, ln = t.vector(0)
        name = b[s:s + ln].decode()
        s, nd = t.vector(1)
        dims = struct.unpack_from(f"<{nd}q", b, s)
        s, nb = t.vector(3)
        dtype = onnx_dtype(t.int32(2))
        params[name] = np.frombuffer(b[s:s + nb], dtype=dtype.newbyteorder("<")).astype(
            dtype).reshape(dims)
    return root.int32(0), root.int32(1), root.int32(2), params


class _Writer:
    """Appends FlatBuffer objects front to back (every offset points forward)."""

    def __init__(self):
        self.b = bytearray(b"\0\0\0\0TORT")

    def align(self, n: int, then: int = 0) -> None:
        while (len(self.b) + then) % n:
            self.b.append(0)

    def table(self, ints: dict[int, int]) -> tuple[int, int]:
        """A vtable and a 4-field table (fields of 4 bytes at 4, 8, 12, 16); returns the
        table's position and where its fields start. ``ints``: field -> int value."""
        self.align(4)
        vt = len(self.b)
        self.b += struct.pack("<6H", 12, 20, 4, 8, 12, 16)
        pos = len(self.b)
        self.b += struct.pack("<i", pos - vt) + bytes(16)
        for i, v in ints.items():
            struct.pack_into("<i", self.b, pos + 4 + 4 * i, v)
        return pos, pos + 4

    def point(self, field_at: int) -> None:
        """Make the uoffset at ``field_at`` point here."""
        struct.pack_into("<I", self.b, field_at, len(self.b) - field_at)

    def vector(self, field_at: int, data: bytes, count: int, align: int = 4) -> None:
        self.align(max(align, 4), then=4)
        self.point(field_at)
        self.b += struct.pack("<I", count) + data


def write(path: str, adapter_version: int, model_version: int,
          params: dict[str, np.ndarray]) -> None:
    w = _Writer()
    root, fields = w.table({0: FORMAT_VERSION, 1: adapter_version, 2: model_version})
    struct.pack_into("<I", w.b, 0, root)
    w.align(4)
    w.point(fields + 12)
    vec = len(w.b)
    w.b += struct.pack("<I", len(params)) + bytes(4 * len(params))
    for k, (name, arr) in enumerate(params.items()):
        arr = np.ascontiguousarray(arr)
        w.align(4)
        slot = vec + 4 + 4 * k
        pos, f = w.table({2: onnx_type_number(arr.dtype)})
        struct.pack_into("<I", w.b, slot, pos - slot)
        raw = name.encode()
        w.vector(f, raw + b"\0", len(raw))
        w.vector(f + 4, struct.pack(f"<{arr.ndim}q", *arr.shape), arr.ndim, align=8)
        data = arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        w.vector(f + 12, data, len(data), align=8)
    Path(path).write_bytes(bytes(w.b))


class LoraAdapter:
    """A LoRA adapter file's parameters, fed in place of the model's initializers of the
    same names in runs whose RunOptions activate it (``add_active_adapter``)."""

    def __init__(self):
        self._params: dict[str, np.ndarray] = {}

    def Load(self, path: str) -> None:  # noqa: N802 - onnxruntime's name
        self._params = read(str(path))[3]

    def parameters(self) -> dict[str, np.ndarray]:
        return dict(self._params)


class AdapterFormat:
    """onnxruntime's adapter file writer and reader."""

    def __init__(self, adapter=None):
        self._format, self._adapter_version, self._model_version = FORMAT_VERSION, 0, 0
        self._params: dict[str, OrtValue] = {}

    @classmethod
    def read_adapter(cls, file_path) -> AdapterFormat:
        a = cls()
        a._format, a._adapter_version, a._model_version, params = read(str(file_path))
        a._params = {k: OrtValue(v) for k, v in params.items()}
        return a

    def export_adapter(self, file_path) -> None:
        write(str(file_path), self._adapter_version, self._model_version,
              {k: v.numpy() for k, v in self._params.items()})

    def get_format_version(self) -> int:
        return self._format

    def set_adapter_version(self, version: int) -> None:
        self._adapter_version = int(version)

    def get_adapter_version(self) -> int:
        return self._adapter_version

    def set_model_version(self, version: int) -> None:
        self._model_version = int(version)

    def get_model_version(self) -> int:
        return self._model_version

    def set_parameters(self, params: dict) -> None:
        self._params = {str(k): (v._get_c_value() if hasattr(v, "_get_c_value") else v)
                        for k, v in params.items()}

    def get_parameters(self) -> dict:
        return dict(self._params)
