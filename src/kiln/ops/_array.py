"""Helpers shared by kernels: the array namespace of inputs and small conversions."""

from __future__ import annotations

import numpy as np
from array_api_compat import array_namespace

from kiln.errors import KernelError
from kiln.ops.registry import REFERENCE

_NUMPY_NS = array_namespace(np.zeros(0))


NUMPY_NS = _NUMPY_NS
"""NumPy's array-API namespace."""


def on_numpy(site) -> bool:
    """Whether the plan runs ``site``'s reference kernel on plain NumPy arrays (the NumPy
    backend, constant folding): its namespace is then known when the kernel is prepared."""
    return site.target.backend == REFERENCE


def input_dtype(site, i: int = 0):
    """The element type the plan knows input ``i`` has (a DType), or None."""
    v = site.node.inputs[i] if i < len(site.node.inputs) else None
    t = None if v is None else v.type
    return getattr(t, "dtype", None)


def namespace(*arrays):
    """The array-API namespace (NumPy's or torch's) for the given arrays."""
    for a in arrays:  # fast path: plain NumPy arrays (array_namespace is slow per call)
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


def axis(a: int, rank: int, high: int = 0) -> int:
    """Normalize a possibly negative axis of a rank-``rank`` array, refusing one outside
    ``[-rank, rank - 1 + high]`` (``high=1`` where the axis may name the end, as Flatten's):
    wrapping it would run a model the spec and onnxruntime refuse."""
    if not -rank <= a < rank + high:
        raise KernelError(f"axis {a} is outside [{-rank}, {rank - 1 + high}], the range of a "
                          f"rank-{rank} input; fix the model's axis attribute")
    return a + rank if a < 0 else a
