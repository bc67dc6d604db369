"""Joining models and small edits of a model's interface: ``compose`` (append or prepend
another model or graph, as ``onnx.compose.merge_models`` does, on the IR), ``rename``
(inputs and outputs), ``add_tail`` (Softmax, ArgMax or TopK after an output) and
``set_batch`` (the first dim of the inputs, a number or a symbol)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import onnx
from onnx import version_converter

from kiln.edit.common import (
    ModelLike,
    all_names,
    named_or_only,
    private_copy,
    retype,
    tensor_type,
    unique_name,
    unknown_name,
)
from kiln.errors import KilnError
from kiln.ir import Model, Node, TensorType, Value, as_dim
from kiln.onnxio import load, to_proto
from kiln.passes.base import add_const
from kiln.passes.infer_shapes import infer_model

DEFAULT_PREFIX = "second/"


def compose(first: ModelLike, second: ModelLike | onnx.GraphProto,
            io_map: Sequence[tuple[str, str]], *, prefix: str = DEFAULT_PREFIX,
            outputs: Iterable[str] | None = None) -> Model:
    """One model running ``first`` and then ``second``, ``second``'s input ``b`` reading
    ``first``'s output ``a`` for every ``(a, b)`` of ``io_map``.

    As in ``onnx.compose.merge_models``: the result's inputs are ``first``'s plus
    ``second``'s unconnected ones; its outputs are ``first``'s that no pair connects plus
    all of ``second``'s (or just ``outputs``, by name). Unlike it, names of ``second``
    that clash with ``first``'s are prefixed with ``prefix``, and models written for
    different opsets are merged: the older one is converted with ONNX's version converter
    to the newer opset. ``second`` may be a bare ``onnx.GraphProto`` (a small graph
    written with ``onnx.helper``), taken at ``first``'s opsets."""
    a = private_copy(first)
    if isinstance(second, onnx.GraphProto):
        proto = onnx.helper.make_model(second, opset_imports=[
            onnx.helper.make_opsetid(d, v) for d, v in a.opset_imports.items()])
        proto.ir_version = a.ir_version
        b = load(proto)
    else:
        b = private_copy(second)
    a, b = _same_opset(a, b)
    ga, gb = a.graph, b.graph
    infer_model(a)  # the outputs' types, to check what io_map joins
    a_out = {v.name: v for v in ga.outputs}
    b_in = {v.name: v for v in gb.inputs}
    for out, inp in io_map:
        if out not in a_out:
            raise unknown_name(out, "an output (of the first model, in io_map)", a_out)
        if inp not in b_in:
            raise unknown_name(inp, "an input (of the second model, in io_map)", b_in)
        _check_joinable(a_out[out], b_in[inp])
    connected_in = {inp for _, inp in io_map}
    connected_out = {out for out, _ in io_map}
    taken = all_names(ga) | {v.name for v in ga.outputs}
    for v in list(gb.values_by_name().values()):
        if v.name in taken and v.name not in connected_in:
            v.name = unique_name(taken, prefix + v.name)
    gb.initializers = {v.name: v for v in gb.initializers.values()}
    for n in gb.nodes:
        if n.name and n.name in taken:
            n.name = unique_name(taken, prefix + n.name)
    for out, inp in io_map:
        b_in[inp].replace_all_uses_with(a_out[out])
    nodes = list(gb.nodes)
    b_outputs = list(gb.outputs)
    gb.outputs = []
    gb.nodes = []
    for n in nodes:
        ga.append(n)
    ga.initializers.update(gb.initializers)
    ga.inputs = list(ga.inputs) + [v for v in gb.inputs if v.name not in connected_in]
    outs = [v for v in ga.outputs if v.name not in connected_out] + b_outputs
    if outputs is not None:
        by_name = {v.name: v for v in list(ga.outputs) + b_outputs}
        wanted = list(outputs)
        for name in wanted:
            if name not in by_name:
                raise unknown_name(name, "an output of either model", by_name)
        outs = [by_name[name] for name in wanted]
    ga.outputs = list(dict.fromkeys(outs))
    for key, f in b.functions.items():
        if key in a.functions and a.functions[key] is not f:
            raise KilnError(f"both models define function {key[1]!r} of domain {key[0]!r}; "
                            "rename one of them before composing")
        a.functions[key] = f
    for d, ver in b.opset_imports.items():
        a.opset_imports[d] = max(ver, a.opset_imports.get(d, ver))
    a.ir_version = max(a.ir_version, b.ir_version)
    retype(a)
    return a


def _same_opset(a: Model, b: Model) -> tuple[Model, Model]:
    """Bring the model with the older default-domain opset to the newer one."""
    va, vb = a.opset, b.opset
    if va == vb:
        return a, b
    older, newer = (a, vb) if va < vb else (b, va)
    try:
        converted = load(version_converter.convert_version(to_proto(older), newer))
    except Exception as e:  # noqa: BLE001 - the converter raises many types
        raise KilnError(f"the models use opsets {va} and {vb} and ONNX's version converter "
                        f"could not bring the older to {newer} ({e}); convert it yourself "
                        "before composing") from None
    return (converted, b) if older is a else (a, converted)


