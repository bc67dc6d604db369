"""Tensors as the Open Inference Protocol (KServe v2) writes them: datatype names, JSON
``data`` lists, and Triton's binary-tensor extension (a JSON header followed by raw
row-major bytes; BYTES elements each prefixed by a 4-byte little-endian length)."""

from __future__ import annotations

import math
import struct
from typing import Any

import ml_dtypes
import numpy as np

from kiln.errors import InputError

# KServe v2 datatype name -> numpy dtype (BYTES is an object array of bytes)
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(bool),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "BYTES": np.dtype(object),
}
# onnxruntime-style type strings (NodeArg.type) -> KServe v2 datatype
ONNX_TYPES = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(bfloat16)": "BF16",
    "tensor(string)": "BYTES",
}


# numpy dtype -> KServe v2 datatype: one lookup per tensor on every request
_NAMES = {dt: name for name, dt in DATATYPES.items() if name != "BYTES"}


def datatype_of(array: np.ndarray) -> str:
    """The KServe v2 datatype name of ``array``'s dtype."""
    if array.dtype == object or array.dtype.kind in "SU":
        return "BYTES"
    name = _NAMES.get(array.dtype)
    if name is not None:
        return name
    raise InputError(f"tensors of dtype {array.dtype} have no Open Inference Protocol datatype")


def _count(shape: list[int]) -> int:
    return math.prod(shape)  # exact, and far cheaper than np.prod on a short list


def check_shape(name: str, shape: Any) -> list[int]:
    """``shape`` as a list of non-negative ints, or an InputError naming the tensor."""
    if not isinstance(shape, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise InputError(
            f"input {name!r}: 'shape' must be a list of non-negative integers, got {shape!r}"
        )
    return shape


def from_json(name: str, datatype: str, shape: list[int], data: Any) -> np.ndarray:
    """The array a JSON ``data`` field holds (flat row-major, or nested lists)."""
    dtype = _dtype(name, datatype)
    try:
        if datatype == "BYTES":
            flat = [d.encode() if isinstance(d, str) else bytes(d) for d in _flatten(data)]
            arr = np.array(flat, dtype=object)
        elif datatype == "BF16":
            raise InputError(
                f"input {name!r}: BF16 tensors travel as binary data only (the "
                "Triton binary tensor extension), not as JSON"
            )
        else:
            arr = np.asarray(data, dtype=dtype)
    except (TypeError, ValueError, OverflowError) as e:
        raise InputError(f"input {name!r}: 'data' does not hold {datatype} values: {e}") from None
    if arr.size != _count(shape):
        raise InputError(
            f"input {name!r}: 'data' holds {arr.size} values, shape {shape} needs {_count(shape)}"
        )
    return arr.reshape(shape)


def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    out: list = []
    for d in data:
        out.extend(_flatten(d))
    return out


def _dtype(name: str, datatype: Any) -> np.dtype:
    if datatype not in DATATYPES:
        raise InputError(
            f"input {name!r}: unknown datatype {datatype!r}; one of {', '.join(DATATYPES)}"
        )
    return DATATYPES[datatype]


def from_bytes(name: str, datatype: str, shape: list[int], raw: bytes) -> np.ndarray:
    """The array ``raw`` holds in the binary tensor format."""
    dtype = _dtype(name, datatype)
    n = _count(shape)
    if datatype == "BYTES":
        items, pos = [], 0
        while pos < len(raw):
            if pos + 4 > len(raw):
                raise InputError(f"input {name!r}: BYTES data ends inside a length prefix")
            (size,) = struct.unpack_from("<I", raw, pos)
            pos += 4
            if pos + size > len(raw):
                raise InputError(f"input {name!r}: a BYTES element runs past the data")
            items.append(bytes(raw[pos : pos + size]))
            pos += size
        if len(items) != n:
            raise InputError(
                f"input {name!r}: {len(items)} BYTES elements, shape {shape} needs {n}"
            )
        return np.array(items, dtype=object).reshape(shape)
    if len(raw) != n * dtype.itemsize:
        raise InputError(
            f"input {name!r}: {len(raw)} bytes of binary data, shape {shape} "
            f"of {datatype} needs {n * dtype.itemsize}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def to_bytes(array: np.ndarray) -> bytes:
    """``array`` in the binary tensor format."""
    if array.dtype == object or array.dtype.kind in "SU":
        parts = []
        for item in array.reshape(-1):
            b = item.encode() if isinstance(item, str) else bytes(item)
            parts.append(struct.pack("<I", len(b)) + b)
        return b"".join(parts)
    return np.ascontiguousarray(array).tobytes()


def to_json(array: np.ndarray) -> list:
    """``array`` as a flat row-major JSON list (BYTES as UTF-8 strings)."""
    if array.dtype == object or array.dtype.kind in "SU":
        return [
            x.decode("utf-8", "replace") if isinstance(x, bytes) else str(x)
            for x in array.reshape(-1)
        ]
    if array.dtype == DATATYPES["BF16"] or array.dtype == np.float16:
        array = array.astype(np.float32)
    return array.reshape(-1).tolist()
