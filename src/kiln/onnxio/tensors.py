"""TensorProto <-> NumPy, with external data read only from inside the model's folder."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from kiln.errors import ExternalDataError, ModelLoadError
from kiln.ir import DType

_MEMMAPPABLE = {DType.FLOAT, DType.DOUBLE, DType.FLOAT16, DType.INT8, DType.UINT8, DType.INT16,
                DType.UINT16, DType.INT32, DType.UINT32, DType.INT64, DType.UINT64, DType.BOOL,
                DType.BFLOAT16, DType.COMPLEX64, DType.COMPLEX128}


def safe_external_path(location: str, base_dir: str | os.PathLike | None) -> Path:
    """Resolve an external-data ``location`` against ``base_dir``, refusing anything that
    could reach outside it (absolute paths, ``..``, symlinks pointing elsewhere)."""
    if base_dir is None:
        raise ExternalDataError(
            f"tensor data lives in external file {location!r}, but the model was not loaded "
            "from a path; pass the file path to kiln.load, or base_dir= for bytes/protos")
    if os.path.isabs(location) or location.startswith(("/", "\\")) or ":" in location[:3]:
        raise ExternalDataError(
            f"external data location {location!r} is an absolute path; Kiln reads external "
            "data only from files inside the model's folder (re-save the model with relative "
            "locations)")
    parts = Path(location.replace("\\", "/")).parts
    if ".." in parts:
        raise ExternalDataError(
            f"external data location {location!r} climbs out of the model's folder with '..'; "
            "refused (move the data file beside the model)")
    base = Path(base_dir).resolve()
    path = (base / Path(*parts)).resolve()
    if base != path and base not in path.parents:
        raise ExternalDataError(
            f"external data location {location!r} resolves to {path}, outside the model's "
            f"folder {base}; refused")
    if not path.is_file():
        raise ExternalDataError(f"external data file {path} (named by the model) does not exist")
    return path


def _external_fields(t: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in t.external_data}


def _external_array(t: onnx.TensorProto, base_dir) -> np.ndarray:
    info = _external_fields(t)
    path = safe_external_path(info.get("location", ""), base_dir)
    size = path.stat().st_size
    try:
        offset = int(info.get("offset", 0) or 0)
        length = int(info["length"]) if "length" in info else size - offset
    except ValueError:
        raise ExternalDataError(
            f"tensor {t.name!r}: external data offset {info.get('offset')!r} or length "
            f"{info.get('length')!r} is not a whole number; the model is malformed") from None
    if offset < 0 or length < 0 or offset + length > size:
        raise ExternalDataError(
            f"tensor {t.name!r}: external data range [{offset}, {offset + length}) lies beyond "
            f"the end of {path.name} ({size} bytes); the file is truncated or mismatched")
    dtype = DType(t.data_type)
    shape = tuple(t.dims)
    count = _count(t)
    if dtype in _MEMMAPPABLE:
        need = count * dtype.numpy.itemsize
        if need != length:
            raise ExternalDataError(
                f"tensor {t.name!r}: {length} bytes of external data for shape {shape} of "
                f"{dtype.name} (which needs {need})")
        if count == 0:
            return np.zeros(shape, dtype.numpy)
        return np.memmap(path, dtype=dtype.numpy, mode="r", offset=offset, shape=shape)
    # Packed or unusual layouts: read the bytes and let onnx unpack them.
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    copy = onnx.TensorProto()
    copy.CopyFrom(t)
    del copy.external_data[:]
    copy.data_location = onnx.TensorProto.DEFAULT
    copy.raw_data = raw
    return _embedded_array(copy)


def _count(t: onnx.TensorProto) -> int:
    """Element count of the tensor's dims, refusing negative dims and counts no int64 (and
    no memory) holds."""
    count = 1
    for d in t.dims:
        if d < 0:
            raise ModelLoadError(f"tensor {t.name!r} has a negative dim in {list(t.dims)}")
        count *= d
    if count >= 2**63:
        raise ModelLoadError(f"tensor {t.name!r} has dims {list(t.dims)}, whose product "
                             "overflows int64; the model is malformed")
    return count


# Element types whose raw bytes are the array as NumPy lays it out (little-endian): read with
# one np.frombuffer, at a quarter of onnx.numpy_helper's cost (ShuffleNetV2 has 302 Constants).
_PLAIN_RAW = {int(d): d.numpy for d in _MEMMAPPABLE if d != DType.BFLOAT16} \
    if sys.byteorder == "little" else {}


def _embedded_array(t: onnx.TensorProto) -> np.ndarray:
    count = _count(t)
    plain = _PLAIN_RAW.get(t.data_type)
    if plain is not None and t.HasField("raw_data") and not t.HasField("segment"):
        raw = t.raw_data
        if len(raw) == count * plain.itemsize:  # else numpy_helper names the problem
            return np.frombuffer(raw, plain).reshape(tuple(t.dims))
    strings = t.data_type == onnx.TensorProto.STRING
    if strings and len(t.string_data) != count:
        raise ModelLoadError(f"string tensor {t.name!r} has {len(t.string_data)} values "
                             f"for dims {list(t.dims)} ({count}); the model is malformed")
    with _refused_by_numpy(t):
        if strings:
            return np.array([s.decode("utf-8", "surrogateescape") for s in t.string_data],
                            dtype=object).reshape(tuple(t.dims))
        return numpy_helper.to_array(t)


@contextlib.contextmanager
def _refused_by_numpy(t: onnx.TensorProto) -> Iterator[None]:
    """NumPy's refusal of ``t``'s dims (some it cannot hold even with no element, such as
    [0, 2^62, 0]) as a ModelLoadError."""
    try:
        yield
    except (ValueError, TypeError) as e:
        raise ModelLoadError(f"tensor {t.name!r} is malformed: {e}") from e


def to_array(t: onnx.TensorProto, base_dir=None) -> np.ndarray:
    """The tensor's value as a NumPy array (memory-mapped when stored externally)."""
    try:
        dtype = DType(t.data_type)
    except ValueError:
        raise ModelLoadError(f"tensor {t.name!r} has unknown element type {t.data_type}") from None
    if dtype == DType.UNDEFINED:
        raise ModelLoadError(f"tensor {t.name!r} has no element type")
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return _external_array(t, base_dir)
    return _embedded_array(t)


