"""Torch kernels for comparisons and logic."""

from __future__ import annotations

import torch

from kiln.ops.torch import kernel

NI = NotImplemented


# -- comparisons and logic ----------------------------------------------------------------


def _compare(fn):
    def run(a, b):
        return fn(a, b) if a.dtype == b.dtype else NI

    return run


# Tensor ops, not array_api_compat's wrappers; torch's comparisons gained nothing
# and run the generic kernel
kernel("And", 7)(_compare(torch.logical_and))
kernel("Or", 7)(_compare(torch.logical_or))
kernel("Xor", 7)(_compare(torch.logical_xor))


@kernel("Not", 1)  # Tensor op, not array_api_compat's wrapper
def not_(x):
    return torch.logical_not(x)


@kernel("Where", 9)  # Tensor op, not array_api_compat's wrapper
def where(cond, x, y):
    if x.dtype != y.dtype or cond.dtype != torch.bool:
        return NI
    return torch.where(cond, x, y)
