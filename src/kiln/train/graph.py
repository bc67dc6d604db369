"""Graph facts for trainable modules (no torch here): which initializers stay constants,
which hold running statistics, and where gradients flow."""

from __future__ import annotations

from collections.abc import Iterable

from kiln.ir import Graph, Value
from kiln.ops import registry

# Inputs that hold running statistics, not weights: buffers, as in torch.nn.BatchNorm.
STATISTICS = {"BatchNormalization": (3, 4)}


def host_only(g: Graph, opsets: dict[str, int]) -> set[Value]:
    """Initializers every reader takes as a host parameter (shapes, axes, sizes): they stay
    constants of the plan."""
    readers: dict[Value, list[bool]] = {}
    for n in g.nodes:
        d = registry.lookup(n.domain, n.op_type, opsets.get(n.domain, opsets.get("", 1)))
        host = d.host_inputs if d is not None else frozenset()
        for i, v in enumerate(n.inputs):
            if v is not None and v.const is not None:
                readers.setdefault(v, []).append(i in host)
    return {v for v, flags in readers.items() if all(flags)}


def statistics(g: Graph) -> set[Value]:
    """Initializers holding running statistics (BatchNormalization's mean and variance).

    The TorchScript exporter stores equal tensors once and reads the copies through
    Identity nodes (a fresh BatchNorm's running_var equals its weight): such statistics
    become initializers of their own again, since training updates them apart."""
    out = set()
    for n in list(g.nodes):
        for i in STATISTICS.get(n.op_type, ()):
            v = n.inputs[i] if i < len(n.inputs) else None
            if v is None:
                continue
            src = v.producer
            if v.const is None and src is not None and src.op_type == "Identity" \
                    and src.inputs[0] is not None and src.inputs[0].const is not None:
                own = Value(v.name, v.type, src.inputs[0].const.copy())
                v.replace_all_uses_with(own)
                g.remove_node(src)
                g.initializers[own.name] = own
                v = own
            if v.const is not None:
                out.add(v)
    return out


def reached(steps: Iterable, sources: set[Value]) -> list:
    """The steps that read data (not host parameters) computed from ``sources``, in
    order: where gradients of the sources flow."""
    live = set(sources)
    out = []
    for s in steps:
        data = [v for i, v in enumerate(s.inputs) if v is not None and v in live
                and i not in s.host_inputs]
        caps = [v for sub in s.node.subgraphs() for v in sub.captures() if v in live]
        if data or caps:
            out.append(s)
            live.update(v for v in s.outputs if v is not None)
    return out