def raw_array(t: onnx.TensorProto, length: int, fill: Callable[[memoryview], None],
              base_dir=None) -> np.ndarray:
    """:func:`to_array` of ``t`` whose ``raw_data`` (``length`` bytes) was cut out of the
    proto (see :mod:`kiln.onnxio.wire`); ``fill(buffer)`` writes those bytes into a
    writable buffer of that length. Plain layouts are read straight into the array (one
    copy of the data, read-only as ``np.frombuffer`` on the proto's bytes would be); the
    rest go through the proto as before."""
    try:
        dtype: DType | None = DType(t.data_type)
    except ValueError:
        dtype = None  # to_array names the problem
    if dtype in _MEMMAPPABLE and sys.byteorder == "little" and \
            t.data_location != onnx.TensorProto.EXTERNAL and not t.HasField("segment"):
        count = _count(t)
        if count * dtype.numpy.itemsize == length:
            with _refused_by_numpy(t):
                arr = np.empty(tuple(t.dims), dtype.numpy)
            fill(memoryview(arr.reshape(-1).view(np.uint8)))
            arr.flags.writeable = False
            return arr
    buf = bytearray(length)
    fill(memoryview(buf))
    t.raw_data = bytes(buf)
    return to_array(t, base_dir)


def sparse_to_array(s: onnx.SparseTensorProto, base_dir=None) -> np.ndarray:
    """A SparseTensorProto densified (sparse values are rare and small)."""
    values = to_array(s.values, base_dir)
    indices = to_array(s.indices, base_dir).astype(np.int64)
    shape = tuple(s.dims)
    dense = np.zeros(int(np.prod(shape)), dtype=values.dtype)
    flat = indices if indices.ndim == 1 else np.ravel_multi_index(indices.T, shape)
    dense[flat] = values
    return dense.reshape(shape)


def from_array(a: np.ndarray, name: str) -> onnx.TensorProto:
    """A TensorProto holding ``a`` (data inline; the exporter moves big ones out)."""
    a = np.asarray(a)
    if a.dtype.kind in "OUS":
        t = onnx.TensorProto(name=name, data_type=onnx.TensorProto.STRING, dims=a.shape)
        t.string_data.extend(
            (s if isinstance(s, bytes) else str(s).encode("utf-8", "surrogateescape"))
            for s in a.ravel())
        return t
    return numpy_helper.from_array(np.asarray(a, order="C"), name)  # keeps 0-d as 0-d
