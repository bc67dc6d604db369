"""A first handful of ops that show the kernel conventions (see registry.py)."""

from __future__ import annotations

from kiln.ops._array import namespace
from kiln.ops.registry import op


@op("Add", 7, generic=True)
def add(a, b):
    return a + b


@op("Relu", 6, generic=True)
def relu(x):
    xp = namespace(x)
    return xp.where(x > 0, x, xp.zeros_like(x))
