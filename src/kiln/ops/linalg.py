"""Matrix ops: MatMul and Gemm (array API, through BLAS), MatMulInteger, Einsum, Det and
Trilu."""

from __future__ import annotations

import numpy as np

from kiln.ops import cost
from kiln.ops._array import namespace
from kiln.ops._numeric import int_scalar, is_float
from kiln.ops.registry import op


def _blas_dtype(x):
    """NumPy has no BLAS for 16-bit/8-bit floats: compute those in float32."""
    if isinstance(x, np.ndarray) and is_float(x.dtype) and x.dtype.itemsize < 4:
        return np.float32
    return None


def _matmul(xp, a, b):
    if a.ndim > 2 and b.ndim == 2:
        # A stack times one matrix is one tall GEMM: NumPy would loop over the stack.
        y = xp.matmul(xp.reshape(a, (-1, a.shape[-1])), b)
        return xp.reshape(y, tuple(a.shape[:-1]) + (b.shape[-1],))
    return xp.matmul(a, b)


def matmul(xp, a, b):
    """a @ b with a's dtype, via BLAS."""
    work = _blas_dtype(a)
    if work is None:
        return _matmul(xp, a, b)
    return xp.astype(_matmul(xp, xp.astype(a, work), xp.astype(b, work)), a.dtype)


@op("MatMul", 1, generic=True, cost=cost.matmul)
def matmul_(a, b):
    return matmul(namespace(a, b), a, b)


def _gemm(a, b, c, alpha, beta, trans_a, trans_b):
    xp = namespace(a, b)
    if trans_a:
        a = xp.matrix_transpose(a)
    if trans_b:
        b = xp.matrix_transpose(b)
    y = matmul(xp, a, b)
    if alpha != 1.0:
        y = y * alpha
    if c is not None and beta != 0.0:
        y = y + (c if beta == 1.0 else c * beta)
    return y if y.dtype == a.dtype else xp.astype(y, a.dtype)


@op("Gemm", 1, generic=True, cost=cost.gemm)
def gemm_legacy(a, b, c, *, alpha=1.0, beta=1.0, transA=0, transB=0, broadcast=0):
    return _gemm(a, b, c, alpha, beta, transA, transB)


@op("Gemm", 7, generic=True, cost=cost.gemm)
def gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0):
    """Y = alpha * A' B' + beta * C, C broadcast to Y."""
    return _gemm(a, b, c, alpha, beta, transA, transB)


def _minus_zero_point(b: np.ndarray, zp: np.ndarray | None) -> np.ndarray:
    b = b.astype(np.float64)
    return b if zp is None else b - zp.astype(np.float64)  # scalar or per column


@op("MatMulInteger", 10, differentiable=False, cost=cost.matmul, prepare=True)
def matmul_integer(site):
    """Integer matmul with zero points, as exact int32. float64 BLAS is exact here: int8
    products summed over any realistic K stay far below 2**53. A constant B (a quantized
    weight) is converted once, when the session is prepared, not on every run."""
    fixed = None
    if site.const(1) is not None and (not site.has_input(3) or site.const(3) is not None):
        fixed = _minus_zero_point(site.const(1), site.const(3))

    def run(a, b, a_zero_point=None, b_zero_point=None):
        a = a.astype(np.float64)
        if a_zero_point is not None:
            zp = a_zero_point.astype(np.float64)
            if zp.ndim == 1 and zp.size > 1:  # per-row zero point of A
                zp = zp.reshape(-1, 1)
            a = a - zp
        b = fixed if fixed is not None else _minus_zero_point(b, b_zero_point)
        return np.matmul(a, b).astype(np.int32)
    return run


@op("Einsum", 12)
def einsum(*inputs, equation=None):
    eq = equation.replace(" ", "")
    dtype = inputs[0].dtype
    work = _blas_dtype(inputs[0])
    if work is not None:
        inputs = [x.astype(work) for x in inputs]
    y = np.einsum(eq, *inputs, optimize=len(inputs) > 1)
    return np.asarray(y).astype(dtype, copy=False)


@op("Det", 11)
def det(x):
    work = x.dtype if x.dtype in (np.float32, np.float64) else np.float32
    return np.asarray(np.linalg.det(x.astype(work, copy=False))).astype(x.dtype, copy=False)


@op("Trilu", 14, generic=True, host_inputs=(1,))
def trilu(x, k=None, *, upper=1):
    """Keep the upper (col - row >= k) or lower (col - row <= k) triangle of each matrix."""
    xp = namespace(x)
    k = 0 if k is None else int_scalar(k)
    n, m = x.shape[-2], x.shape[-1]
    rows = xp.reshape(xp.arange(n, device=x.device), (n, 1))
    cols = xp.reshape(xp.arange(m, device=x.device), (1, m))
    keep = (cols - rows >= k) if upper else (cols - rows <= k)
    return xp.where(keep, x, xp.zeros_like(x))
