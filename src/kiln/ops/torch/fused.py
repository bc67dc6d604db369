"""Torch kernels for Kiln's fused ops (domain ai.kiln, defined in kiln/ops/fused.py).

On the CPU, FusedConv with constant weights runs one oneDNN convolution whose post-ops
do the residual add and the activation (the fusion torch.compile's freezing would make);
elsewhere the activation is applied by torch right after the product.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from kiln.ops.fused import ACTIVATIONS, activation
from kiln.ops.registry import KILN_DOMAIN, Site
from kiln.ops.torch import kernel
from kiln.ops.torch.activation import gelu
from kiln.ops.torch.arrays import FLOATS, decided, fact, gated, known_dim
from kiln.ops.torch.conv import conv_kernel, linear
from kiln.ops.torch.linalg import gemm as _gemm_builder
from kiln.ops.torch.linalg import matmul as _matmul_builder
from kiln.ops.torch.norm import RMS_TYPES, rms_norm

NI = NotImplemented


for _name, _fn in {
    "Relu": lambda y, p: torch.relu(y),
    "LeakyRelu": lambda y, p: F.leaky_relu(y, p[0]),
    "Clip": lambda y, p: torch.clamp(y, p[0], p[1]),
    "Sigmoid": lambda y, p: torch.sigmoid(y),
    "HardSigmoid": lambda y, p: torch.clamp(y * p[0] + p[1], 0, 1),
    "HardSwish": lambda y, p: y * torch.clamp(y * (1 / 6) + 0.5, 0, 1),
    "Silu": lambda y, p: F.silu(y),
    "Gelu": lambda y, p: F.gelu(y),
    "GeluTanh": lambda y, p: F.gelu(y, approximate="tanh"),
    "Tanh": lambda y, p: torch.tanh(y),
}.items():
    activation(_name, "torch")(_fn)


def activation_fn(name: str, params):
    """``y -> activation(y)`` in torch; None for no activation, False for one torch has no
    kernel for (the fused op then runs on the NumPy kernel, which names the error)."""
    if not name:
        return None
    act = ACTIVATIONS.get(name)
    fn = act.kernels.get("torch") if act is not None else None
    if fn is None:
        return False
    p = act.params(params)
    return lambda y: fn(y, p)


# oneDNN's convolution post-op (attr, scalars, algorithm) for an activation and its params.
_ONEDNN: dict[str, Callable] = {
    "": lambda p: ("none", [], ""),
    "Relu": lambda p: ("relu", [], ""),
    "Sigmoid": lambda p: ("sigmoid", [], ""),
    "Tanh": lambda p: ("tanh", [], ""),
    "HardSwish": lambda p: ("hardswish", [], ""),
    "Silu": lambda p: ("swish", [], ""),
    "LeakyRelu": lambda p: ("leaky_relu", [p[0]], ""),
    "Clip": lambda p: ("hardtanh", [float(p[0]), float(p[1])], ""),
    "Gelu": lambda p: ("gelu", [], "none"),
    "GeluTanh": lambda p: ("gelu", [], "tanh"),
}


def _onednn_unary(name: str, params):
    """(attr, scalars, algorithm) of oneDNN's conv post-op for ``name``, or None."""
    post = _ONEDNN.get(name)
    return None if post is None else post(ACTIVATIONS[name].params(params) if name else [])


def _sub_site(site: Site, n_inputs: int, drop=("activation", "activation_params")) -> Site:
    """The site as the standard op (Conv, Gemm, MatMul) sees it."""
    attrs = {k: v for k, v in site.attrs.items() if k not in drop}
    node = SimpleNamespace(
        op_type="",
        name=site.node.name,
        inputs=site.node.inputs[:n_inputs],
        outputs=site.node.outputs[:1],
    )
    return Site(node, 21, attrs, site.target)


@kernel("FusedConv", 1, domain=KILN_DOMAIN, prepare=True)
def fused_conv(site):
    name = site.attr("activation", "") or ""
    params = site.attr("activation_params")
    act = activation_fn(name, params)
    if act is False:
        return None
    sub = _sub_site(site, 3)
    run = conv_kernel(sub, act, _onednn_unary(name, params))
    site.notes.extend(sub.notes)
    return run


# onnxruntime's FusedConv (written at its extended level) has the same attributes and meaning
kernel("FusedConv", 1, domain="com.microsoft", prepare=True)(fused_conv)


@kernel("FusedGemm", 1, domain=KILN_DOMAIN, prepare=True)
def fused_gemm(site):
    act = activation_fn(site.attr("activation", "") or "", site.attr("activation_params"))
    if act is False or len(site.node.inputs) > 3:
        return None
    sub = _sub_site(site, 3)
    sub.node.op_type = "Gemm"
    plain = _gemm_builder(sub)
    if plain is None:
        return None
    site.notes.extend(sub.notes)

    def run(a, b, c=None):
        y = plain(a, b, c)
        if y is NI or act is None:
            return y
        return act(y)

    return run


