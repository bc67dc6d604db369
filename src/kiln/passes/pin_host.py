"""CPU pinning: mark the values that are shapes, axes, sizes or indices computed at run
time (``Value.meta["host"] = True``), so a GPU backend keeps them on the host and never
round-trips a tiny tensor to the device and back to read it.

Seeds are the inputs op definitions say are read on the host (``OpDef.host_inputs``:
Reshape's shape, Slice's starts, Range's bounds, TopK's k...). From there the
mark spreads backwards through the small integer arithmetic that computed them (Shape,
Gather, Concat, Unsqueeze, Add, Mul...); it stops at Shape/Size, which need only the
*shape* of their input, not its data.
"""

from __future__ import annotations

from kiln.ir import Graph, Model, TensorType, Value
from kiln.ops import registry, symdim
from kiln.passes.base import Pass, PassRecord, graphs

SHAPE_ARITHMETIC = frozenset({
    "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Add", "Sub", "Mul", "Div",
    "Neg", "Abs", "Equal", "Where", "Range", "Reshape", "ConstantOfShape", "ReduceProd",
    "ReduceSum", "ReduceMax", "ReduceMin", "Max", "Min", "Floor", "Ceil", "Identity", "Not",
    "And", "Or", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Mod", "Sign",
    "Expand", "Tile", "Flatten", "Constant",
})
STOP = frozenset({"Shape", "Size"})


class PinHost(Pass):
    """Mark shape/index values as host-resident (``meta["host"]``)."""

    name = "pin_host"
    level = 1
    analysis = True

    def run(self, model: Model, record: PassRecord) -> None:
        for g in graphs(model.graph):
            for v in list(g.initializers.values()) + list(g.inputs):
                v.meta.pop("host", None)
            for n in g.nodes:
                for v in n.outputs:
                    if v is not None:
                        v.meta.pop("host", None)
        stack = [v for g in graphs(model.graph) for v in host_read_inputs(model, g)]
        marked = 0
        while stack:
            v = stack.pop()
            if v.meta.get("host") or not _small(v):
                continue
            v.meta["host"] = True
            marked += 1
            p = v.producer
            if p is None or p.domain != "" or p.op_type in STOP or \
                    p.op_type not in SHAPE_ARITHMETIC:
                continue
            stack += [x for x in p.inputs if x is not None]
        record.add("host values", marked)


def host_read_inputs(model: Model, g: Graph) -> list[Value]:
    """The values nodes of ``g`` read on the host (``OpDef.host_inputs``: Reshape's shape,
    Resize's scales, Range's bounds...): where walks over shape computations start."""
    out: list[Value] = []
    for n in g.nodes:
        d = registry.lookup(n.domain, n.op_type, model.opset_of(n.domain))
        if d is not None:
            out += [n.inputs[i] for i in d.host_inputs
                    if i < len(n.inputs) and n.inputs[i] is not None]
    return out


def _small(v: Value) -> bool:
    """Integer (or bool) tensors of rank <= 1, or constants of that kind: shape-like data."""
    t = v.type
    if v.const is not None:
        return v.const.ndim <= 1 and v.const.dtype.kind in "iub" and \
            v.const.size <= symdim.MAX_SYM_LEN * 4
    if not isinstance(t, TensorType):
        return False
    return t.dtype in symdim.SYM_TYPES and \
        (t.shape is None or len(t.shape) <= 1)
