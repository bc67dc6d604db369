"""Constant folding: compute at optimization time every node whose inputs are all
constants, and store its outputs as initializers.

Three sources of constants: ``Constant`` nodes; nodes whose inputs are all initializers
(run through their NumPy kernel from the op registry, so folding computes exactly what the
runtime would); and small integer values whose elements shape inference knows
(``Shape`` of a tensor with fixed dims and everything computed from it). The last is what
makes a model with fixed input shapes lose its whole shape-computing subgraph. An ``If``
whose condition is constant is replaced by the branch it would take.

Not folded: random ops, ``DequantizeLinear`` (quantized weights stay small), nodes that
would turn small inputs into a large constant (an ``Expand`` to a big mask), overridable
initializers (a feed may change them), and ops Kiln has no kernel for.
"""

from __future__ import annotations

import logging

import numpy as np

from kiln.ir import DType, Graph, Model, Node, TensorType
from kiln.ops import registry
from kiln.passes import symdim
from kiln.passes.base import (
    Pass,
    PassRecord,
    adopt_const,
    const_value,
    graphs,
    make_const,
    rebuild,
    tensor_type,
)

log = logging.getLogger(__name__)

NONDETERMINISTIC = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike",
                              "RandomUniformLike", "Bernoulli", "Multinomial"})
NEVER_FOLD = NONDETERMINISTIC | {"DequantizeLinear", "DynamicQuantizeLinear"}
GROWTH_LIMIT_BYTES = 1 << 20
"""A folded output may exceed twice its inputs' size only up to this many bytes."""


class FoldConstants(Pass):
    """Replace constant-input nodes by the constants they compute."""

    name = "fold_constants"
    level = 1

    def run(self, model: Model, record: PassRecord) -> None:
        for g in list(graphs(model.graph)):
            fold_graph(g, model, record)


def fold_graph(g: Graph, model: Model, record: PassRecord) -> None:
    remove: set[Node] = set()
    insert: dict[Node, list[Node]] = {}
    for n in g.nodes:
        if n.domain == "" and n.op_type == "If":
            nodes = _inline_if(g, n)
            if nodes is not None:
                insert[n] = nodes
                remove.add(n)
                record.add("If with constant condition inlined")
            continue
        what = _fold_node(g, n, model)
        if what:
            remove.add(n)
            record.add(what)
    if remove:
        rebuild(g, remove, insert)


def _fold_node(g: Graph, n: Node, model: Model) -> str | None:
    outs = [v for v in n.outputs if v is not None]
    if not outs or any(v.const is not None for v in outs):
        return None
    if n.domain == "" and n.op_type == "Constant":
        arr = constant_array(n)
        if arr is None:
            return None
        make_const(outs[0], g, arr)
        return "Constant nodes to initializers"
    if n.domain == "" and n.op_type in NEVER_FOLD:
        return None
    known = _from_syms(n)
    if known is not None:
        for v, arr in zip(n.outputs, known):
            if v is not None:
                make_const(v, g, arr)
        return f"{n.op_type} folded (shape known)"
    if any(True for _ in n.subgraphs()):
        return None
    if any(v is not None and const_value(v) is None for v in n.inputs):
        return None
    if not n.inputs:
        return None
    results = run_kernel(n, model)
    if results is None:
        return None
    in_bytes = sum(v.const.nbytes for v in n.inputs if v is not None)
    out_bytes = sum(r.nbytes for r in results)
    if out_bytes > max(2 * in_bytes, GROWTH_LIMIT_BYTES):
        return None
    for v, arr in zip(n.outputs, results):
        if v is not None:
            make_const(v, g, arr)
    return f"{n.op_type} folded"


def run_kernel(n: Node, model: Model) -> list[np.ndarray] | None:
    """The node's outputs computed by its registered NumPy kernel (None if it has none,
    fails, or gives something other than one array per output of a sensible dtype)."""
    opset = model.opset_imports.get(n.domain, model.opset)
    d = registry.lookup(n.domain, n.op_type, opset)
    if d is None:
        return None
    args = [None if v is None else v.const for v in n.inputs]
    try:
        with np.errstate(all="ignore"):
            res = registry.evaluate(n, opset, args)
    except Exception as e:  # noqa: BLE001 - the runtime will raise it with context
        log.debug("folding %s failed: %s", n.op_type, e)
        return None
    out = []
    for v, r in zip(n.outputs, res + [None] * (len(n.outputs) - len(res))):
        if v is None:
            out.append(None)
            continue
        if isinstance(r, np.generic):
            r = np.asarray(r)
        if not isinstance(r, np.ndarray):
            return None
        want = tensor_type(v)
        if want is not None and want.dtype != DType.UNDEFINED and r.dtype != want.dtype.numpy:
            return None  # trust the runtime only where it agrees with the spec's type
        out.append(r)
    return out


def _from_syms(n: Node) -> list[np.ndarray] | None:
    """Outputs that are small integer tensors whose elements are all known."""
    out = []
    for v in n.outputs:
        if v is None:
            out.append(None)
            continue
        t = tensor_type(v)
        ints = symdim.known_ints(v.meta.get("sym"))
        if ints is None or t is None or t.shape is None or len(t.shape) > 1 or \
                t.dtype not in symdim.SYM_TYPES:
            return None
        arr = np.array(ints, dtype=t.dtype.numpy)
        if len(t.shape) == 0:
            if arr.size != 1:
                return None
            arr = arr.reshape(())
        elif t.shape[0] != arr.size and t.shape[0] is not None:
            return None
        out.append(arr)
    return out


def constant_array(n: Node) -> np.ndarray | None:
    """The value of a ``Constant`` node, from whichever attribute holds it."""
    a = n.attrs
    if isinstance(a.get("value"), np.ndarray):
        return a["value"]
    if isinstance(a.get("sparse_value"), np.ndarray):
        return a["sparse_value"]
    if "value_float" in a:
        return np.array(a["value_float"], np.float32)
    if "value_floats" in a:
        return np.array(a["value_floats"], np.float32).reshape(-1)
    if "value_int" in a:
        return np.array(a["value_int"], np.int64)
    if "value_ints" in a:
        return np.array(a["value_ints"], np.int64).reshape(-1)
    if "value_string" in a:
        return np.array(a["value_string"], dtype=object)
    if "value_strings" in a:
        return np.array(list(a["value_strings"]), dtype=object).reshape(-1)
    return None


def _inline_if(g: Graph, n: Node) -> list[Node] | None:
    """The nodes replacing an ``If`` whose condition is a constant: the taken branch's
    nodes, then an Identity per output (freezing removes those it can)."""
    cond = const_value(n.inputs[0]) if n.inputs else None
    if cond is None or cond.size != 1:
        return None
    branch = n.attrs.get("then_branch" if bool(cond.reshape(-1)[0]) else "else_branch")
    if not isinstance(branch, Graph) or branch.inputs:
        return None
    if any(v.meta.get("overridable") for v in branch.initializers.values()):
        return None
    for v in branch.initializers.values():
        adopt_const(g, v)
    nodes = list(branch.nodes)
    for out, src in zip(n.outputs, branch.outputs):
        if out is not None:
            nodes.append(Node("Identity", [src], [out], name=f"{n.name}_out"))
            if out.type is None and isinstance(src.type, TensorType):
                out.type = src.type
    return nodes
