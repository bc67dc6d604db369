"""What the plan needs from a backend: how to pick a kernel and move arrays in and out.
The NumPy backend is the reference; others (torch) subclass it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from kiln.ir import DType
from kiln.ops.registry import OpDef


class Backend:
    """The NumPy backend: runs every op's reference kernel on the CPU."""

    name = "numpy"
    device = "cpu"

    def kernel(self, opdef: OpDef) -> tuple[Callable, str]:
        """The kernel to run ``opdef`` with, and where it runs (a placement label)."""
        return opdef.kernel, self.device

    def from_numpy(self, x):
        return x

    def to_numpy(self, x):
        return x

    def normalize(self, x):
        """Make a kernel's result a proper array of this backend (NumPy scalars -> arrays)."""
        if x is None or isinstance(x, (np.ndarray, list)):
            return x
        return np.asarray(x)

    def accept_feed(self, x, dtype: DType):
        """Turn a caller's feed into this backend's array (lists take the declared dtype)."""
        if isinstance(x, np.ndarray):
            return x
        if hasattr(x, "__array__") and not isinstance(x, (list, tuple)):
            return np.asarray(x)
        return np.asarray(x, dtype=dtype.numpy)

    def dtype_of(self, x) -> DType:
        """The element type of an array of this backend."""
        return DType.from_numpy(x.dtype)
