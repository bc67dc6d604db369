"""Half-precision conversion: weights and arithmetic in float16 (or bfloat16), saved as a
plain ONNX model.

Which layers convert is decided per node: a node converts when it computes on float32
data, ONNX defines it for the half type, it is not on the block list, and it does not
compute a shape, size or scale some other node reads on the host (Reshape's shape,
Resize's scales, Range's bounds: halving those changes the model's geometry). Everything
else keeps float32, and a Cast goes wherever a value crosses between the two worlds,
graph inputs and outputs included when ``keep_io_types``.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
import onnx.defs

from kiln.ir import DType, Model, Node, TensorType, Value
from kiln.onnxio import load
from kiln.passes.base import clone_model
from kiln.passes.infer_shapes import infer_model
from kiln.passes.pin_host import STOP as SHAPE_ONLY
from kiln.passes.pin_host import host_read_inputs

__all__ = ["FP16_MAX", "as_model", "convert_float16"]

FP16_MAX = float(np.finfo(np.float16).max)

# Kept in float32 whatever their inputs: their float inputs are geometry (Resize's and
# Upsample's scales, Range's bounds) or random draws whose dtype is an attribute.
ALWAYS_FLOAT32 = frozenset({"Resize", "Upsample", "Range", "RandomNormal", "RandomUniform",
                            "RandomNormalLike", "RandomUniformLike", "Multinomial",
                            "NonMaxSuppression", "RoiAlign", "If", "Loop", "Scan"})
# Attributes that name an output dtype, by op.
_DTYPE_ATTRS = {"Cast": "to", "EyeLike": "dtype", "ConstantOfShape": None, "Constant": None}


def convert_float16(model, keep_io_types: bool = True, block_list: Iterable[str] = (),
                    bf16: bool = False) -> Model:
    """Convert ``model`` (a path, bytes, ModelProto or Kiln Model) to float16 weights and
    compute, or bfloat16 with ``bf16=True``; returns a new Kiln :class:`Model`.

    ``keep_io_types`` keeps float32 graph inputs and outputs (Casts at the boundary).
    ``block_list`` names op types or layer names kept in float32 (Casts around them).
    Float16 constants outside +-65504 are clamped to it with a warning instead of
    becoming Inf (an attention mask's -3.4e38 becomes -65504, which still masks).
    """
    m = as_model(model)
    infer_model(m)
    half = DType.BFLOAT16 if bf16 else DType.FLOAT16
    blocked = set(block_list)
    g = m.graph
    convert = {n for n in g.nodes
               if _convertible(n, m, half) and n.op_type not in blocked and n.name not in blocked}
    convert -= _shape_path(m)
    convert -= _subgraph_feeders(m)
    clamped: list[str] = []

    # Outputs of converted nodes become half (attributes that fix a dtype follow).
    for n in convert:
        _retype_attrs(n, half, clamped)
        for v in n.outputs:
            if v is not None and v.dtype == DType.FLOAT:
                v.type = TensorType(half, v.shape)

    # Float32 constants read only by converted nodes become half themselves.
    for name, v in list(g.initializers.items()):
        readers = v.consumers()
        if v.dtype == DType.FLOAT and readers and all(r in convert for r in readers):
            v.const = _to_half(v.const, half, name, clamped)
            v.type = TensorType(half, tuple(v.const.shape))

    if not keep_io_types:
        for v in g.inputs:
            if v.dtype == DType.FLOAT and v.const is None:
                v.type = TensorType(half, v.shape)

    casts: dict[tuple[Value, DType], Value] = {}

    def cast(v: Value, to: DType, before: Node) -> Value:
        key = (v, to)
        if key not in casts:
            out = Value(f"{v.name}/to_{to.name.lower()}", TensorType(to, v.shape))
            g.insert_before(before, [Node("Cast", [v], [out], {"to": int(to)},
                                          name=f"{v.name}/cast_{to.name.lower()}")])
            casts[key] = out
        return casts[key]

    # Every read that now crosses between float32 and half gets a Cast. Nodes are visited in
    # order, so a Cast lands after its value's producer and before the first reader.
    for n in list(g.nodes):
        for i, v in enumerate(n.inputs):
            if v is None or v.dtype not in (DType.FLOAT, half):
                continue
            want = half if n in convert else DType.FLOAT
            if want != v.dtype:
                n.set_input(i, cast(v, want, n))

    for v in list(g.outputs):
        if v.dtype == half and keep_io_types:
            inner = Value(f"{v.name}/{half.name.lower()}", v.type)
            prod = v.producer
            prod.outputs = [inner if o is v else o for o in prod.outputs]
            v.replace_all_uses_with(inner, keep_outputs_of=g)
            v.type = TensorType(DType.FLOAT, v.shape)
            g.append(Node("Cast", [inner], [v], {"to": int(DType.FLOAT)},
                          name=f"{v.name}/cast_float"))
    if clamped:
        warnings.warn(f"convert_float16: {len(clamped)} constant(s) held values beyond the "
                      f"float16 range, clamped to +-{FP16_MAX:g}: {', '.join(clamped[:5])}"
                      + (" ..." if len(clamped) > 5 else ""), stacklevel=2)
    return m


def as_model(model) -> Model:
    """A private copy of ``model`` (a path, bytes, ModelProto or Kiln Model) to edit."""
    return clone_model(model) if isinstance(model, Model) else load(model)


def _convertible(n: Node, m: Model, half: DType) -> bool:
    """Whether ``n`` computes on float32 data and ONNX defines it for ``half``."""
    if n.domain not in ("", "ai.onnx") or n.op_type in ALWAYS_FLOAT32 or any(n.subgraphs()):
        return False
    floats = [v for v in list(n.inputs) + list(n.outputs)
              if v is not None and v.dtype == DType.FLOAT]
    if not floats and not (n.op_type in _DTYPE_ATTRS and _makes_float(n)):
        return False
    try:
        schema = onnx.defs.get_schema(n.op_type, m.opset)
    except onnx.defs.SchemaError:
        return False
    name = f"tensor({half.onnx_name})"
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    params = [(p.type_str, v) for p, v in zip(_formal(schema.inputs, len(n.inputs)), n.inputs)]
    params += [(p.type_str, v) for p, v in zip(_formal(schema.outputs, len(n.outputs)),
                                               n.outputs)]
    for type_str, v in params:
        if v is None or v.dtype != DType.FLOAT:
            continue
        if name not in allowed.get(type_str, {type_str}):
            return False
    return True


def _formal(params, count: int) -> list:
    """Formal parameters for ``count`` actual ones (the last repeats when variadic)."""
    out = list(params[:count])
    while len(out) < count and params:
        out.append(params[-1])
    return out


def _makes_float(n: Node) -> bool:
    out = n.outputs[0] if n.outputs else None
    return out is not None and out.dtype == DType.FLOAT


def _retype_attrs(n: Node, half: DType, clamped: list[str]) -> None:
    """Attributes that fix a float32 output dtype or hold float32 data, made half."""
    if n.op_type in ("Cast", "EyeLike"):
        key = _DTYPE_ATTRS[n.op_type]
        if n.attrs.get(key) == int(DType.FLOAT):
            n.attrs[key] = int(half)
    elif n.op_type in ("Constant", "ConstantOfShape"):
        val = n.attrs.get("value")
        if isinstance(val, np.ndarray) and val.dtype == np.float32:
            n.attrs["value"] = _to_half(val, half, n.name or n.outputs[0].name, clamped)


def _to_half(a: np.ndarray, half: DType, name: str, clamped: list[str]) -> np.ndarray:
    if half == DType.FLOAT16:
        finite = a[np.isfinite(a)]
        if finite.size and float(np.abs(finite).max()) > FP16_MAX:
            clamped.append(name)
            a = np.where(np.isfinite(a), np.clip(a, -FP16_MAX, FP16_MAX), a)
    return np.asarray(a, order="C").astype(half.numpy)


def _shape_path(m: Model) -> set[Node]:
    """Nodes that compute what another node reads on the host (shapes, sizes, scales)."""
    stack = host_read_inputs(m, m.graph)
    seen: set[Value] = set()
    path: set[Node] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        p = v.producer
        if p is None or p.op_type in SHAPE_ONLY or (v.shape is not None and len(v.shape) > 1):
            continue
        path.add(p)
        stack += [x for x in p.inputs if x is not None]
    return path


def _subgraph_feeders(m: Model) -> set[Node]:
    """Producers of values a subgraph reads from the enclosing graph: the body keeps its
    float32 types, so what it captures must too."""
    out: set[Node] = set()
    for n in m.graph.nodes:
        for sub in n.subgraphs():
            for v in sub.captures():
                if v.producer is not None:
                    out.add(v.producer)
    return out

