"""Kiln's fused operators (domain ``ai.kiln``), created by the optimizer's fusion passes.

Each replaces a chain of standard ops by one kernel that does the same arithmetic with
fewer passes over memory and fewer temporaries: the activation and residual add run in
place on the fresh output of the convolution or matrix product, attention keeps one score
buffer, LayerNorm/GELU compute in one place what ten small ops did. Each op's shape/type
inference sits next to its kernel.

The ``activation`` attribute names one of :data:`ACTIVATIONS` (an empty string means none);
each backend registers its kernel for it there with :func:`activation`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kiln.ir import TensorType
from kiln.ir.symbolic import broadcast
from kiln.ops import cost, registry
from kiln.ops._array import axis as norm_axis
from kiln.ops.conv import CONV_ATTRS, convolve, prepare_winograd
from kiln.ops.function_body import NoBody, function_body
from kiln.ops.registry import KILN_DOMAIN, op

_SQRT1_2 = 1 / math.sqrt(2)
_SQRT_2_PI = math.sqrt(2 / math.pi)


# ---------------------------------------------------------------- in-place helpers

def owned(y: np.ndarray, *inputs) -> np.ndarray:
    """``y`` if it is safe to overwrite (a fresh result sharing no memory with an input),
    else a copy of it."""
    if not isinstance(y, np.ndarray) or not y.flags.writeable or y.ndim == 0 or any(
            isinstance(a, np.ndarray) and np.may_share_memory(y, a) for a in inputs):
        return np.array(y, copy=True)
    return y


def erf(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The error function, elementwise. Float32 and narrower use Abramowitz & Stegun
    7.1.26 (absolute error <= 1.5e-7, below float32 resolution of erf's range); float64
    uses math.erf."""
    if x.dtype == np.float64:
        r = np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64)
        if out is None:
            return r
        out[...] = r
        return out
    a = np.abs(x)
    t = a * 0.3275911
    t += 1
    np.reciprocal(t, out=t)
    poly = t * 1.061405429
    poly += -1.453152027
    poly *= t
    poly += 1.421413741
    poly *= t
    poly += -0.284496736
    poly *= t
    poly += 0.254829592
    poly *= t
    np.square(a, out=a)
    np.negative(a, out=a)
    np.exp(a, out=a)
    poly *= a
    np.subtract(1, poly, out=poly)
    np.copysign(poly, x, out=poly)
    if out is None:
        return poly.astype(x.dtype, copy=False)
    out[...] = poly
    return out


