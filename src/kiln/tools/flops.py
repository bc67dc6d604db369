"""Estimated floating-point operations per layer, from the shapes the IR knows and the
cost rule each op definition carries (``kiln.ops.cost``). Ops without a rule (shape
plumbing, control flow) count 0. Symbolic dims take given sizes (default 1)."""

from __future__ import annotations

from kiln.ir import Node
from kiln.ops import registry
from kiln.tools.common import concrete_shape, dims_of

_LATEST = 10**6  # an opset every version's range reaches when the caller does not say


def layer_flops(n: Node, sizes: dict[str, int] | None = None, opset: int | None = None
                ) -> int | None:
    """Estimated FLOPs of one node; None when a shape it needs is unknown."""
    d = registry.lookup(n.domain, n.op_type, opset or _LATEST) or _newest(n)
    if d is None or d.cost is None:
        return 0

    def shapes(vs):
        return [None if v is None else concrete_shape(dims_of(v), sizes) for v in vs]
    return d.cost(n, shapes(n.inputs), shapes(n.outputs))


def _newest(n: Node):
    versions = [d for d in registry.registered()
                if d.domain == n.domain and d.op_type == n.op_type]
    return versions[-1] if versions else None
