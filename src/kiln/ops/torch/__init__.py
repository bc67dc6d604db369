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
    op_type: str, since: int = 1, *, dtypes: tuple | None = None, same: bool = False,
    when: Callable | None = None, rank: Callable[[int], bool] | None = None, **options
) -> Callable[[Callable], Callable]:
    """``@kernel("Conv", 1, prepare=True)``: a torch kernel for the op versions from that
    opset on (see :func:`kiln.ops.registry.kernel`). ``@kernel("Relu", 1, dtypes=SIGNED)``:
    a plain kernel for inputs of those torch dtypes only, declared rather than checked per
    call: the plan declines a node of another known type when the session is made
    (:func:`kiln.ops.torch.arrays.typed`); ``same=True``: and for inputs that all share
    the first one's dtype; ``when=lambda site: ...``: and for the nodes it accepts (the
    attributes the kernel covers); ``rank=lambda r: r >= 3``: and for a first input of such
    a rank. The decorated function is returned as it is."""
    checked = dtypes is not None or same or when is not None or rank is not None
    prepare = options.pop("prepare", False) or checked
    register = registry.kernel("torch", op_type, since, prepare=prepare, **options)
    if not checked:
        return register

    def typed_kernel(fn: Callable) -> Callable:
        from kiln.ops.torch.arrays import typed  # imports torch: only with the kernels

        register(typed(dtypes, fn, same, when, rank))
        return fn

    return typed_kernel
