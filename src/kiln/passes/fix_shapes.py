"""Fixed input shapes: give graph inputs concrete dims (``{"x": [1, 3, 224, 224]}``, like
SINGA's placeholder batch size or OpenVINO's ``--input_shape``) and substitute the values
of the symbols they bind (``batch = 1``) everywhere a type mentions them.

After this, shape inference turns every ``Shape`` of those inputs into a known constant
and constant folding removes the whole shape-computing subgraph.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kiln.errors import ShapeError
from kiln.ir import Model, SymDim, TensorType, Value, as_dim
from kiln.ops import symdim
from kiln.passes.base import Pass, PassRecord, graphs
from kiln.passes.infer_shapes import clear_syms


class FixInputShapes(Pass):
    """Set the given inputs' shapes and propagate the symbol values they imply."""

    name = "fix_input_shapes"
    level = 0

    def __init__(self, input_shapes: Mapping[str, Sequence[int | str | SymDim | None]]):
        self.input_shapes = dict(input_shapes)

    def run(self, model: Model, record: PassRecord) -> None:
        bindings = fix_inputs(model, self.input_shapes)
        record.add("inputs fixed", len(self.input_shapes))
        if bindings:
            record.add("symbols bound", len(bindings))
            record.add("types updated", substitute_symbols(model, bindings))
        clear_syms(model)


def fix_inputs(model: Model, shapes: Mapping[str, Sequence]) -> dict[str, int]:
    """Set the inputs' shapes; returns the symbol values the new dims imply. Raises
    ShapeError for an unknown input, a rank that differs from the model's, or a dim the
    model already fixes to another value. Dims given as text (``"batch"``, ``"seq*2"``)
    are parsed as symbolic dims."""
    by_name = {v.name: v for v in model.graph.inputs}
    unknown = [k for k in shapes if k not in by_name]
    if unknown:
        raise ShapeError(f"input_shapes names {unknown}, which are not inputs of the model; "
                         f"its inputs are {list(by_name)}")
    bindings: dict[str, int] = {}
    for name, dims in shapes.items():
        v = by_name[name]
        t = v.type
        if not isinstance(t, TensorType):
            raise ShapeError(f"input {name!r} is not a tensor; its shape cannot be fixed")
        dims = tuple(as_dim(d) if d is None or isinstance(d, (str, SymDim)) else int(d)
                     for d in dims)
        if any(isinstance(d, int) and d < 0 for d in dims):
            raise ShapeError(f"input_shapes[{name!r}] = {list(dims)} has a negative dim")
        if t.shape is not None:
            if len(t.shape) != len(dims):
                raise ShapeError(f"input {name!r} has rank {len(t.shape)} "
                                 f"({_fmt(t.shape)}) but input_shapes gives {list(dims)}")
            for i, (old, new) in enumerate(zip(t.shape, dims)):
                if isinstance(old, int) and isinstance(new, int) and old != new:
                    raise ShapeError(f"input {name!r} dim {i} is fixed to {old} by the model; "
                                     f"input_shapes gives {new}")
                sym = old.symbol if isinstance(old, SymDim) else None
                if sym is not None and isinstance(new, int):
                    if bindings.get(sym, new) != new:
                        raise ShapeError(f"symbol {sym!r} is given two values: "
                                         f"{bindings[sym]} and {new}")
                    bindings[sym] = new
            dims = tuple(symdim.merge_dim(n, o) for o, n in zip(t.shape, dims))
        v.type = TensorType(t.dtype, dims)
    return bindings


def substitute_symbols(model: Model, bindings: dict[str, int]) -> int:
    """Replace bound symbols in every value's type; returns how many types changed."""
    changed = 0
    seen: set[int] = set()

    def fix(v: Value | None) -> None:
        nonlocal changed
        if v is None or id(v) in seen:
            return
        seen.add(id(v))
        t = v.type
        if isinstance(t, TensorType) and t.shape is not None:
            new = tuple(symdim.substitute(d, bindings) for d in t.shape)
            if new != t.shape:
                v.type = TensorType(t.dtype, new)
                changed += 1

    for g in graphs(model.graph):
        for v in list(g.inputs) + list(g.outputs):
            fix(v)
        for n in g.nodes:
            for v in n.outputs:
                fix(v)
    return changed


def _fmt(shape) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"
