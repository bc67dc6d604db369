"""Helpers shared by kernels: the array namespace of inputs and small conversions."""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

_NUMPY_NS = array_namespace(np.zeros(0))


def namespace(*arrays):
    """The array-API namespace (NumPy's or torch's) for the given arrays."""
    for a in arrays:  # fast path: plain NumPy arrays (array_namespace costs ~2us a call)
        if a is not None and type(a) is not np.ndarray:
            kind = type(a)
            if all(b is None or type(b) is kind for b in arrays):
                return _namespace_of(kind, a)
            return array_namespace(*[a for a in arrays if a is not None])
    return _NUMPY_NS


def _namespace_of(kind: type, example):
    """One array type's namespace, looked up once per type (a pure function of the type)."""
    ns = _BY_TYPE.get(kind)
    if ns is None:
        ns = _BY_TYPE[kind] = array_namespace(example)
    return ns


_BY_TYPE: dict[type, object] = {}


def ints(x) -> list[int]:
    """A 1-D integer tensor (shape, axes, pads...) as a list of Python ints."""
    return [int(v) for v in np.asarray(x).reshape(-1)]


def axis(a: int, rank: int) -> int:
    """Normalize a possibly negative axis."""
    return a + rank if a < 0 else a
