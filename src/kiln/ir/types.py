"""Value types of the IR: element dtypes, tensor shapes with symbolic dims, sequences
and optionals. Independent of protobuf and of any backend."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from kiln.ir.symbolic import Dim, SymDim

__all__ = ["DType", "Dim", "MapType", "OptionalType", "SequenceType", "Shape", "SymDim",
           "TensorType", "ValueType"]


class DType(enum.IntEnum):
    """Element types, numbered as ONNX's ``TensorProto.DataType``."""

    UNDEFINED = 0
    FLOAT = 1
    UINT8 = 2
    INT8 = 3
    UINT16 = 4
    INT16 = 5
    INT32 = 6
    INT64 = 7
    STRING = 8
    BOOL = 9
    FLOAT16 = 10
    DOUBLE = 11
    UINT32 = 12
    UINT64 = 13
    COMPLEX64 = 14
    COMPLEX128 = 15
    BFLOAT16 = 16
    FLOAT8E4M3FN = 17
    FLOAT8E4M3FNUZ = 18
    FLOAT8E5M2 = 19
    FLOAT8E5M2FNUZ = 20
    UINT4 = 21
    INT4 = 22
    FLOAT4E2M1 = 23
    FLOAT8E8M0 = 24
    UINT2 = 25
    INT2 = 26

    @property
    def numpy(self) -> np.dtype:
        """The NumPy dtype that holds this element type (ml_dtypes for the narrow floats/ints)."""
        return _TO_NUMPY[self]

    @classmethod
    def from_numpy(cls, dtype: np.dtype | type) -> DType:
        """The DType of a NumPy dtype; raises KeyError for dtypes ONNX has no name for."""
        dtype = np.dtype(dtype)
        if dtype.kind in "OUS":
            return cls.STRING
        return _FROM_NUMPY[dtype]

    @property
    def onnx_name(self) -> str:
        """Name as used in ONNX type strings, e.g. ``float`` in ``tensor(float)``."""
        return _ONNX_NAMES.get(self, self.name.lower())

    @property
    def is_float(self) -> bool:
        return self.numpy.kind == "f" or self in _NARROW_FLOATS


_NARROW_FLOATS = {DType.BFLOAT16, DType.FLOAT8E4M3FN, DType.FLOAT8E4M3FNUZ, DType.FLOAT8E5M2,
                  DType.FLOAT8E5M2FNUZ, DType.FLOAT4E2M1, DType.FLOAT8E8M0}

_TO_NUMPY: dict[DType, np.dtype] = {
    DType.FLOAT: np.dtype(np.float32), DType.UINT8: np.dtype(np.uint8),
    DType.INT8: np.dtype(np.int8), DType.UINT16: np.dtype(np.uint16),
    DType.INT16: np.dtype(np.int16), DType.INT32: np.dtype(np.int32),
    DType.INT64: np.dtype(np.int64), DType.STRING: np.dtype(object),
    DType.BOOL: np.dtype(np.bool_), DType.FLOAT16: np.dtype(np.float16),
    DType.DOUBLE: np.dtype(np.float64), DType.UINT32: np.dtype(np.uint32),
    DType.UINT64: np.dtype(np.uint64), DType.COMPLEX64: np.dtype(np.complex64),
    DType.COMPLEX128: np.dtype(np.complex128),
    DType.BFLOAT16: np.dtype(ml_dtypes.bfloat16),
    DType.FLOAT8E4M3FN: np.dtype(ml_dtypes.float8_e4m3fn),
    DType.FLOAT8E4M3FNUZ: np.dtype(ml_dtypes.float8_e4m3fnuz),
    DType.FLOAT8E5M2: np.dtype(ml_dtypes.float8_e5m2),
    DType.FLOAT8E5M2FNUZ: np.dtype(ml_dtypes.float8_e5m2fnuz),
    DType.UINT4: np.dtype(ml_dtypes.uint4), DType.INT4: np.dtype(ml_dtypes.int4),
    DType.FLOAT4E2M1: np.dtype(ml_dtypes.float4_e2m1fn),
    DType.FLOAT8E8M0: np.dtype(ml_dtypes.float8_e8m0fnu),
    DType.UINT2: np.dtype(ml_dtypes.uint2), DType.INT2: np.dtype(ml_dtypes.int2),
}
_FROM_NUMPY = {v: k for k, v in _TO_NUMPY.items() if k != DType.STRING}
_ONNX_NAMES = {DType.FLOAT: "float", DType.DOUBLE: "double", DType.FLOAT16: "float16",
               DType.BOOL: "bool", DType.STRING: "string"}

Shape = tuple[Dim, ...]


@dataclass(frozen=True)
class TensorType:
    """A tensor of ``dtype``; ``shape`` is None when even the rank is unknown."""

    dtype: DType
    shape: Shape | None = None

    def __str__(self) -> str:
        return f"tensor({self.dtype.onnx_name})"

    @property
    def rank(self) -> int | None:
        return None if self.shape is None else len(self.shape)


@dataclass(frozen=True)
class SequenceType:
    """An ordered list of values of ``elem`` type."""

    elem: ValueType | None

    def __str__(self) -> str:
        return f"seq({self.elem})"


@dataclass(frozen=True)
class OptionalType:
    """Either a value of ``elem`` type or nothing."""

    elem: ValueType | None

    def __str__(self) -> str:
        return f"optional({self.elem})"


@dataclass(frozen=True)
class MapType:
    """A key-value map (ONNX-ML); carried through import/export, not computed on."""

    key: DType
    value: ValueType | None

    def __str__(self) -> str:
        return f"map({self.key.onnx_name},{self.value})"


ValueType = TensorType | SequenceType | OptionalType | MapType
