"""Shape and type inference: give every value of the model (subgraphs included) a dtype
and a shape as precise as the inputs allow, with symbolic dims.

Per node: the op's own inference (``OpDef.infer``: Kiln's fused ops, custom ops, and for
standard ops the symbolic rules of :mod:`kiln.ops.shape_rules` — Reshape, Concat,
Flatten... whose dims are arithmetic on symbols), merged over ONNX's per-node inference
(``onnx.shape_inference.infer_node_outputs``) for standard ops. Small integer tensors also
get their symbolic *value* (``Value.meta["sym"]``), which is what lets a
``Shape -> Gather -> Concat -> Reshape`` chain give ``batch*12`` and not an unknown dim.
If/Loop/Scan bodies are inferred from the types their node feeds them.

Types only ever get more precise: an inferred dim replaces an unknown one, ints beat
symbols, and a name the model itself declared beats a generated one.
"""

from __future__ import annotations

import functools
import inspect
import logging

import numpy as np

from kiln.ir import DType, Graph, Model, Node, SequenceType, TensorType, Value
from kiln.onnxio import rules
from kiln.onnxio.infer import onnx_infer
from kiln.ops import registry, symdim
from kiln.ops.symdim import InferContext, merge_dim
from kiln.passes.core import Pass, PassRecord, const_value, graphs

log = logging.getLogger(__name__)


class InferShapes(Pass):
    """Annotate every value with its TensorType (dtype + symbolic shape)."""

    name = "infer_shapes"
    level = 1
    analysis = True

    def run(self, model: Model, record: PassRecord) -> None:
        record.add("values typed", infer_graph(model.graph, model))


def infer_model(model: Model) -> int:
    """Run inference over the whole model; returns how many value types got refined."""
    return infer_graph(model.graph, model)


def infer_graph(g: Graph, model: Model) -> int:
    changed = 0
    for n in g.nodes:
        changed += infer_node(n, model)
    return changed


def infer_node(n: Node, model: Model) -> int:
    """Infer ``n``'s output types (and nested graphs); returns how many got refined."""
    opset = model.opset_of(n.domain)
    changed = 0
    # Axes the importer could not check (their input's rank was unknown there) are checked
    # on the inferred ranks before any rule or ONNX's C++ inference reads them.
    if n.op_type in rules.RANKED:
        rules.check_axes(n.op_type, n.domain, n.attrs, [_shape(v) for v in n.inputs], n,
                         opset)
    rules.check_types(n.op_type, n.domain, opset,
                      [v.type if v is not None else None for v in n.inputs], n)
    ctx = InferContext(n, opset)
    if any(True for _ in n.subgraphs()):
        types, changed = _control_flow(n, model)
    else:
        types = node_types(n, opset, model, ctx)
    for v, t in zip(n.outputs, types):
        if v is None:
            continue
        merged = merge_type(v.type, t)
        if merged != v.type:
            v.type = merged
            changed += 1
    for i, v in enumerate(n.outputs):
        if v is None:
            continue
        s = ctx.out_syms.get(i)
        if s is not None and _small_int(v):
            v.meta["sym"] = s
        else:
            v.meta.pop("sym", None)
    return changed


def _shape(v: Value | None) -> tuple | None:
    t = v.type if v is not None else None
    return t.shape if isinstance(t, TensorType) else None


def settled(n: Node) -> bool:
    """Whether inference has nothing left to learn about ``n``'s outputs: each has a dtype
    and int dims, and a shape-sized integer one also has known contents. Rewrites keep
    what values compute, so such a node's types stay right whatever its inputs become."""
    for v in n.outputs:
        if v is None:
            continue
        t = v.type
        if not isinstance(t, TensorType) or t.dtype == DType.UNDEFINED or t.shape is None \
                or not all(d.__class__ is int for d in t.shape):
            return False
        if _small_int(v) and symdim.known_ints(v.meta.get("sym")) is None:
            return False
    return True


def _small_int(v: Value) -> bool:
    t = v.type
    return isinstance(t, TensorType) and t.dtype in symdim.SYM_TYPES and \
        (t.shape is None or len(t.shape) <= 1)


