"""The torch backend's own kernels, registered on the op definitions (``kiln.ops.registry``)
under the backend name "torch". ``kiln.ops.registry.load_backend("torch")`` imports these
modules (and so torch) the first time anything asks what the torch backend can run.

Only ops whose shared array-API kernel is measurably slower on torch tensors, or that need
a torch primitive (convolution, pooling, oneDNN weight packing), have a kernel here;
``benchmarks/results/torch_overrides.md`` lists them with their measured gain.
"""

from __future__ import annotations

from collections.abc import Callable

from kiln.ops import registry


def kernel(
    op_type: str, since: int = 1, *, dtypes: tuple | None = None, **options
) -> Callable[[Callable], Callable]:
    """``@kernel("Conv", 1, prepare=True)``: a torch kernel for the op versions from that
    opset on (see :func:`kiln.ops.registry.kernel`). ``@kernel("Relu", 1, dtypes=SIGNED)``:
    a plain kernel for inputs of those torch dtypes only, declared rather than checked per
    call: the plan declines a node of another known type when the session is made
    (:func:`kiln.ops.torch.arrays.typed`). The decorated function is returned as it is."""
    prepare = options.pop("prepare", False) or dtypes is not None
    register = registry.kernel("torch", op_type, since, prepare=prepare, **options)
    if dtypes is None:
        return register

    def typed_kernel(fn: Callable) -> Callable:
        from kiln.ops.torch.arrays import typed  # imports torch: only with the kernels

        register(typed(dtypes, fn))
        return fn

    return typed_kernel
