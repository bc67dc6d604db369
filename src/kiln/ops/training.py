"""Optimizer steps of the ``ai.onnx.preview.training`` domain: Adagrad, Adam, Momentum.
Each updates n tensors at once; the variadic inputs are grouped per role (all X, then
all G, ...), and so are the outputs."""

from __future__ import annotations

import math

import numpy as np

from kiln.ops.registry import op

DOMAIN = "ai.onnx.preview.training"


def _float(x) -> float:
    return float(np.asarray(x).reshape(-1)[0])


def _groups(inputs: tuple, roles: int) -> list[tuple]:
    n = len(inputs) // roles
    return [inputs[i * n:(i + 1) * n] for i in range(roles)]


@op("Adagrad", 1, domain=DOMAIN)
def adagrad(r, t, *inputs, decay_factor=0.0, epsilon=1e-6, norm_coefficient=0.0):
    lr = _float(r) / (1.0 + _float(t) * decay_factor)
    xs, gs, hs = _groups(inputs, 3)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs):
        g = norm_coefficient * x + g
        h = h + g * g
        new_x.append(x - lr * g / (np.sqrt(h) + epsilon))
        new_h.append(h)
    return tuple(new_x + new_h)


@op("Adam", 1, domain=DOMAIN)
def adam(r, t, *inputs, alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.0,
         norm_coefficient_post=0.0):
    step = _float(t)
    lr = _float(r)
    if step > 0:  # bias correction of the running averages
        lr = lr * math.sqrt(1.0 - beta ** step) / (1.0 - alpha ** step)
    xs, gs, vs, hs = _groups(inputs, 4)
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = norm_coefficient * x + g
        v = alpha * v + (1.0 - alpha) * g
        h = beta * h + (1.0 - beta) * g * g
        x_new = x - lr * v / (np.sqrt(h) + epsilon)
        new_x.append((1.0 - norm_coefficient_post) * x_new)
        new_v.append(v)
        new_h.append(h)
    return tuple(new_x + new_v + new_h)


@op("Momentum", 1, domain=DOMAIN)
def momentum(r, t, *inputs, alpha=None, beta=None, mode=None, norm_coefficient=None):
    """Standard or Nesterov momentum; the first step (T == 0) takes the full gradient."""
    lr = _float(r)
    b = beta if _float(t) > 0 else 1.0
    xs, gs, vs = _groups(inputs, 3)
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs):
        g = norm_coefficient * x + g
        v = alpha * v + b * g
        new_x.append(x - lr * (g + alpha * v) if mode == "nesterov" else x - lr * v)
        new_v.append(v)
    return tuple(new_x + new_v)
