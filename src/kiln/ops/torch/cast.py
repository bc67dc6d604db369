"""Torch kernels for casts."""

from __future__ import annotations

import torch

from kiln.ir import DType
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    TORCH_OF,
    known_dtype,
)

NI = NotImplemented


# -- casts --------------------------------------------------------------------------------


@kernel("Cast", 6, prepare=True)
def cast(site):
    to = int(site.attr("to", 0))
    to = TORCH_OF.get(DType(to)) if to in DType._value2member_map_ else None
    if to is None:
        return None  # strings, uint16+, float8...: NumPy kernel
    known = known_dtype(site)
    if known in (DType.COMPLEX64, DType.COMPLEX128):
        return None  # complex to real: the NumPy kernel's rule

    def run(x):
        if x.dtype == to:
            return x
        if known is None and x.dtype.is_complex:
            return NI  # a type the plan did not know
        if (
            x.dtype in FLOATS
            and to not in FLOATS
            and to != torch.bool
            and not torch.isfinite(x).all()
        ):
            return NI  # NaN/inf to int is platform-defined: leave it to NumPy
        return x.to(to)

    return run


@kernel("CastLike", 15)
def cast_like(x, like):
    if x.dtype == like.dtype:
        return x
    if x.dtype in FLOATS and like.dtype not in FLOATS and like.dtype != torch.bool:
        if not torch.isfinite(x).all():
            return NI  # NaN/inf to int is platform-defined: leave it to NumPy
    return x.to(like.dtype)