def node_types(n: Node, opset: int, model: Model, ctx: InferContext | None = None) -> list:
    """Output types of one node without subgraphs (None where unknown). The symbolic
    values the op's rule finds are left in ``ctx.out_syms``.

    The op's own rule goes first and has the deciding word; ONNX's per-node inference
    (most of what optimizing a long chain costs) runs only when the
    rule left an output's dtype or a dim unknown."""
    out: list = [None] * len(n.outputs)
    opdef = registry.lookup(n.domain, n.op_type, opset)
    ctx = ctx or InferContext(n, opset)
    if opdef is not None and opdef.infer is not None:
        try:
            mine = _call_rule(opdef.infer, n, ctx)
        except Exception as e:  # noqa: BLE001 - inference must never stop a model loading
            log.debug("shape rule for %s failed: %s", n.op_type, e)
            mine = None
        if mine is not None:
            mine = list(mine) if isinstance(mine, (list, tuple)) else [mine]
            out = _merge_lists(mine + [None] * (len(out) - len(mine)), out)
    if n.domain in _ONNX_DOMAINS and not _complete(n, out):
        out = _merge_lists(out, onnx_infer(n, opset, model.opset_imports, _data_of))
    return out


_ONNX_DOMAINS = ("", "ai.onnx.ml", "ai.onnx.preview.training")


def _complete(n: Node, types: list) -> bool:
    """Whether every output the node has is a tensor of known dtype and dims."""
    for v, t in zip(n.outputs, types):
        if v is None:
            continue
        if not isinstance(t, TensorType) or t.dtype == DType.UNDEFINED or t.shape is None \
                or any(d is None for d in t.shape):
            return False
    return True


def _merge_lists(first: list, second: list) -> list:
    return [merge_type(a, b) for a, b in zip(first, second)]


@functools.cache
def _signature(fn):
    params = list(inspect.signature(fn).parameters.values())
    wants_ctx = bool(params) and params[0].name == "ctx"
    keys = {p.name for p in params if p.kind == p.KEYWORD_ONLY}
    any_kw = any(p.kind == p.VAR_KEYWORD for p in params)
    return wants_ctx, keys, any_kw


def _call_rule(fn, n: Node, ctx: InferContext):
    wants_ctx, keys, any_kw = _signature(fn)
    if wants_ctx:
        return fn(ctx)
    types = [v.type if v is not None else None for v in n.inputs]
    attrs = {k: a for k, a in n.attrs.items() if any_kw or k in keys}
    return fn(*types, **attrs)


# ---------------------------------------------------------------- ONNX's per-node inference

def _data_of(v: Value) -> np.ndarray | None:
    """Small integer contents ONNX's data-dependent inference (Reshape, Expand...) can use."""

    c = const_value(v)
    if c is not None:
        return c if c.dtype.kind in "iu" and c.size <= symdim.MAX_SYM_LEN else None
    s = symdim.known_ints(v.meta.get("sym"))
    t = v.type
    if s is None or not isinstance(t, TensorType) or t.shape is None or len(t.shape) > 1:
        return None
    arr = np.array(s, dtype=t.dtype.numpy)
    return arr.reshape(()) if len(t.shape) == 0 and arr.size == 1 else arr


# ---------------------------------------------------------------- merging what is known

def merge_type(old, new):
    """The more precise of two types of one value."""
    if new is None:
        return old
    if old is None:
        return new
    if isinstance(old, TensorType) and isinstance(new, TensorType):
        dtype = old.dtype if old.dtype != DType.UNDEFINED else new.dtype
        if old.shape is None:
            shape = new.shape
        elif new.shape is None:
            shape = old.shape
        elif len(old.shape) != len(new.shape):
            shape = new.shape  # a stale declaration: what the ops compute wins
        else:
            shape = tuple(merge_dim(a, b) for a, b in zip(old.shape, new.shape))
        return TensorType(dtype, shape)
    if type(old) is type(new) and hasattr(old, "elem"):
        return type(old)(merge_type(old.elem, new.elem))
    return old


# ---------------------------------------------------------------- If / Loop / Scan

