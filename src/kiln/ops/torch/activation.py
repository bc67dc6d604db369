"""Torch kernels for activations and softmax."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    SIGNED,
    axis,
    decided,
    gated,
    known_shape,
)


@kernel("Relu", 1, dtypes=SIGNED)  # faster than the generic kernel (no maximum(x, 0) + cast)
def relu(x):
    return torch.relu(x)


@kernel("LeakyRelu", 6, dtypes=FLOATS)  # faster than the generic kernel (one fused op)
def leaky_relu(x, *, alpha=0.01):
    return F.leaky_relu(x, alpha)


# faster than the generic kernel on a 1x32x112x112 NHWC activation with one slope per channel
# (F.prelu is one pass; the generic max/min/multiply passes over an NHWC tensor broadcast
# a (C, 1, 1) slope slowly); other slope shapes run the generic kernel
@kernel("PRelu", 7, prepare=True)
def prelu(site):
    xs, ss = known_shape(site, 0), known_shape(site, 1)
    fits = None if xs is None or ss is None else _prelu_fits(xs, ss)
    run = decided(site, [fits], _prelu,
                  lambda x, slope: _prelu_fits(tuple(x.shape), tuple(slope.shape)))
    return run and gated(site, FLOATS, run, same=True)


def _prelu(x, slope):
    if slope.numel() == 1:
        return F.prelu(x, slope.reshape(1))
    return F.prelu(x, slope.reshape(-1))


def _prelu_fits(xs: tuple, ss: tuple) -> bool | None:
    """Whether F.prelu takes a slope of shape ``ss`` for an input of shape ``xs`` (one
    slope, or one per channel: (C, 1, ...) broadcast from dim 1); None where a size known
    only at run time decides."""
    if len(ss) > len(xs):
        return False
    if not all(isinstance(d, int) for d in ss):
        return None
    if math.prod(ss) == 1:
        return True
    shape = list(ss)
    while shape and shape[0] == 1:
        shape.pop(0)
    if len(xs) < 2:
        return False
    if not isinstance(xs[1], int):
        return None
    return shape == [xs[1]] + [1] * (len(xs) - 2)


@kernel("Elu", 6, dtypes=FLOATS)  # faster than the generic kernel (one fused op)
def elu(x, *, alpha=1.0):
    return F.elu(x, alpha)


@kernel("Celu", 12, dtypes=FLOATS)  # faster than the generic kernel (one fused op)
def celu(x, *, alpha=1.0):
    return F.celu(x, alpha)


@kernel("HardSigmoid", 6, dtypes=FLOATS)  # faster than the generic kernel (one clamp)
def hard_sigmoid(x, *, alpha=0.2, beta=0.5):
    return torch.clamp(x * alpha + beta, 0, 1)


@kernel("HardSwish", 14, dtypes=FLOATS)  # faster than the generic kernel (one clamp)
def hard_swish(x):
    return x * torch.clamp(x * (1 / 6) + 0.5, 0, 1)


@kernel("Gelu", 20, dtypes=FLOATS)
def gelu(x, *, approximate="none"):
    return F.gelu(x, approximate=approximate)


# Slower than the generic kernel but kept for results: the generic x * (x > alpha)
# turns -inf into NaN where ONNX asks for 0.
@kernel("ThresholdedRelu", 10, dtypes=FLOATS)
def thresholded_relu(x, *, alpha=1.0):
    return torch.where(x > alpha, x, torch.zeros_like(x))


kernel("Sigmoid", 6, dtypes=FLOATS)(torch.sigmoid)  # fused op, not 1/(1+exp(-x))
kernel("Softsign", 1, dtypes=FLOATS)(F.softsign)  # one op, no dtype check


# -- softmax ------------------------------------------------------------------------------


_SOFTMAX_TYPES = (torch.bfloat16, torch.float32, torch.float64)


def _softmax_kernel(fn):
    def build(site):
        legacy = site.opset < 13
        ax = int(site.attr("axis", 1 if legacy else -1))

        def run(x):
            if not legacy:
                return fn(x, axis(ax, x.dim()))  # torch takes dim -1 of a scalar
            a = axis(ax, x.dim())
            lead = math.prod(x.shape[:a])
            return fn(x.reshape(lead, -1) if x.numel() else x.reshape(lead, 0), 1).reshape(x.shape)

        # Not float16: the shared kernel's steps, each rounded to fp16, are ONNX's
        # reference; torch's fused softmax rounds once, from fp32, 1-2 fp16 ulps away from
        # it (on the CPU, and on CUDA in test_attention_4d_causal_fp16_expanded). Same
        # results on both devices; fp16 files only (precision="fp16" keeps softmax in fp32).
        return gated(site, _SOFTMAX_TYPES, run)

    return build


# 2.9x (opset 1) and 5.0x (opset 13) the generic kernel: one fused torch.softmax
kernel("Softmax", 1, prepare=True)(_softmax_kernel(torch.softmax))
# 3.2x (opset 1) and 5.8x (opset 13) the generic kernel: one fused torch.log_softmax
kernel("LogSoftmax", 1, prepare=True)(_softmax_kernel(torch.log_softmax))