def rename(model: ModelLike, names: Mapping[str, str]) -> Model:
    """``model`` with inputs and outputs renamed (``{"old": "new"}``). An inner tensor
    that already has a new name gets another one."""
    m = private_copy(model)
    g = m.graph
    io = {v.name: v for v in list(g.inputs) + list(g.outputs)}
    for old in names:
        if old not in io:
            raise unknown_name(old, "an input or output", io)
    values = g.values_by_name()
    targets = set(names.values())
    if len(targets) != len(names):
        raise KilnError(f"two inputs or outputs would get the same name: {dict(names)}")
    for new in targets:
        v = values.get(new)
        if v is not None and v.name not in names:
            if v.name in io:
                raise KilnError(f"{new!r} is already an input or output of the model")
            v.name = unique_name(set(values) | targets, new)
            if v.is_const:
                g.initializers = {x.name: x for x in g.initializers.values()}
    for old, new in names.items():
        io[old].name = new
    return m


TAILS = ("Softmax", "ArgMax", "TopK")


def _check_joinable(out: Value, inp: Value) -> None:
    """Refuse joining an output to an input it cannot feed: another element type, another
    rank, or a fixed dim that differs (symbolic dims may be anything)."""
    to = out.type if isinstance(out.type, TensorType) else out.described_type()
    ti = inp.type if isinstance(inp.type, TensorType) else inp.described_type()
    if not isinstance(to, TensorType) or not isinstance(ti, TensorType):
        return
    if to.dtype != ti.dtype:
        raise KilnError(f"io_map joins {out.name!r} ({to.dtype.name}) to {inp.name!r}, "
                        f"which takes {ti.dtype.name}")
    if to.shape is None or ti.shape is None:
        return
    differs = [i for i, (a, b) in enumerate(zip(to.shape, ti.shape))
               if isinstance(a, int) and isinstance(b, int) and a != b]
    if len(to.shape) != len(ti.shape) or differs:
        raise KilnError(f"io_map joins {out.name!r} of shape {_dims(to.shape)} to "
                        f"{inp.name!r}, which takes {_dims(ti.shape)}: add a Reshape between "
                        "them, or join names whose shapes agree")


def _dims(shape) -> str:
    return "(" + ", ".join(str(getattr(d, "name", d)) for d in shape) + ")"


def add_tail(model: ModelLike, op: str, output: str | None = None, *, axis: int = -1,
             k: int = 1, name: str | None = None, keep_output: bool = False) -> Model:
    """``model`` with ``op`` (one of :data:`TAILS`) applied to an output (``output``, or
    the only one) along ``axis``: Softmax gives probabilities, ArgMax the labels (int64,
    the axis dropped), TopK the ``k`` largest values and their indices (two outputs,
    ``NAME_values`` and ``NAME_indices``). The new output is called ``name`` (default
    ``OUTPUT_softmax``...); the original output stays one only with ``keep_output``."""
    if op not in TAILS:
        raise KilnError(f"unknown tail {op!r}; use one of {', '.join(TAILS)}")
    m = private_copy(model)
    g = m.graph
    src = named_or_only(g.outputs, output, "output", "the tail follows")
    output = src.name
    rank = tensor_type(src, "output").shape
    if rank is not None and not -len(rank) <= axis < len(rank):
        raise KilnError(f"axis {axis} is out of range for output {output!r} of rank "
                        f"{len(rank)}")
    taken = all_names(g)
    base = name or f"{output}_{op.lower()}"
    node_name = unique_name(taken, f"tail/{op}")
    if op == "TopK":
        if k < 1:
            raise KilnError(f"TopK needs k >= 1 (got {k})")
        size = rank[axis] if rank is not None else None
        if isinstance(size, int) and k > size:
            raise KilnError(f"TopK k={k} is more than the {size} values of output "
                            f"{output!r} along axis {axis}; give k <= {size}")
        new = [Value(unique_name(taken, f"{base}_values")),
               Value(unique_name(taken, f"{base}_indices"))]
        if m.opset >= 10:
            kv = add_const(g, unique_name(taken, f"{base}_k"), np.array([k], np.int64))
            node = Node("TopK", [src, kv], new, {"axis": axis}, name=node_name)
        else:
            node = Node("TopK", [src], new, {"axis": axis, "k": k}, name=node_name)
    else:
        new = [Value(unique_name(taken, base))]
        attrs = {"axis": axis, "keepdims": 0} if op == "ArgMax" else {"axis": axis}
        node = Node(op, [src], new, attrs, name=node_name)
    g.append(node)
    kept = list(g.outputs) if keep_output else [v for v in g.outputs if v is not src]
    at = list(g.outputs).index(src)
    g.outputs = kept[:at] + new + kept[at:] if not keep_output else kept + new
    retype(m)
    return m


def set_batch(model: ModelLike, batch: int | str,
              inputs: Iterable[str] | None = None) -> Model:
    """``model`` with the first dim of its inputs (or of ``inputs``) set to ``batch``: a
    number fixes it, a name makes it symbolic. Types are inferred afresh from there."""
    if isinstance(batch, int) and batch < 1:
        raise KilnError(f"batch must be at least 1 or a name (got {batch})")
    if isinstance(batch, str) and not batch.isidentifier():
        raise KilnError(f"batch {batch!r}: give a number of at least 1 or a name such as N "
                        "(letters, digits and _, not starting with a digit)")
    m = private_copy(model)
    g = m.graph
    by_name = {v.name: v for v in g.inputs}
    names = list(inputs) if inputs is not None else list(by_name)
    for name in names:
        if name not in by_name:
            raise unknown_name(name, "an input", by_name)
        v = by_name[name]
        t = tensor_type(v, "input")
        if t.shape is None or not t.shape:
            raise KilnError(f"input {name!r} has no first dim to set (shape {t.shape})")
        v.type = TensorType(t.dtype, (as_dim(batch),) + tuple(t.shape[1:]))
    retype(m, keep_declared=False)
    return m


__all__ = ["TAILS", "add_tail", "compose", "rename", "set_batch"]