def _control_flow(n: Node, model: Model) -> tuple[list, int]:
    changed = 0
    op = n.op_type if n.domain == "" else ""
    if op == "Loop":
        body = n.attrs.get("body")
        if isinstance(body, Graph):
            _set_input(body, 0, TensorType(DType.INT64, ()))
            _set_input(body, 1, TensorType(DType.BOOL, ()))
            for i, v in enumerate(n.inputs[2:]):
                _set_input(body, 2 + i, _loose(v.type if v is not None else None))
    elif op == "Scan" and model.opset >= 9:
        body = n.attrs.get("body")
        if isinstance(body, Graph):
            n_scan = n.attrs.get("num_scan_inputs", 0)
            n_state = len(n.inputs) - n_scan
            axes = n.attrs.get("scan_input_axes") or [0] * n_scan
            for i, v in enumerate(n.inputs):
                t = v.type if v is not None else None
                if i < n_state:
                    _set_input(body, i, _loose(t))
                elif isinstance(t, TensorType) and t.shape is not None:
                    ax = axes[i - n_state]
                    ax = ax + len(t.shape) if ax < 0 else ax
                    _set_input(body, i, TensorType(t.dtype, t.shape[:ax] + t.shape[ax + 1:]))
    for sub in n.subgraphs():
        changed += infer_graph(sub, model)
    types: list = [None] * len(n.outputs)
    if op == "If":
        a, b = n.attrs.get("then_branch"), n.attrs.get("else_branch")
        if isinstance(a, Graph) and isinstance(b, Graph):
            types = [_join(x.type, y.type) for x, y in zip(a.outputs, b.outputs)]
    elif op == "Loop" and isinstance(n.attrs.get("body"), Graph):
        body = n.attrs["body"]
        n_carried = len(n.inputs) - 2
        outs = [v.type for v in body.outputs[1:]]
        for i in range(min(len(n.outputs), len(outs))):
            t = outs[i]
            if i < n_carried:
                init = n.inputs[2 + i].type if n.inputs[2 + i] is not None else None
                types[i] = _join(t, init)
            elif isinstance(t, TensorType) and t.shape is not None:
                types[i] = TensorType(t.dtype, (None,) + tuple(t.shape))
            elif isinstance(t, TensorType):
                types[i] = TensorType(t.dtype)
    elif op == "Scan" and model.opset >= 9 and isinstance(n.attrs.get("body"), Graph):
        body = n.attrs["body"]
        n_scan = n.attrs.get("num_scan_inputs", 0)
        n_state = len(n.inputs) - n_scan
        out_axes = n.attrs.get("scan_output_axes") or [0] * (len(n.outputs) - n_state)
        length = _scan_length(n, n_state)
        for i, v in enumerate(body.outputs[:len(n.outputs)]):
            t = v.type
            if i < n_state:
                types[i] = _join(t, n.inputs[i].type if n.inputs[i] is not None else None)
            elif isinstance(t, TensorType) and t.shape is not None:
                ax = out_axes[i - n_state]
                ax = ax + len(t.shape) + 1 if ax < 0 else ax
                types[i] = TensorType(t.dtype, t.shape[:ax] + (length,) + t.shape[ax:])
    return types, changed


def _scan_length(n: Node, n_state: int):
    axes = n.attrs.get("scan_input_axes") or [0] * (len(n.inputs) - n_state)
    for v, ax in zip(n.inputs[n_state:], axes):
        t = v.type if v is not None else None
        if isinstance(t, TensorType) and t.shape is not None:
            return t.shape[ax]
    return None


def _set_input(g: Graph, i: int, t) -> None:
    if i < len(g.inputs) and t is not None:
        g.inputs[i].type = merge_type(g.inputs[i].type, t)


def _loose(t):
    """A loop-carried value's type: its dtype and rank may not change, its dims may."""
    if isinstance(t, TensorType):
        return TensorType(t.dtype, None if t.shape is None else (None,) * len(t.shape))
    return t


def _join(a, b):
    """What is true of a value that is either of type ``a`` or of type ``b``."""
    if a is None or b is None:
        return None
    if isinstance(a, TensorType) and isinstance(b, TensorType):
        if a.dtype != b.dtype:
            return None
        if a.shape is None or b.shape is None or len(a.shape) != len(b.shape):
            return TensorType(a.dtype)
        return TensorType(a.dtype, tuple(x if symdim.same(x, y) else None
                                         for x, y in zip(a.shape, b.shape)))
    if isinstance(a, SequenceType) and isinstance(b, SequenceType):
        return SequenceType(_join(a.elem, b.elem))
    return a if a == b else None


def clear_syms(model: Model) -> None:
    """Forget symbolic values (after input shapes change)."""
    for g in graphs(model.graph):
        for n in g.nodes:
            for v in n.outputs:
                if v is not None:
                    v.meta.pop("sym", None)
