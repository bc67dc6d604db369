"""Graph facts for trainable modules (no torch here): which initializers stay constants,
which hold running statistics, and where gradients flow."""

from __future__ import annotations

from collections.abc import Iterable

from kiln.ir import Graph, Model, Node, Value
from kiln.ops import registry
from kiln.ops.registry import KILN_DOMAIN

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
        if (
            src is None
            or src.const is None
            or v is None
            or v.const is not None
            or v in outputs
            or v.name in g.initializers
        ):
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
        data = [
            v
            for i, v in enumerate(s.inputs)
            if v is not None and v in live and i not in s.host_inputs
        ]
        caps = [v for sub in s.node.subgraphs() for v in sub.captures() if v in live]
        if data or caps:
            out.append(s)
            live.update(v for v in s.outputs if v is not None)
    return out


def linear_layers(model: Model) -> int:
    """``Add(MatMul(x, W), b)`` with ``W`` a 2-D float initializer (or ``Transpose(W,
    perm=[1, 0])`` of one, what the TorchScript exporter writes for ``torch.nn.Linear`` on
    a 3-D input) and ``b`` a 1-D initializer of ``W``'s output width becomes Kiln's
    ``FusedMatMul(x, W, b)``, whose torch kernel runs it as ``F.linear`` like the layer it
    came from: one ``addmm`` with the bias inside the GEMM (and ``AddmmBackward``) where
    MatMul then Add are a product and a separate pass over its output, both ways. Returns
    how many were rewritten."""
    g = model.graph
    done = 0
    for mm in list(g.nodes):
        if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or len(mm.inputs) != 2:
            continue
        x, w = mm.inputs
        y = mm.outputs[0]
        if x is None or w is None or y is None or y.is_returned or y.num_reads != 1:
            continue
        add = next(y.readers())
        if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or add.graph is not g:
            continue
        b = add.inputs[1] if add.inputs[0] is y else add.inputs[0]
        width = _weight_width(g, w)
        if (
            b is None
            or b is y
            or width is None
            or g.initializers.get(b.name) is not b
            or b.const is None
            or b.const.ndim != 1
            or b.const.dtype.name != "float32"
            or b.const.shape[0] != width
        ):
            continue
        out = add.outputs[0]
        g.remove_node(add)
        g.insert_before(
            mm, [Node("FusedMatMul", [x, w, b], [out], {}, domain=KILN_DOMAIN, name=mm.name)]
        )
        g.remove_node(mm)
        done += 1
    if done:
        model.opset_imports.setdefault(KILN_DOMAIN, 1)
    return done


def _weight_width(g: Graph, w: Value) -> int | None:
    """The output width of a MatMul's right side that is a 2-D float32 initializer or its
    ``Transpose(perm=[1, 0])``, else None."""
    src, axis = w, 1
    p = w.producer
    if p is not None:
        if (
            p.op_type != "Transpose"
            or p.domain not in ("", "ai.onnx")
            or list(p.attrs.get("perm", [1, 0])) != [1, 0]
            or not p.inputs
        ):
            return None
        src, axis = p.inputs[0], 0
    if src is None or g.initializers.get(src.name) is not src or src.const is None:
        return None
    c = src.const
    return int(c.shape[axis]) if c.ndim == 2 and c.dtype.name == "float32" else None
