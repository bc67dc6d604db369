"""Activation functions and Softmax/LogSoftmax/Hardmax (array-API kernels, except the
erf-based Gelu)."""

from __future__ import annotations

import math

import numpy as np

from kiln.ir import DType
from kiln.ops import cost
from kiln.ops._array import axis as norm_axis
from kiln.ops._array import input_dtype, namespace, on_numpy
from kiln.ops._numeric import erf, keep_dtype
from kiln.ops.registry import op

try:  # scipy is optional; its expit is one stable C loop where the formula below is five
    from scipy.special import expit as _expit
except ImportError:  # pragma: no cover - exercised only without scipy
    _expit = None

# Arithmetic selection (maximum/minimum with a Python scalar) instead of where(): NumPy's
# where is branchy and several times slower than a ufunc on data with mixed signs, and
# the compat layer's clip() costs more than the op on small NumPy arrays.


def _sigmoid(xp, x):
    if _expit is not None and type(x) is np.ndarray and x.dtype.char in "fd":
        return _expit(x)
    # 1/(1+exp(-x)) keeps full relative precision for negative x; capping -x keeps exp
    # finite (no overflow warnings) where the true value underflows anyway. float16 is
    # computed in float32, where that cap is far enough out.
    if x.dtype == xp.float16:
        x = xp.astype(x, xp.float32)
    cap = 709.0 if x.dtype == xp.float64 else 88.0
    return 1.0 / (xp.exp(xp.minimum(-x, cap)) + 1.0)


def _softplus(xp, x):
    return xp.logaddexp(x, xp.zeros_like(x))


_NATIVE_FLOATS = (DType.FLOAT, DType.DOUBLE)
_ZERO: dict = {}  # dtype -> 0-d zero: NumPy converts a Python 0 anew on every call


def _zero(x):
    if type(x) is not np.ndarray:
        return 0
    z = _ZERO.get(x.dtype)
    if z is None:
        z = _ZERO[x.dtype] = np.zeros((), x.dtype)
    return z


def _neg_part(xp, x):
    return xp.minimum(x, _zero(x))


def _pos_part(xp, x):
    return xp.maximum(x, _zero(x))


@keep_dtype
def relu(x):
    return _pos_part(namespace(x), x)


@op("Relu", 1, generic=True, prepare=True, cost=cost.elementwise)
def _prepare_relu(site):
    dt = input_dtype(site)
    if not on_numpy(site) or dt not in _NATIVE_FLOATS:
        return relu
    zero = np.zeros((), dt.numpy)  # of the input's type: maximum keeps it

    def run(x):  # the shared kernel's steps, resolved now for a known float type
        return np.maximum(x, zero)
    return run


_prepare_relu.attributes = frozenset()


@op("LeakyRelu", 1, generic=True, cost=cost.elementwise)
@keep_dtype
def leaky_relu(x, *, alpha=0.01):
    # For alpha <= 1 the larger of x and alpha*x is the right branch; else the smaller.
    xp = namespace(x)
    return xp.maximum(x, x * alpha) if alpha <= 1 else xp.minimum(x, x * alpha)


@op("PRelu", 1, generic=True, cost=cost.elementwise)
@keep_dtype
def prelu_legacy(x, slope):
    """Opsets < 7: a 1-D slope holds one value per channel (axis 1)."""
    if slope.ndim == 1 and x.ndim > 2 and slope.shape[0] == x.shape[1] > 1:
        slope = namespace(slope).reshape(slope, (slope.shape[0],) + (1,) * (x.ndim - 2))
    return prelu(x, slope)


@op("PRelu", 7, generic=True, cost=cost.elementwise)
@keep_dtype
def prelu(x, slope):
    xp = namespace(x, slope)
    return _pos_part(xp, x) + _neg_part(xp, x) * slope


@op("ThresholdedRelu", 10, generic=True, cost=cost.elementwise)
def thresholded_relu(x, *, alpha=1.0):
    xp = namespace(x)
    return x * xp.astype(x > alpha, x.dtype)


@op("Elu", 1, generic=True, cost=cost.elementwise)
@keep_dtype
def elu(x, *, alpha=1.0):
    xp = namespace(x)
    # a select, not a sum of parts: with alpha = -inf, 0 * alpha would make x >= 0 NaN
    return xp.where(x >= 0, x, (xp.exp(_neg_part(xp, x)) - 1.0) * alpha)


@op("Celu", 12, generic=True, cost=cost.elementwise)
@keep_dtype
def celu(x, *, alpha=1.0):
    xp = namespace(x)
    if x.dtype == xp.float16:  # alpha is a float attribute: 1e-30 is 0 in fp16 (0 / 0 = NaN)
        x = xp.astype(x, xp.float32)
    return xp.where(x >= 0, x, (xp.exp(_neg_part(xp, x) / alpha) - 1.0) * alpha)


@op("Selu", 1, generic=True, cost=cost.elementwise)
@keep_dtype
def selu(x, *, alpha=1.67326319217681884765625, gamma=1.05070102214813232421875):
    xp = namespace(x)
    return (_pos_part(xp, x) + (xp.exp(_neg_part(xp, x)) - 1.0) * alpha) * gamma


