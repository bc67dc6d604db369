"""What every edit shares: taking a model in any form as a private copy, finding tensors
and layers by name (with close matches when a name is wrong), and finishing an edited
model (unused nodes and constants removed, types inferred afresh)."""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Sequence

import onnx

from kiln.errors import KilnError
from kiln.ir import DType, Graph, Model, Node, TensorType, Value, as_dim
from kiln.onnxio import load
from kiln.passes.base import clone_model
from kiln.passes.infer_shapes import clear_syms, infer_model, merge_type

ModelLike = Model | str | os.PathLike | bytes | onnx.ModelProto


def private_copy(model: ModelLike) -> Model:
    """``model`` as a Model the caller may edit freely (a given Model is cloned)."""
    if isinstance(model, Model):
        return clone_model(model)
    return load(model)


def layers(g: Graph) -> dict[str, Node]:
    """Nodes of ``g`` by name (unnamed nodes are left out)."""
    return {n.name: n for n in g.nodes if n.name}


def unknown_name(name: str, what: str, known: Iterable[str]) -> KilnError:
    """The error for a name that is not in ``known``, listing the closest ones."""
    known = list(known)
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.5)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else \
        f"; the model has {len(known)} (see `kiln inspect MODEL`)"
    return KilnError(f"{name!r} is not {what} of the model{hint}")


def named_or_only(values: Sequence[Value], name: str | None, what: str,
                  role: str) -> Value:
    """The graph input/output called ``name`` (``what``: "input" or "output"), or the only
    one when ``name`` is None; ``role`` ends the message asking which one is meant."""
    by_name = {v.name: v for v in values}
    if name is None:
        if len(by_name) != 1:
            raise KilnError(f"the model has {len(by_name)} {what}s {list(by_name)}; say "
                            f"which one {role}")
        name = next(iter(by_name))
    if name not in by_name:
        raise unknown_name(name, f"an {what}", by_name)
    return by_name[name]


def parse_shape(dims: Sequence[int | str | None] | str) -> tuple:
    """Dims from a list or from text like ``1x3x224x224`` or ``batch,3,224,224`` (a name
    is a symbolic dim, ``?`` an unknown one)."""
    if isinstance(dims, str):
        parts = dims.replace("x", ",").split(",") if "," not in dims else dims.split(",")
        dims = [p.strip() for p in parts]
    out = []
    for d in dims:
        if isinstance(d, str):
            d = d.strip()
            if d in ("", "?"):
                out.append(None)
                continue
            if d.lstrip("-").isdigit():
                d = int(d)
        if isinstance(d, int) and d < 0:
            raise KilnError(f"negative dim {d} in shape {list(dims)}")
        out.append(as_dim(d) if d is not None else None)
    return tuple(out)


def retype(model: Model, keep_declared: bool = True) -> None:
    """Forget every inferred type below the inputs (keeping dtypes) and infer afresh:
    after an input's shape changes, stale dims would otherwise survive (inference only
    refines what it is given). With ``keep_declared`` (the edit left the dims inside the
    model as they were), what the outputs declared fills in dims inference cannot find."""
    g = model.graph
    declared = {v: t for v in g.outputs
                if isinstance(t := v.described_type(), TensorType)} if keep_declared else {}
    for n in g.nodes:
        for v in n.outputs:
            if v is not None and isinstance(v.type, TensorType):
                v.type = TensorType(v.type.dtype, None)
    g.value_info = {}
    clear_syms(model)
    infer_model(model)
    for v, old_type in declared.items():
        if v.producer is not None and isinstance(v.type, TensorType):
            v.type = merge_type(v.type, old_type)


def prune(g: Graph) -> None:
    """Drop the nodes no output needs and the initializers nothing reads."""
    needed: set[Node] = set()
    stack = [v for v in g.outputs if v is not None]
    seen: set[Value] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        p = v.producer
        if p is None or p.graph is not g or p in needed:
            continue
        needed.add(p)
        stack += [x for x in p.inputs if x is not None]
        for sub in p.subgraphs():
            stack += sub.captures()
    g.nodes = [n for n in g.nodes if n in needed]
    read = {id(v) for n in g.nodes for v in n.inputs if v is not None}
    read |= {id(v) for n in g.nodes for sub in n.subgraphs() for v in sub.captures()}
    read |= {id(v) for v in g.outputs}
    g.initializers = {k: v for k, v in g.initializers.items() if id(v) in read}


def tensor_type(v: Value, what: str) -> TensorType:
    """``v``'s tensor type (what the file declared where nothing inferred it yet), or a
    KilnError saying shape inference could not type it."""
    t = v.described_type()
    if not isinstance(t, TensorType) or t.dtype == DType.UNDEFINED:
        raise KilnError(f"{what} {v.name!r} has no known tensor type (shape inference could "
                        "not type it); give its shape and dtype explicitly")
    return t


def unique_name(taken: set[str], base: str) -> str:
    """``base``, or ``base_1``, ``base_2``... whichever ``taken`` lacks (then taken)."""
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    taken.add(name)
    return name


def all_names(g: Graph) -> set[str]:
    """Every value and node name of ``g`` (so new ones can avoid them)."""
    return set(g.values_by_name()) | set(layers(g))
