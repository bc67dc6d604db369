"""``kiln.cut``: a model's part between new entry and exit points (Model Optimizer's
``--input``/``--output``, ``onnx.utils.extract_model``), or without its last layers
(SINGA's ``last_layers``).

Names may be tensors or layers (node names): a layer stands for its outputs among
``outputs`` and for its non-constant inputs among ``inputs``. A new input takes its dtype
and (symbolic) shape from shape inference unless a shape is given. Everything the new
outputs do not need goes, initializers included.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kiln.edit.common import (
    ModelLike,
    layers,
    parse_shape,
    private_copy,
    prune,
    retype,
    tensor_type,
    unknown_name,
)
from kiln.errors import KilnError
from kiln.ir import Graph, Model, TensorType, Value
from kiln.passes.infer_shapes import infer_model

Names = Iterable[str] | Mapping[str, Sequence[int | str | None] | str | None]


def cut(model: ModelLike, inputs: Names | None = None, outputs: Iterable[str] | None = None,
        last_layers: int | None = None) -> Model:
    """The part of ``model`` that computes ``outputs`` from ``inputs``.

    ``inputs``: tensor or layer names (None: the model's own inputs), or a mapping from
    name to a shape (``[1, 3, 224, 224]``, ``"batch,3,224,224"``, ``"1x3x224x224"``; None
    keeps the inferred one). ``outputs``: tensor or layer names (None: the model's).
    ``last_layers``: SINGA's meaning, counted over the non-Constant layers in topological
    order: ``-k`` drops the last ``k`` layers and returns the outputs of the layer before
    them; ``n > 0`` keeps the first ``n`` layers and returns the ``n``-th one's outputs.

    Raises KilnError for a name the model lacks (with close matches), or when an output
    needs a graph input that is not among the new inputs.
    """
    m = private_copy(model)
    g = m.graph
    infer_model(m)
    if last_layers is not None:
        if outputs is not None:
            raise KilnError("give either outputs= or last_layers=, not both")
        outs = _last_layer_outputs(g, last_layers)
    else:
        outs = _resolve(g, outputs, "output") if outputs is not None else list(g.outputs)
    shapes = dict(inputs) if isinstance(inputs, Mapping) else \
        {name: None for name in inputs} if inputs is not None else {}
    new_inputs: list[Value] = []
    fixed = False
    if inputs is None:
        new_inputs = list(g.inputs)
    for name, shape in shapes.items():
        for v in _resolve(g, [name], "input"):
            nv = _as_input(g, v, shape)
            fixed |= shape is not None
            if nv not in new_inputs:
                new_inputs.append(nv)
    outs = [_as_input_value(g, v, new_inputs) for v in outs]
    _check_reachable(g, outs, new_inputs)
    g.inputs = new_inputs
    g.outputs = list(dict.fromkeys(outs))
    prune(g)
    if inputs is None:  # the model's own inputs: only those the outputs still need
        g.inputs = [v for v in g.inputs if v.is_used()]
    if fixed:
        retype(m, keep_declared=False)
    return m


def _resolve(g: Graph, names: Iterable[str], role: str) -> list[Value]:
    if isinstance(names, str):
        names = [names]
    values, nodes = g.values_by_name(), layers(g)
    out: list[Value] = []
    for name in names:
        if name in values:
            out.append(values[name])
        elif name in nodes:
            n = nodes[name]
            if role == "output":
                out += [v for v in n.outputs if v is not None]
            else:
                out += [v for v in n.inputs if v is not None and not v.is_const]
        else:
            raise unknown_name(name, f"a tensor or layer (for {role}s)",
                               list(values) + list(nodes))
    return out


def _last_layer_outputs(g: Graph, k: int) -> list[Value]:
    layer_list = [n for n in g.nodes if not (n.op_type == "Constant" and n.domain == "")]
    count = len(layer_list)
    if k == 0 or k >= count or -k >= count:
        raise KilnError(f"last_layers={k} leaves no layer or all of them: the model has "
                        f"{count} layers (not counting Constant nodes); use -{count - 1}..-1 "
                        f"or 1..{count - 1}")
    keep = layer_list[k - 1]
    return [v for v in keep.outputs if v is not None]


def _as_input(g: Graph, v: Value, shape) -> Value:
    """``v`` made a graph input (a fresh Value every reader of ``v`` now reads)."""
    if v in g.inputs:
        nv = v
    else:
        t = tensor_type(v, "new input")
        nv = Value(v.name, t)
        v.replace_all_uses_with(nv)
        v.name = f"{v.name}__cut"  # its producer goes with prune; the name is the input's
        if v.is_const:
            g.initializers.pop(nv.name, None)
    if shape is not None:
        t = tensor_type(nv, "input")
        dims = parse_shape(shape)
        if t.shape is not None and len(t.shape) != len(dims):
            raise KilnError(f"input {nv.name!r} has rank {len(t.shape)}, the shape given "
                            f"{list(dims)} has {len(dims)}")
        nv.type = TensorType(t.dtype, dims)
    return nv


def _as_input_value(g: Graph, v: Value, new_inputs: list[Value]) -> Value:
    """An output that was replaced by a new input is that input."""
    for nv in new_inputs:
        if nv.name == v.name:
            return nv
    return v


def _check_reachable(g: Graph, outs: list[Value], new_inputs: list[Value]) -> None:
    """Every output must be computable from the new inputs and the constants."""
    allowed = set(new_inputs)
    for out in outs:
        stack, seen = [out], set()
        while stack:
            v = stack.pop()
            if v in seen or v in allowed:
                continue
            seen.add(v)
            if v.is_const and v.producer is None:
                continue
            p = v.producer
            if p is None or p.graph is not g:
                raise KilnError(
                    f"output {out.name!r} cannot be computed from the inputs "
                    f"{[x.name for x in new_inputs]}: it also needs {v.name!r}; add it "
                    f"to the inputs, or cut at a later point")
            stack += [x for x in p.inputs if x is not None]
            for sub in p.subgraphs():
                stack += sub.captures()