def _sigmoid_into(y: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        np.negative(y, out=y)
        np.exp(y, out=y)
        y += 1
        np.reciprocal(y, out=y)
    return y


@dataclass
class Activation:
    """A unary op the fused kernels apply in place to their fresh output. The fused ops'
    ``activation`` attribute names it; ``activation_params`` holds its scalars, read from
    the standard op's attributes ``attrs`` (name, default) when the optimizer fuses it.
    ``kernels`` maps a backend to its ``(y, params) -> y``; NumPy's overwrites ``y``."""

    attrs: tuple[tuple[str, float], ...] = ()
    kernels: dict[str, Callable] = field(default_factory=dict)
    body: Callable | None = None
    """``body(b, x, params) -> y``: the activation in standard ONNX ops on a function
    :class:`~kiln.ops.function_body.Body` (for saved models other runtimes run)."""

    def params(self, given) -> list:
        """``given`` with the defaults of the parameters left out."""
        p = list(given or [])
        return p + [d for _, d in self.attrs[len(p):]]


ACTIVATIONS: dict[str, Activation] = {}
"""Every fusable activation, by the name the ``activation`` attribute uses."""


def activation(name: str, backend: str = "numpy", **attrs: float) -> Callable:
    """Decorator registering ``backend``'s kernel of activation ``name`` (the first
    registration also gives its parameters and their defaults)."""

    def register(fn: Callable) -> Callable:
        ACTIVATIONS.setdefault(name, Activation(tuple(attrs.items()))).kernels[backend] = fn
        return fn

    return register


def apply_activation(y: np.ndarray, name: str, params=None) -> np.ndarray:
    """Apply activation ``name`` to ``y`` in place (``y`` must be owned) and return it."""
    if not name:
        return y
    act = ACTIVATIONS.get(name)
    if act is None:
        raise ValueError(f"unknown fused activation {name!r}")
    return act.kernels["numpy"](y, act.params(params))


@activation("Relu")
def _relu(y, p):
    if y.size < 4096:
        return np.maximum(y, 0, out=y)
    # NumPy 2.4's maximum against a scalar runs a branching loop on elements of random
    # sign; clip's is vectorized. Below 4096 elements clip's larger fixed cost dominates.
    return np.clip(y, y.dtype.type(0), y.dtype.type(np.inf), out=y)


@activation("LeakyRelu", alpha=0.01)
def _leaky_relu(y, p):
    t = y * y.dtype.type(p[0])
    return (np.maximum if p[0] <= 1 else np.minimum)(y, t, out=y)


@activation("Clip", min=-math.inf, max=math.inf)
def _clip(y, p):
    return np.clip(y, p[0], p[1], out=y)


@activation("Sigmoid")
def _sigmoid(y, p):
    return _sigmoid_into(y)


@activation("HardSigmoid", alpha=0.2, beta=0.5)
def _hard_sigmoid(y, p):
    y *= y.dtype.type(p[0])
    y += y.dtype.type(p[1])
    return np.clip(y, 0, 1, out=y)


@activation("HardSwish")
def _hard_swish(y, p):
    t = y * y.dtype.type(1 / 6)
    t += y.dtype.type(0.5)
    np.clip(t, 0, 1, out=t)
    y *= t
    return y


@activation("Silu")
def _silu(y, p):
    y *= _sigmoid_into(y.copy())
    return y


# Abramowitz & Stegun 7.1.26: erf(a) = 1 - poly(1 / (1 + P a)) exp(-a^2), |error| <= 1.5e-7
_AS_P = 0.3275911
_AS_POLY = (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


@activation("Gelu")
def _gelu(y, p):
    if y.dtype == np.float64:  # exact, one Python erf an element
        t = y * _SQRT1_2
        erf(t, out=t)
        t += 1
        t *= 0.5
        y *= t
        return y
    # x Phi(x) = (x + |x| (1 - Q)) / 2, with Q = 1 - erf(|x| / sqrt 2) from 7.1.26: 14
    # passes over the tensor where the same formula through erf() takes 19 (and
    # np.divide(1, t) costs less than np.reciprocal), measured on the largest activation
    # of BERT at batch 8, sequence 128.
    f = y.dtype.type
    a = np.abs(y)
    t = a * f(_AS_P * _SQRT1_2)
    t += f(1)
    np.divide(f(1), t, out=t)
    q = t * f(_AS_POLY[-1])
    for c in _AS_POLY[-2::-1]:
        q += f(c)
        q *= t
    np.square(y, out=t)
    t *= f(-0.5)
    np.exp(t, out=t)
    q *= t
    np.subtract(f(1), q, out=q)
    q *= a
    q += y
    return np.multiply(q, f(0.5), out=y)


@activation("GeluTanh")
def _gelu_tanh(y, p):
    t = np.square(y)
    t *= y.dtype.type(0.044715 * _SQRT_2_PI)
    t += y.dtype.type(_SQRT_2_PI)
    t *= y
    np.tanh(t, out=t)
    t += 1
    t *= y.dtype.type(0.5)
    y *= t
    return y


@activation("Tanh")
def _tanh(y, p):
    return np.tanh(y, out=y)


def _add_into(y: np.ndarray, z) -> np.ndarray:
    """``y + z`` reusing ``y`` when the sum has ``y``'s shape."""
    if z is None:
        return y
    if np.broadcast_shapes(y.shape, np.shape(z)) == y.shape:
        y += z
        return y
    return np.add(y, z)


def _in_float32(kernel):
    """Run ``kernel`` in float32 for float16/bfloat16/float8 inputs (NumPy has no BLAS
    for them, and ml_dtypes' matmul answers in float32) and give the result the input's
    dtype back."""

    @functools.wraps(kernel)
    def run(*args, **attrs):
        dtype = args[0].dtype
        if dtype in (np.float32, np.float64):
            return kernel(*args, **attrs)
        args = [a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype == dtype else a
                for a in args]
        return kernel(*args, **attrs).astype(dtype)

    return run


def _infer_as(ctx, op_type: str, n_inputs: int, drop: tuple[str, ...]):
    """Output type of the standard op the fused one starts with (Conv, Gemm, MatMul)."""
    from kiln.ir import Node
    from kiln.onnxio.infer import onnx_infer

    node = ctx.node
    attrs = {k: v for k, v in node.attrs.items() if k not in drop}
    probe = Node(op_type, node.inputs[:n_inputs], [None], attrs)
    probe.outputs = node.outputs[:1]
    rule = registry.lookup("", op_type, 21).infer
    t = rule(type(ctx)(probe, 21)) if rule is not None else None
    if t is not None and t.shape is not None and all(d is not None for d in t.shape):
        return t
    return onnx_infer(probe, 21, {"": 21})[0]


_ACT_ATTRS = ("activation", "activation_params")


# ---------------------------------------------------------------- FusedConv

def _pointwise(x, w, group, auto_pad, dilations, pads, strides) -> bool:
    """A 1x1, stride-1, unpadded, ungrouped float32/64 convolution."""
    return (group == 1 and x.dtype in (np.float32, np.float64) and w.dtype == x.dtype
            and x.ndim >= 3 and all(k == 1 for k in w.shape[2:])
            and not any(pads or ()) and all(s == 1 for s in strides or ())
            and auto_pad in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER", b"NOTSET"))


def _infer_conv(ctx):
    return _infer_as(ctx, "Conv", 3, _ACT_ATTRS)


@op("FusedConv", 1, domain=KILN_DOMAIN, infer=_infer_conv, prepare=True, cost=cost.conv())
def fused_conv(site):
    """activation(Conv(x, w, b) + z): the bias, residual add and activation are applied
    in place on the convolution's output; Winograd weights prepared as for Conv."""
    attrs = {k: site.attrs[k] for k in CONV_ATTRS if k in site.attrs}
    activation = site.attr("activation", "")
    params = site.attr("activation_params")
    wc, u = prepare_winograd(site)

    @_in_float32
    def run(x, w, b=None, z=None):
        if _pointwise(x, w, attrs.get("group", 1), attrs.get("auto_pad", "NOTSET"),
                      attrs.get("dilations"), attrs.get("pads"), attrs.get("strides")):
            # A 1x1 convolution is one matrix product whose output already has the NCHW
            # layout: no im2col, no copy into a fresh output.
            n, c = x.shape[:2]
            y = np.matmul(w.reshape(w.shape[0], c), x.reshape(n, c, -1))
            y = y.reshape((n, w.shape[0]) + x.shape[2:])
            if b is not None:
                y += b.reshape((1, -1) + (1,) * (x.ndim - 2))
        else:
            y = convolve(x, w, b, wino=u if w is wc else None, **attrs)
        y = owned(y, x, w, b, z)
        y = _add_into(y, z)
        return apply_activation(y, activation, params)
    return run


# ---------------------------------------------------------------- FusedGemm / FusedMatMul

def _infer_gemm(ctx):
    return _infer_as(ctx, "Gemm", 3, _ACT_ATTRS)


@op("FusedGemm", 1, domain=KILN_DOMAIN, infer=_infer_gemm, cost=cost.gemm)
@_in_float32
def fused_gemm(a, b, c=None, *, alpha=1.0, beta=1.0, transA=0, transB=0, activation="",
               activation_params=None):
    """activation(alpha * A' @ B' + beta * C) with one output buffer."""
    if transA:
        a = a.T
    if transB:
        b = b.T
    y = owned(np.matmul(a, b), a, b, c)
    if alpha != 1:
        y *= y.dtype.type(alpha)
    if c is not None:
        y = _add_into(y, c if beta == 1 else c * c.dtype.type(beta))
    return apply_activation(y, activation, activation_params)


def _infer_matmul(ctx):
    return _infer_as(ctx, "MatMul", 2, _ACT_ATTRS)


@op("FusedMatMul", 1, domain=KILN_DOMAIN, infer=_infer_matmul, cost=cost.matmul)
@_in_float32
def fused_matmul(a, b, bias=None, z=None, *, activation="", activation_params=None):
    """activation(A @ B + bias + z), the adds and activation in place on the product."""
    if a.ndim > 2 and b.ndim == 2 and a.flags.c_contiguous:
        # One GEMM over all rows beats a stack of small ones (16-row matrices of a batch)
        y = np.matmul(a.reshape(-1, a.shape[-1]), b).reshape(a.shape[:-1] + b.shape[-1:])
    else:
        y = np.matmul(a, b)
    y = owned(y, a, b, bias, z)
    y = _add_into(_add_into(y, bias), z)
    return apply_activation(y, activation, activation_params)


# ---------------------------------------------------------------- LayerNorm / Gelu

def _same_as_first(x, *rest, **attrs):
    return x if isinstance(x, TensorType) else None


@op("LayerNorm", 1, domain=KILN_DOMAIN, infer=_same_as_first, cost=cost.per_element(5))
@_in_float32
def layer_norm(x, scale=None, bias=None, *, axis=-1, epsilon=1e-5):
    """LayerNormalization (ONNX opset 17's op) for models of older opsets."""
    axis = norm_axis(axis, x.ndim)
    axes = tuple(range(axis, x.ndim))
    d = x - x.mean(axis=axes, keepdims=True)
    var = np.square(d).mean(axis=axes, keepdims=True)
    var += x.dtype.type(epsilon)
    np.sqrt(var, out=var)
    d /= var
    if scale is not None:
        d *= scale
    if bias is not None:
        d += bias
    return d


@op("RMSNorm", 1, domain=KILN_DOMAIN, infer=_same_as_first, cost=cost.per_element(4))
@_in_float32
def rms_norm(x, scale=None, *, axis=-1, epsilon=1e-5):
    """x / sqrt(mean(x^2 over the axes from ``axis``) + epsilon) [* scale]: ONNX opset
    23's RMSNormalization (scale optional) for models of older opsets."""
    axis = norm_axis(axis, x.ndim)
    ms = np.square(x).mean(axis=tuple(range(axis, x.ndim)), keepdims=True)
    ms += x.dtype.type(epsilon)
    np.sqrt(ms, out=ms)
    y = x / ms
    if scale is not None:
        y *= scale
    return y


def _infer_rope(x, cos, sin, **attrs):
    if not all(isinstance(t, TensorType) for t in (x, cos, sin)):
        return None
    if x.shape is None or cos.shape is None or sin.shape is None:
        return TensorType(x.dtype)
    return TensorType(x.dtype, tuple(broadcast(broadcast(x.shape, cos.shape), sin.shape)))


@op("RoPE", 1, domain=KILN_DOMAIN, infer=_infer_rope, cost=cost.per_element(4))
def rope(x, cos, sin):
    """x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for x = [x1, x2] split in
    halves along the last axis: rotary position embedding as Llama, Qwen and GPT-NeoX apply
    it."""
    h = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + rotated * sin


@op("Gelu", 1, domain=KILN_DOMAIN, infer=_same_as_first, cost=cost.elementwise)
@_in_float32
def gelu(x, *, approximate="none"):
    """GELU (ONNX opset 20's op) for models of older opsets."""
    y = np.array(x, copy=True)
    return apply_activation(y, "GeluTanh" if approximate == "tanh" else "Gelu")


# ---------------------------------------------------------------- Attention

def _infer_attention(q, k, v, mask=None, **attrs):
    if not all(isinstance(t, TensorType) for t in (q, v)):
        return None
    if q.shape is None or v.shape is None:
        return TensorType(q.dtype)
    batch = broadcast(q.shape[:-2], v.shape[:-2])
    return TensorType(q.dtype, tuple(batch) + (q.shape[-2], v.shape[-1]))


@op("Attention", 1, domain=KILN_DOMAIN, infer=_infer_attention, cost=cost.attention)
@_in_float32
def attention(q, k, v, mask=None, *, scale=1.0, k_transposed=0, num_heads=0, zero_nan=0):
    """softmax(scale * Q @ K^T + mask) @ V over the last axis, in one score buffer.
    ``k_transposed=1``: K is given as [..., d, s_k] (already transposed).
    ``num_heads=h``: Q, K, V are [..., s, h * d] and the output [..., s, h * d_v], each
    head a slice of the last axis (ONNX Attention-23's 3-D form); the mask broadcasts
    against the scores [..., h, s, s_k]. ``zero_nan=1``: NaN probabilities count as 0
    (a row the mask hides entirely gives zeros, as PyTorch's exported attention does)."""
    if num_heads:
        y = attention(*(split_heads(t, num_heads) for t in (q, k, v)), mask, scale=scale,
                      zero_nan=zero_nan)
        return merge_heads(y)
    kt = k if k_transposed else np.swapaxes(k, -1, -2)
    s = owned(np.matmul(q, kt), q, k, mask)
    if scale != 1:
        s *= s.dtype.type(scale)
    s = _add_into(s, mask)
    # a row of -inf scores is NaN here (-inf - -inf): expected where zero_nan zeroes it
    with np.errstate(invalid="ignore" if zero_nan else "warn"):
        s -= s.max(axis=-1, keepdims=True)
        np.exp(s, out=s)
        s /= s.sum(axis=-1, keepdims=True)
    if zero_nan:
        np.copyto(s, 0, where=np.isnan(s))
    return np.matmul(s, v)


def split_heads(x, heads: int):
    """[..., s, h * d] -> [..., h, s, d] (a view where the array allows it)."""
    return x.reshape(tuple(x.shape[:-1]) + (heads, x.shape[-1] // heads)).swapaxes(-3, -2)


def merge_heads(y):
    """[..., h, s, d] -> [..., s, h * d]."""
    y = y.swapaxes(-3, -2)
    return y.reshape(tuple(y.shape[:-2]) + (y.shape[-2] * y.shape[-1],))


# ---------------------------------------------------------------- function bodies
# What each fused op computes, in standard ONNX ops: saved as the op's model-local function
# so that other runtimes run a model Kiln optimized (see kiln.ops.function_body).

def activation_body(name: str) -> Callable:
    """Decorator giving activation ``name`` its standard-ONNX form (``fn(b, x, p)``)."""

    def register(fn: Callable) -> Callable:
        ACTIVATIONS[name].body = fn
        return fn

    return register


activation_body("Relu")(lambda b, x, p: b.op("Relu", x))
activation_body("Sigmoid")(lambda b, x, p: b.op("Sigmoid", x))
activation_body("Tanh")(lambda b, x, p: b.op("Tanh", x))
activation_body("LeakyRelu")(lambda b, x, p: b.op("LeakyRelu", x, alpha=float(p[0])))
activation_body("HardSigmoid")(
    lambda b, x, p: b.op("HardSigmoid", x, alpha=float(p[0]), beta=float(p[1])))
activation_body("Silu")(lambda b, x, p: b.op("Mul", x, b.op("Sigmoid", x)))


@activation_body("Clip")
def _clip_body(b, x, p):
    if b.opset < 11:
        return b.op("Clip", x, min=float(p[0]), max=float(p[1]))
    return b.op("Clip", x, b.const(p[0]), b.const(p[1]))


@activation_body("HardSwish")
def _hard_swish_body(b, x, p):
    if b.opset >= 14:
        return b.op("HardSwish", x)
    return b.op("Mul", x, b.op("HardSigmoid", x, alpha=1 / 6, beta=0.5))


@activation_body("Gelu")
def _gelu_body(b, x, p):
    phi = b.op("Add", b.const(1), b.op("Erf", b.op("Mul", x, b.const(_SQRT1_2))))
    return b.op("Mul", b.op("Mul", x, b.const(0.5)), phi)


@activation_body("GeluTanh")
def _gelu_tanh_body(b, x, p):
    cube = b.op("Mul", b.op("Mul", x, x), x)
    inner = b.op("Add", x, b.op("Mul", cube, b.const(0.044715)))
    t = b.op("Tanh", b.op("Mul", inner, b.const(_SQRT_2_PI)))
    return b.op("Mul", b.op("Mul", x, b.const(0.5)), b.op("Add", b.const(1), t))


def _activation_body(b, y):
    name = b.attrs.get("activation", "")
    if not name:
        return y
    act = ACTIVATIONS[name]
    return act.body(b, y, act.params(b.attrs.get("activation_params")))


def _add_optional(b, y, i):
    return y if b.input(i) is None else b.op("Add", y, b.input(i))


@function_body("FusedConv")
def _fused_conv_body(b):
    conv = {k: v for k, v in b.attrs.items() if k in CONV_ATTRS}
    y = b.op("Conv", b.input(0), b.input(1), b.input(2), **conv)
    b.finish(_activation_body(b, _add_optional(b, y, 3)))


@function_body("FusedGemm")
def _fused_gemm_body(b):
    gemm = {k: v for k, v in b.attrs.items() if k in ("alpha", "beta", "transA", "transB")}
    b.finish(_activation_body(b, b.op("Gemm", b.input(0), b.input(1), b.input(2), **gemm)))


@function_body("FusedMatMul")
def _fused_matmul_body(b):
    y = b.op("MatMul", b.input(0), b.input(1))
    b.finish(_activation_body(b, _add_optional(b, _add_optional(b, y, 2), 3)))


def _norm_axes(b) -> list[int]:
    """The axes from the ``axis`` attribute on, as a function body's ReduceMean takes them."""
    axis, rank = b.attrs.get("axis", -1), b.rank(0)
    if rank is not None:
        return list(range(norm_axis(axis, rank), rank))
    if axis < 0 and b.opset >= 11:  # negative axes need no rank from opset 11 on
        return list(range(axis, 0))
    return list(range(axis, b.need_rank(0)))


@function_body("LayerNorm")
def _layer_norm_body(b):
    axes = _norm_axes(b)
    x = b.input(0)
    d = b.op("Sub", x, b.reduce_mean(x, axes))
    var = b.reduce_mean(b.op("Mul", d, d), axes)
    std = b.op("Sqrt", b.op("Add", var, b.const(b.attrs.get("epsilon", 1e-5))))
    y = b.op("Div", d, std)
    b.finish(_add_optional(b, y if b.input(1) is None else b.op("Mul", y, b.input(1)), 2))


@function_body("RMSNorm")
def _rms_norm_body(b):
    x = b.input(0)
    ms = b.reduce_mean(b.op("Mul", x, x), _norm_axes(b))
    y = b.op("Div", x, b.op("Sqrt", b.op("Add", ms, b.const(b.attrs.get("epsilon", 1e-5)))))
    b.finish(y if b.input(1) is None else b.op("Mul", y, b.input(1)))


@function_body("RoPE")
def _rope_body(b):
    shape = b.node.inputs[0].shape
    if b.opset < 11 or shape is None or not isinstance(shape[-1], int):
        raise NoBody("RoPE: needs opset 11+ (Slice with a negative axis) and a known last dim")
    x, half = b.input(0), b.ints([shape[-1] // 2])
    lo = b.op("Slice", x, b.ints([0]), half, b.ints([-1]))
    hi = b.op("Slice", x, half, b.ints([2 ** 63 - 1]), b.ints([-1]))
    rotated = b.op("Concat", b.op("Neg", hi), lo, axis=-1)
    b.finish(b.op("Add", b.op("Mul", x, b.input(1)), b.op("Mul", rotated, b.input(2))))


@function_body("Gelu")
def _gelu_fn_body(b):
    tanh = b.attrs.get("approximate", "none") == "tanh"
    b.finish(ACTIVATIONS["GeluTanh" if tanh else "Gelu"].body(b, b.input(0), []))


@function_body("Attention")
def _attention_body(b):
    q, k, v = b.input(0), b.input(1), b.input(2)
    heads = b.attrs.get("num_heads", 0)
    if heads:  # 3-D inputs: split the heads off the last axis, merge them back at the end
        if b.opset < 5 or b.need_rank(0) != 3:
            raise NoBody("Attention: num_heads needs 3-D inputs and opset 5+")
        split = b.ints([0, 0, heads, -1])
        q, k, v = (b.op("Transpose", b.op("Reshape", x, split), perm=perm)
                   for x, perm in ((q, [0, 2, 1, 3]), (k, [0, 2, 3, 1]), (v, [0, 2, 1, 3])))
    elif not b.attrs.get("k_transposed", 0):
        perm = list(range(b.need_rank(1)))
        perm[-2:] = perm[-1], perm[-2]
        k = b.op("Transpose", k, perm=perm)
    s = b.op("MatMul", q, k)
    scale = b.attrs.get("scale", 1.0)
    if scale != 1:
        s = b.op("Mul", s, b.const(scale))
    s = _add_optional(b, s, 3)
    axis = -1 if b.opset >= 11 else (4 if heads else b.need_rank(0)) - 1
    p = b.op("Softmax", s, axis=axis)
    if b.attrs.get("zero_nan", 0):
        p = b.op("Where", b.op("IsNaN", p), b.const(0.0), p)
    y = b.op("MatMul", p, v)
    if heads:
        y = b.op("Reshape", b.op("Transpose", y, perm=[0, 2, 1, 3]), b.ints([0, 0, -1]))
    b.finish(y)