@keep_dtype
def sigmoid(x):
    return _sigmoid(namespace(x), x)


@op("Sigmoid", 1, generic=True, prepare=True, cost=cost.elementwise)
def _prepare_sigmoid(site):
    dt = input_dtype(site)
    # what the shared kernel calls for NumPy float32/64 arrays, chosen now
    fast = _expit is not None and on_numpy(site) and \
        dt in _NATIVE_FLOATS
    return _expit if fast else sigmoid


_prepare_sigmoid.attributes = frozenset()


@op("HardSigmoid", 1, generic=True, cost=cost.elementwise)
@keep_dtype
def hard_sigmoid(x, *, alpha=0.2, beta=0.5):
    xp = namespace(x)
    return xp.minimum(xp.maximum(x * alpha + beta, 0.0), 1.0)


@op("HardSwish", 14, generic=True, cost=cost.elementwise)
@keep_dtype
def hard_swish(x):
    xp = namespace(x)
    return x * xp.minimum(xp.maximum(x * (1.0 / 6.0) + 0.5, 0.0), 1.0)


@op("Softplus", 1, generic=True, cost=cost.elementwise)
@keep_dtype
def softplus(x):
    return _softplus(namespace(x), x)


@op("Softsign", 1, generic=True, cost=cost.elementwise)
@keep_dtype
def softsign(x):
    return x / (namespace(x).abs(x) + 1.0)


@op("Mish", 18, generic=True, cost=cost.elementwise)
@keep_dtype
def mish(x):
    xp = namespace(x)
    return x * xp.tanh(_softplus(xp, x))


@op("Swish", 24, generic=True, cost=cost.elementwise)
@keep_dtype
def swish(x, *, alpha=1.0):
    return x * _sigmoid(namespace(x), x * alpha)


@op("SwiGLU", 28, generic=True, cost=cost.per_element(4))
@keep_dtype
def swiglu(a, b, *, alpha=1.0):
    return a * _sigmoid(namespace(a), a * alpha) * b


@op("Shrink", 9, generic=True, cost=cost.elementwise)
@keep_dtype
def shrink(x, *, bias=0.0, lambd=0.5):
    xp = namespace(x)
    return xp.where(x < -lambd, x + bias, xp.where(x > lambd, x - bias, x * 0))


@op("Gelu", 20, cost=cost.elementwise)
@keep_dtype
def gelu(x, *, approximate="none"):
    xp = namespace(x)
    if approximate == "tanh":
        inner = (x + x * x * x * 0.044715) * math.sqrt(2.0 / math.pi)
        return x * 0.5 * (xp.tanh(inner) + 1.0)
    return x * 0.5 * (erf(x * (1.0 / math.sqrt(2.0))) + 1.0)


# -- softmax family ---------------------------------------------------------------------


def _softmax(xp, x, axis):
    e = xp.exp(x - xp.max(x, axis=axis, keepdims=True))
    e /= xp.sum(e, axis=axis, keepdims=True)
    return e


def _log_softmax(xp, x, axis):
    shifted = x - xp.max(x, axis=axis, keepdims=True)
    shifted -= xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True))
    return shifted


def _hardmax(xp, x, axis):
    idx = xp.argmax(x, axis=axis, keepdims=True)
    shape = [1] * x.ndim
    shape[axis] = x.shape[axis]
    pos = xp.reshape(xp.arange(x.shape[axis], dtype=idx.dtype, device=x.device), tuple(shape))
    return xp.astype(pos == idx, x.dtype)


def _coerced_2d(fn):
    """Opsets < 13: flatten to 2-D at ``axis`` and normalize each row."""

    def kernel(x, *, axis=1):
        xp = namespace(x)
        ax = norm_axis(axis, x.ndim)  # a scalar has no axis: onnxruntime refuses it
        rows = math.prod(x.shape[:ax])
        flat = xp.reshape(x, (rows, math.prod(x.shape[ax:])))
        return xp.reshape(fn(xp, flat, 1), x.shape)

    kernel.__name__ = kernel.__qualname__ = fn.__name__.lstrip("_") + "_2d"
    return kernel


def _per_axis(fn):
    """Opset 13+: normalize along ``axis`` only."""

    def kernel(x, *, axis=-1):
        # a scalar has no axis (not even the default -1): onnxruntime refuses it
        return fn(namespace(x), x, norm_axis(axis, x.ndim))

    kernel.__name__ = kernel.__qualname__ = fn.__name__.lstrip("_")
    return kernel


_NORMALIZE = dict(generic=True, cost=cost.per_element(3))
op("Softmax", 1, **_NORMALIZE)(keep_dtype(_coerced_2d(_softmax)))
op("Softmax", 13, **_NORMALIZE)(keep_dtype(_per_axis(_softmax)))
op("LogSoftmax", 1, **_NORMALIZE)(keep_dtype(_coerced_2d(_log_softmax)))
op("LogSoftmax", 13, **_NORMALIZE)(keep_dtype(_per_axis(_log_softmax)))
op("Hardmax", 1, generic=True, differentiable=False)(keep_dtype(_coerced_2d(_hardmax)))
op("Hardmax", 13, generic=True, differentiable=False)(keep_dtype(_per_axis(_hardmax)))
