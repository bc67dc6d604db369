"""Helpers shared by kernels: the array namespace of inputs and small conversions."""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace


def namespace(*arrays):
    """The array-API namespace (NumPy's or torch's) for the given arrays."""
    return array_namespace(*[a for a in arrays if a is not None])


def ints(x) -> list[int]:
    """A 1-D integer tensor (shape, axes, pads...) as a list of Python ints."""
    return [int(v) for v in np.asarray(x).reshape(-1)]


def axis(a: int, rank: int) -> int:
    """Normalize a possibly negative axis."""
    return a + rank if a < 0 else a
