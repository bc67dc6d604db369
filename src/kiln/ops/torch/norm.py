"""Torch kernels for normalization layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops._array import axis as norm_axis
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    axis,
    decided,
    fact,
    gated,
    known_rank,
    output_read,
)

NI = NotImplemented
_NOT_DOUBLE = tuple(t for t in FLOATS if t != torch.float64)
RMS_TYPES = {"dtypes": (torch.float32, torch.float64), "same": True,
             "when": lambda site: site.attr("stash_type", 1) == 1}
"""What the torch RMS norm covers (ONNX's RMSNormalization and Kiln's fused RMSNorm)."""


# -- normalization ------------------------------------------------------------------------


@kernel("BatchNormalization", 7, prepare=True)
def batch_norm(site):
    """Inference with the running statistics; in a training module (:func:`kiln.to_torch`)
    the module's train()/eval() flag decides, whatever ``training_mode`` says: batch
    statistics that update the running ones (module buffers) in place as torch.nn.BatchNorm
    does, and the running statistics as the node's extra outputs."""
    tg = site.target
    if (
        not int(site.attr("spatial", 1))
        or not tg.module
        and (int(site.attr("training_mode", 0)) or site.num_outputs > 1)
    ):
        return None  # training statistics outside a module, per-position params: NumPy kernel
    eps = float(site.attr("epsilon", 1e-5))
    momentum = 1.0 - float(site.attr("momentum", 0.9))  # torch weighs the batch's share
    extra = output_read(site, 1) or output_read(site, 2)
    n_out = site.num_outputs

    def run(x, scale, bias, mean, var):
        if tg.mode.training:  # batch statistics; updates mean and var (module buffers) in place
            y = F.batch_norm(x, mean, var, scale, bias, True, momentum, eps)
        else:
            dt = x.dtype
            if tg.module and not all(t.dtype == dt for t in (scale, bias, mean, var)):
                return NI  # a module's types are known only at run time (autocast)
            y = F.batch_norm(x, mean, var, scale, bias, False, 0.0, eps)
        if extra:
            return y, mean.detach().clone(), var.detach().clone()
        return y if n_out == 1 else (y,) + (None,) * (n_out - 1)

    # an input of 2 dims or more and 1-D parameters (else the NumPy kernel's error)
    params = [fact(known_rank(site, i), lambda r: r == 1) for i in range(1, 5)]
    if False in params:
        return None
    if None in params:
        run = decided(site, [None], run,
                      lambda x, *ps: all(t.dim() == 1 for t in ps))
    return gated(site, FLOATS, run, same=not tg.module, rank=lambda r: r >= 2)


# (a rank under 3: the NumPy kernel's error)
@kernel("InstanceNormalization", 6, dtypes=FLOATS, same=True, rank=lambda r: r >= 3)
def instance_norm(x, scale, bias, *, epsilon=1e-5):
    return F.instance_norm(x, weight=scale, bias=bias, eps=epsilon)


@kernel("LayerNormalization", 17, prepare=True)
def layer_norm(site):
    ax = int(site.attr("axis", -1))
    eps = float(site.attr("epsilon", 1e-5))
    stats = site.output_used(1) or site.output_used(2)
    if int(site.attr("stash_type", 1)) != 1:
        return None

    def run(x, scale, bias=None):
        a = axis(ax, x.dim())
        shape = tuple(x.shape[a:])
        w = scale if tuple(scale.shape) == shape else scale.expand(shape)
        b = bias
        if b is not None and tuple(b.shape) != shape:
            b = b.expand(shape)
        if not stats:
            return F.layer_norm(x, shape, w, b, eps)
        dims = tuple(range(a, x.dim()))
        xf = x.float()
        mean = xf.mean(dim=dims, keepdim=True)
        inv = torch.rsqrt(((xf - mean) ** 2).mean(dim=dims, keepdim=True) + eps)
        y = ((xf - mean) * inv).to(x.dtype) * w
        if b is not None:
            y = y + b
        return y, mean, inv

    # (the statistics outputs in float64: the NumPy kernel)
    return gated(site, _NOT_DOUBLE if stats else FLOATS, run, same=True)


@kernel("LpNormalization", 1, dtypes=FLOATS, when=lambda site: site.attr("p", 2) in (1, 2))
def lp_norm(x, *, axis=-1, p=2):
    axis = norm_axis(axis, x.dim())  # torch sums dim -1 of a scalar; onnxruntime refuses it
    nrm = (
        x.abs().sum(dim=axis, keepdim=True)
        if p == 1
        else torch.sqrt((x * x).sum(dim=axis, keepdim=True))
    )
    return x / torch.where(nrm == 0, torch.ones_like(nrm), nrm)  # zero vectors stay zero


# -- local response normalization ---------------------------------------------------------


@kernel("LRN", 1, prepare=True)
def lrn(site):
    """torch's local_response_norm: differentiable, where the NumPy kernel is not (so
    kiln.to_torch trains through it). Its channel window leans the other way from ONNX's
    for an even ``size``: those run the NumPy kernel."""
    size = int(site.attr("size"))
    if size % 2 == 0:
        return None
    alpha, beta = float(site.attr("alpha", 1e-4)), float(site.attr("beta", 0.75))
    bias = float(site.attr("bias", 1.0))

    def run(x):
        return F.local_response_norm(x, size, alpha, beta, bias)

    # (a rank under 3: the NumPy kernel's error)
    return gated(site, FLOATS, run, rank=lambda r: r >= 3)


@kernel("RMSNormalization", 23, **RMS_TYPES)  # the generic kernel is NumPy's
def rms_norm(x, scale=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    a = axis + x.dim() if axis < 0 else axis
    shape = tuple(x.shape[a:])
    return F.rms_norm(x, shape, None if scale is None else scale.expand(shape), epsilon)
