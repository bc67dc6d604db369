"""Torch kernels for normalization layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.ops._array import axis as norm_axis
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    axis,
    output_read,
)

NI = NotImplemented


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
        if x.dtype not in FLOATS or x.dim() < 2:
            return NI
        if any(t.dim() != 1 for t in (scale, bias, mean, var)):
            return NI
        if tg.mode.training:  # batch statistics; updates mean and var (module buffers) in place
            y = F.batch_norm(x, mean, var, scale, bias, True, momentum, eps)
        else:
            dt = x.dtype
            if not all(t.dtype == dt for t in (scale, bias, mean, var)):
                return NI
            y = F.batch_norm(x, mean, var, scale, bias, False, 0.0, eps)
        if extra:
            return y, mean.detach().clone(), var.detach().clone()
        return y if n_out == 1 else (y,) + (None,) * (n_out - 1)

    return run


@kernel("InstanceNormalization", 6)
def instance_norm(x, scale, bias, *, epsilon=1e-5):
    if x.dtype not in FLOATS or x.dim() < 3 or scale.dtype != x.dtype:
        return NI
    return F.instance_norm(x, weight=scale, bias=bias, eps=epsilon)


@kernel("LayerNormalization", 17, prepare=True)
def layer_norm(site):
    ax = int(site.attr("axis", -1))
    eps = float(site.attr("epsilon", 1e-5))
    stats = site.output_used(1) or site.output_used(2)
    if int(site.attr("stash_type", 1)) != 1:
        return None

    def run(x, scale, bias=None):
        if x.dtype not in FLOATS or scale.dtype != x.dtype or (stats and x.dtype == torch.float64):
            return NI
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

    return run


@kernel("LpNormalization", 1)
def lp_norm(x, *, axis=-1, p=2):
    if x.dtype not in FLOATS or p not in (1, 2):
        return NI
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
        if x.dtype not in FLOATS or x.dim() < 3:
            return NI
        return F.local_response_norm(x, size, alpha, beta, bias)

    return run


@kernel("RMSNormalization", 23)  # the generic kernel is NumPy's: a CPU fallback on torch
def rms_norm(x, scale=None, *, axis=-1, epsilon=1e-5, stash_type=1):
    if (
        x.dtype not in (torch.float32, torch.float64)
        or stash_type != 1
        or (scale is not None and scale.dtype != x.dtype)
    ):
        return NI
    a = axis + x.dim() if axis < 0 else axis
    shape = tuple(x.shape[a:])
    return F.rms_norm(x, shape, None if scale is None else scale.expand(shape), epsilon)