@kernel("FusedMatMul", 1, domain=KILN_DOMAIN, prepare=True)
def fused_matmul(site):
    name = site.attr("activation", "") or ""
    act = activation_fn(name, site.attr("activation_params"))
    if act is False or len(site.node.inputs) > 4:
        return None
    low = site.target.compute_dtype
    wc = site.const(1)
    bc = site.const(2)
    # Without a residual (added before the activation) the activation can be oneDNN's
    # post-op: GELU that way is faster a layer at BERT's sizes (docs/performance.md)
    inner = act if len(site.node.inputs) < 4 or site.node.inputs[3] is None else None
    # A constant 2-D weight with a 1-D bias is exactly F.linear: one BLAS call with the
    # bias folded in.
    lin = None
    if (
        low is None
        and wc is not None
        and wc.ndim == 2
        and wc.dtype.name == "float32"
        and (bc is None or (bc.ndim == 1 and bc.shape[0] == wc.shape[1]))
    ):
        post = _onednn_unary(name, site.attr("activation_params")) if inner else None
        lin = (
            linear(site, site.target.put(wc), inner, post),
            None if bc is None else site.target.put(bc),
        )
        plain = torch.matmul  # for a 1-D ``a``; not MatMul's kernel, which would pack again
    else:
        sub = _sub_site(site, 2)
        sub.node.op_type = "MatMul"
        plain = _matmul_builder(sub)
        if plain is None:
            return None
        site.notes.extend(sub.notes)

    def run(a, b, bias=None, z=None):
        if (
            lin is not None
            and a.dtype == torch.float32
            and a.dim() >= 2
            and (bias is None) == (lin[1] is None)
        ):
            y = lin[0](a, lin[1])
            if inner is not None:
                return y
        elif (
            low is None
            and bias is not None
            and a.dim() >= 2
            and b.dim() == 2
            and bias.dim() == 1
            and a.dtype == b.dtype == bias.dtype
            and a.dtype in (torch.float32, torch.float64)
        ):
            # weights fed at run time (a kiln.to_torch module's parameters): the layer's
            # own F.linear, one addmm with the bias inside (and its backward), as the
            # torch.nn.Linear the pattern came from runs
            y = F.linear(a, b.t(), bias)
        else:
            y = plain(a, b)
            if y is NI:
                return NI
            if bias is not None:
                y = y + bias
        if z is not None:
            y = y + z
        return act(y) if act is not None else y

    return run


@kernel("LayerNorm", 1, domain=KILN_DOMAIN, dtypes=FLOATS, same=True)
def layer_norm(x, scale=None, bias=None, *, axis=-1, epsilon=1e-5):
    a = axis + x.dim() if axis < 0 else axis
    shape = tuple(x.shape[a:])
    w = None if scale is None else scale.expand(shape)
    b = None if bias is None else bias.expand(shape)
    return F.layer_norm(x, shape, w, b, epsilon)


# one F.rms_norm for six decomposed ops
kernel("RMSNorm", 1, domain=KILN_DOMAIN, **RMS_TYPES)(rms_norm)


@kernel("RoPE", 1, domain=KILN_DOMAIN, prepare=True)  # the shared kernel is NumPy's
def rope(site):
    # an even last dim (an odd one is the NumPy kernel's error)
    run = decided(site, [fact(known_dim(site, 0, -1), lambda d: d % 2 == 0)], _rope,
                  lambda x, cos, sin: x.shape[-1] % 2 == 0)
    return run and gated(site, FLOATS, run, same=True)


def _rope(x, cos, sin):
    x1, x2 = x.chunk(2, -1)
    return torch.addcmul(x * cos, torch.cat((-x2, x1), -1), sin)


# Kiln's fused Gelu takes the same attribute as ONNX's Gelu (20): the same kernel
kernel("Gelu", 1, domain=KILN_DOMAIN, dtypes=FLOATS)(gelu)


@kernel("Attention", 1, domain=KILN_DOMAIN, prepare=True)
def attention(site):
    scale = float(site.attr("scale", 1.0))
    kt = int(site.attr("k_transposed", 0))
    heads = int(site.attr("num_heads", 0))
    zero_nan = int(site.attr("zero_nan", 0))
    low = site.target.compute_dtype

    def attend(q, k, v, mask):
        """Over [..., h, s, d] operands, K as [..., s_k, d]."""
        dt = q.dtype
        if low is not None and dt == torch.float32:
            q, k, v = q.to(low), k.to(low), v.to(low)
            mask = None if mask is None else mask.to(low)
        # SDPA gives a row the mask hides entirely zeros, but NaN for NaN scores, where
        # zero_nan's graph gives zeros: those take the three ops
        if (
            q.dim() >= 3
            and q.shape[:-2] == k.shape[:-2] == v.shape[:-2]
            and (mask is None or mask.dim() >= 2)
            and not zero_nan
        ):
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        else:
            s = torch.matmul(q, k.transpose(-1, -2)) * scale
            if mask is not None:
                s = s + mask
            p = torch.softmax(s, -1)
            if zero_nan:
                p = torch.where(p.isnan(), 0.0, p)  # not in place: softmax's backward
            y = torch.matmul(p, v)
        return y if y.dtype == dt else y.to(dt)

    def run(q, k, v, mask=None):
        if heads:  # views: [..., s, h * d] -> [..., h, s, d]
            q, k, v = (t.unflatten(-1, (heads, -1)).transpose(-3, -2) for t in (q, k, v))
            return attend(q, k, v, mask).transpose(-3, -2).flatten(-2)
        return attend(q, k.transpose(-1, -2) if kt else k, v, mask)

    if low is not None:
        site.notes.append(f"computes in {low}")
    return gated(site, FLOATS, run, same=True)
