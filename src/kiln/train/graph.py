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


def untie(g: Graph) -> None:
    """Give every Identity copy of an initializer an initializer of its own.

    The TorchScript exporter stores equal-valued tensors once (every fresh layer's zero
    bias, every LayerNorm/BatchNorm weight of ones) and reads the copies through Identity
    nodes named after the original parameters. They are separate parameters of the module
    the model came from, trained apart; one tensor read by two nodes directly (a tied
    embedding and LM head) is a genuinely shared one and stays shared."""
    outputs = set(g.outputs)
    for n in list(g.nodes):
        if n.op_type != "Identity" or n.domain not in ("", "ai.onnx") or not n.inputs:
            continue
        src, v = n.inputs[0], n.outputs[0]
        if src is None or src.const is None or v is None or v.const is not None \
                or v in outputs or v.name in g.initializers:
            continue
        own = Value(v.name, v.type if v.type is not None else src.type, src.const.copy())
        v.replace_all_uses_with(own)
        g.remove_node(n)
        g.initializers[own.name] = own


def statistics(g: Graph) -> set[Value]:
    """Initializers holding running statistics (BatchNormalization's mean and variance);
    run :func:`untie` first, since a fresh BatchNorm's running_var equals its weight and the
    exporter reads one as an Identity copy of the other."""
    out = set()
    for n in g.nodes:
        for i in STATISTICS.get(n.op_type, ()):
            v = n.inputs[i] if i < len(n.inputs) else None
            if v is not None and v.const is not None:
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
