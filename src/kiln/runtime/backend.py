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

    def bind(self, opdef: OpDef, node, opset: int, attrs: dict
             ) -> tuple[Callable, dict, bool, str]:
        """How the plan runs ``node``: (callable, the attributes it is called with, whether
        it takes a KernelContext first, placement label). ``attrs`` are the node's bound
        attributes; backends with their own kernels (torch) override this."""
        fn, placement = self.kernel(opdef)
        return fn, opdef.call_attrs(attrs), opdef.wants_ctx, placement

    def prepare(self, plan, graph, opsets: dict, functions: dict) -> None:
        """Called once the main plan is compiled (torch: fallback warning, compiled mode)."""

    def constant(self, v):
        """The backend array holding initializer ``v`` (``v.meta`` may carry placement hints)."""
        return self.from_numpy(v.const)

    def execute(self, plan, inputs: list, overrides: dict | None = None) -> list:
        """Run the main plan once (backends wrap this in their execution context)."""
        return plan.run(inputs, None, overrides)

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
