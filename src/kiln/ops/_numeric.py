"""Numeric helpers shared by the math kernels: small-tensor conversions that work for every
array library, NumPy-only functions the array API lacks (erf), and legacy broadcasting."""

from __future__ import annotations

import functools
import math

import numpy as np
from array_api_compat import array_namespace

try:  # scipy is optional; its erf is a fast C loop
    from scipy.special import erf as _scipy_erf
except ImportError:  # pragma: no cover - exercised only without scipy
    _scipy_erf = None


def int_list(x) -> list[int]:
    """A small integer tensor (axes, k, axis) of any array library as Python ints."""
    if x is None:
        return []
    if isinstance(x, tuple):  # a host parameter the plan made Python numbers: no NumPy
        # (torch.compile would trace np.ravel as tensor ops and break the graph at int())
        return [int(i) for i in x]
    if hasattr(x, "tolist"):
        v = x.tolist()
        return [int(i) for i in np.ravel(v)] if isinstance(v, list) else [int(v)]
    return [int(i) for i in np.ravel(x)]


def int_scalar(x) -> int:
    """A one-element integer tensor as a Python int."""
    return int_list(x)[0]


def is_float(dtype) -> bool:
    """Whether ``dtype`` is a floating type (NumPy, ml_dtypes or torch)."""
    if isinstance(dtype, np.dtype):
        return dtype.kind == "f" or (dtype.kind == "V" and "float" in dtype.name)
    return bool(getattr(dtype, "is_floating_point", False))


def is_int(dtype) -> bool:
    """Whether ``dtype`` is an integer type (bool excluded)."""
    if isinstance(dtype, np.dtype):
        return dtype.kind in "iu" or (dtype.kind == "V" and "int" in dtype.name)
    return not (dtype.is_floating_point or dtype.is_complex) and str(dtype) != "torch.bool"


def keep_dtype(fn):
    """Cast a kernel's result back to its first input's dtype: ml_dtypes' bfloat16 and
    float8 arrays promote to float32 when mixed with Python floats."""

    @functools.wraps(fn)
    def kernel(x, *args, **kwargs):
        y = fn(x, *args, **kwargs)
        return y if y.dtype == x.dtype else array_namespace(y).astype(y, x.dtype)

    return kernel


def legacy_broadcast(b, a_ndim: int, broadcast: int, axis):
    """Opset < 7 binary ops: with ``broadcast=1`` and an ``axis``, B's dimensions line up
    with A's starting at ``axis`` instead of at the end (NumPy style)."""
    if not broadcast or axis is None or b.ndim == 0:
        return b
    ax = axis + a_ndim if axis < 0 else axis
    trailing = a_ndim - ax - b.ndim
    if trailing <= 0:
        return b
    return array_namespace(b).reshape(b, tuple(b.shape) + (1,) * trailing)


def _erf_series(a: np.ndarray) -> np.ndarray:
    # Maclaurin series; terms for |a| < 2.5 stay small enough to keep ~14 digits.
    a2 = a * a
    term = a.copy()
    total = a.copy()
    for n in range(1, 48):
        term *= -a2 / n
        total += term / (2 * n + 1)
    return total * (2.0 / math.sqrt(math.pi))


def _erfc_cf(a: np.ndarray) -> np.ndarray:
    # Continued fraction erfc(a) = exp(-a^2)/sqrt(pi) / (a + (1/2)/(a + 1/(a + (3/2)/...)))
    f = a.copy()
    for k in range(60, 0, -1):
        f = a + (k / 2.0) / f
    with np.errstate(over="ignore", invalid="ignore"):
        return np.exp(-a * a) / (math.sqrt(math.pi) * f)


def erf_fallback(x: np.ndarray) -> np.ndarray:
    """erf in float64 without scipy (series near 0, continued fraction in the tails)."""
    x = np.asarray(x, dtype=np.float64)
    a = np.abs(x)
    out = np.empty_like(a)
    small = a < 2.5
    out[small] = _erf_series(a[small])
    big = ~small
    out[big] = 1.0 - _erfc_cf(a[big])
    out[np.isnan(a)] = np.nan
    return np.copysign(out, x)


def erf(x: np.ndarray) -> np.ndarray:
    """Elementwise error function keeping ``x``'s dtype (computed in float32/float64)."""
    x = np.asarray(x)
    work = np.float64 if x.dtype == np.float64 else np.float32
    if _scipy_erf is not None:
        y = _scipy_erf(x.astype(work, copy=False))
    else:
        y = erf_fallback(x)
    return np.asarray(y).astype(x.dtype, copy=False)
