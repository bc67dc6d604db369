"""Ops that make tensors from attributes or shapes: Constant, ConstantOfShape, Range,
EyeLike, OneHot, and Dropout (identity at inference, seeded masking in training mode)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from kiln.errors import KernelError
from kiln.ir import DType
from kiln.ops import cost
from kiln.ops._array import axis as norm_axis
from kiln.ops._numeric import int_list
from kiln.ops.registry import op


@op("Constant", 1)
def constant(*, value=None, value_float=None, value_floats=None, value_int=None,
             value_ints=None, value_string=None, value_strings=None, sparse_value=None):
    """Exactly one attribute holds the value (sparse ones arrive densified)."""
    if value is not None:
        return np.asarray(value)
    if sparse_value is not None:
        return np.asarray(sparse_value)
    if value_float is not None:
        return np.array(value_float, dtype=np.float32)
    if value_floats is not None:
        return np.array(value_floats, dtype=np.float32)
    if value_int is not None:
        return np.array(value_int, dtype=np.int64)
    if value_ints is not None:
        return np.array(value_ints, dtype=np.int64)
    if value_string is not None:
        return np.array(value_string, dtype=object)
    if value_strings is not None:
        return np.array(list(value_strings), dtype=object)
    raise ValueError("Constant: no value attribute")


@op("ConstantOfShape", 9, host_inputs=(0,), differentiable=False)
def constant_of_shape(shape, *, value=None):
    fill = np.zeros(1, np.float32) if value is None else np.asarray(value)
    return np.full(tuple(int_list(shape)), fill.reshape(-1)[0], dtype=fill.dtype)


def _range_count(start, limit, delta) -> int:
    if isinstance(start, int):  # exact ceil division for integers
        return max(-(-(limit - start) // delta), 0)
    return max(math.ceil((limit - start) / delta), 0)


@op("Range", 11, host_inputs=(0, 1, 2), differentiable=False)
def range_(start, limit, delta):
    """start + i * delta, computed in float64/int64 and cast to the input type."""
    dtype = np.asarray(start).dtype
    wide = np.int64 if dtype.kind in "iu" else np.float64
    s, lim, d = (np.asarray(v).astype(wide).item() for v in (start, limit, delta))
    n = _range_count(s, lim, d)
    return (s + np.arange(n, dtype=wide) * d).astype(dtype)


@op("Range", 27, host_inputs=(0, 1, 2), differentiable=False)
def range27(start, limit, delta, *, stash_type=1):
    """Opset 27: with stash_type 0, float16/bfloat16 values follow the type's own
    rounding (each element rounded from start + i * delta in that type)."""
    dtype = np.asarray(start).dtype
    if stash_type or dtype not in (np.float16, ml_dtypes.bfloat16):
        return range_(start, limit, delta)
    s, d = np.asarray(start).reshape(()), np.asarray(delta).reshape(())
    n = _range_count(*(np.asarray(v).astype(np.float64).item() for v in (start, limit, delta)))
    return (s + np.arange(n).astype(dtype) * d).astype(dtype)


@op("EyeLike", 9, differentiable=False)
def eye_like(x, *, dtype=None, k=0):
    out = DType(dtype).numpy if dtype is not None else x.dtype
    rows, cols = x.shape
    return np.eye(rows, cols, k=k, dtype=out)


@op("OneHot", 9, host_inputs=(1,), differentiable=False)
def one_hot(indices, depth, values, *, axis=-1):
    if np.ndim(indices) == 0:  # ONNX's shape inference and onnxruntime refuse it too
        raise KernelError("OneHot: indices is a scalar, but OneHot takes a tensor of rank 1 "
                          "or more; reshape it to [1]")
    d = int(np.asarray(depth).reshape(-1)[0])
    idx = np.asarray(indices).astype(np.int64)
    idx = np.where(idx < 0, idx + d, idx)  # out of range after this: all "off"
    ax = norm_axis(axis, idx.ndim + 1)
    hot = np.expand_dims(idx, ax) == np.arange(d).reshape((-1,) + (1,) * (idx.ndim - ax))
    off, on = np.asarray(values).reshape(-1)[:2]
    return np.where(hot, on, off).astype(values.dtype)


# -- Dropout ----------------------------------------------------------------------------


@op("Dropout", 1, cost=cost.elementwise)
@op("Dropout", 7, cost=cost.elementwise)
def dropout_legacy(ctx, x, *, ratio=0.5, is_test=0):
    """Opsets < 10 are run as inference: identity, mask of ones in x's type."""
    if ctx.num_outputs < 2:
        return x
    return x, np.ones(x.shape, dtype=x.dtype)


@op("Dropout", 10, cost=cost.elementwise)
def dropout10(ctx, x, *, ratio=0.5):
    if ctx.num_outputs < 2:
        return x
    return x, np.ones(x.shape, dtype=bool)


@op("Dropout", 12, cost=cost.elementwise)
def dropout(ctx, x, ratio=None, training_mode=None, *, seed=None):
    """Training mode drops with a NumPy RandomState seeded by ``seed`` (uniform draws
    >= ratio are kept), scaling kept values by 1 / (1 - ratio)."""
    r = 0.5 if ratio is None else float(np.asarray(ratio).reshape(-1)[0])
    training = training_mode is not None and bool(np.asarray(training_mode).reshape(-1)[0])
    if not training or r == 0:
        y, mask = x, np.ones(x.shape, dtype=bool)
    else:
        rng = np.random.RandomState(seed) if seed is not None else np.random.RandomState()
        mask = rng.uniform(0.0, 1.0, x.shape) >= r
        y = (x * mask / np.asarray(1.0 - r, dtype=np.float64)).astype(x.dtype)
    return (y, mask) if ctx.num_outputs > 1 else y

