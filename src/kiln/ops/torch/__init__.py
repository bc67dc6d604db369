"""The torch backend's own kernels, registered on the op definitions (``kiln.ops.registry``)
under the backend name "torch". ``kiln.ops.registry.load_backend("torch")`` imports these
modules (and so torch) the first time anything asks what the torch backend can run.

Only ops whose shared array-API kernel is measurably slower on torch tensors, or that need
a torch primitive (convolution, pooling, oneDNN weight packing), have a kernel here;
``benchmarks/results/torch_overrides.md`` lists them with their measured gain.
"""

from __future__ import annotations

from functools import partial

from kiln.ops import registry

kernel = partial(registry.kernel, "torch")
"""``@kernel("Relu", 6)`` / ``@kernel("Conv", 1, prepare=True)``: a torch kernel for the op
versions from that opset on (see :func:`kiln.ops.registry.kernel`)."""
