"""Torch kernels for comparisons and logic."""

from __future__ import annotations

import torch

from kiln.ir import DType
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import known_dtype

# -- comparisons and logic ----------------------------------------------------------------

# Tensor ops, not array_api_compat's wrappers; torch's comparisons gained nothing
# and run the generic kernel
kernel("And", 7, same=True)(torch.logical_and)
kernel("Or", 7, same=True)(torch.logical_or)
kernel("Xor", 7, same=True)(torch.logical_xor)


@kernel("Not", 1)  # Tensor op, not array_api_compat's wrapper
def not_(x):
    return torch.logical_not(x)


@kernel("Where", 9, prepare=True)  # Tensor op, not array_api_compat's wrapper
def where(site):
    cond, x, y = (known_dtype(site, i) for i in range(3))
    if cond not in (None, DType.BOOL) or None not in (x, y) and x != y:
        return None
    if None not in (cond, x, y):
        return torch.where

    def run(cond, x, y):  # a type the plan did not know: checked each call
        if x.dtype != y.dtype or cond.dtype != torch.bool:
            return NotImplemented
        return torch.where(cond, x, y)
    return run
