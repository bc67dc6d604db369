"""Constant folding: compute at optimization time every node whose inputs are all
constants, and store its outputs as initializers.

Three sources of constants: ``Constant`` nodes; nodes whose inputs are all initializers
(run through their NumPy kernel from the op registry, so folding computes exactly what the
runtime would); and small integer values whose elements shape inference knows
(``Shape`` of a tensor with fixed dims and everything computed from it). The last is what
makes a model with fixed input shapes lose its whole shape-computing subgraph. An ``If``
whose condition is constant is replaced by the branch it would take.

Not folded: non-deterministic ops (``OpDef.deterministic``), ``DequantizeLinear``
(quantized weights stay small), nodes that would turn small inputs into a large constant (an
``Expand`` to a big mask), overridable initializers (a feed may change them), nodes holding
subgraphs (but see ``If``) and ops Kiln has no kernel for. Kernels run through
:func:`kiln.ops.registry.evaluate`, the ops layer's own entry point.

Each is a rule: folding a node queues its readers, which may now have constant inputs.
"""

from __future__ import annotations

import logging

import numpy as np

from kiln.ir import DType, Graph, Node, TensorType
from kiln.ops import registry, symdim
from kiln.passes.base import RulePass, adopt_const, const_value, tensor_type
from kiln.passes.rewrite import Rewriter, Rule, ops

log = logging.getLogger(__name__)

NEVER_FOLD = frozenset({"DequantizeLinear", "DynamicQuantizeLinear"})
GROWTH_LIMIT_BYTES = 1 << 20
"""A folded output may exceed twice its inputs' size only up to this many bytes. Checked
against the inferred output shapes before the kernel runs, so a 10^9-element
ConstantOfShape is never built; set this module attribute to allow bigger folds."""


class FoldConstants(RulePass):
    """Replace constant-input nodes by the constants they compute."""

    name = "fold_constants"
    level = 1

    def rules(self) -> list[Rule]:
        return [Rule("Constant node", ops("Constant"), _match_constant_node, _apply_fold,
                     needs_types=False),
                Rule("If with constant condition", ops("If"), _match_if, _inline_if),
                Rule("fold", None, _match_fold, _apply_fold, _check_fold)]


def _fresh_outputs(n: Node) -> list:
    outs = [v for v in n.outputs if v is not None]
    return outs if outs and all(v.const is None for v in outs) else []


def _match_constant_node(rw: Rewriter, n: Node):
    outs = _fresh_outputs(n)
    arr = constant_array(n) if outs else None
    return None if arr is None else (n, [arr], "Constant nodes to initializers", 0)


def _foldable(rw: Rewriter, n: Node) -> bool:
    if n.domain == "" and (n.op_type in NEVER_FOLD or n.op_type == "Constant"):
        return False
    d = registry.lookup(n.domain, n.op_type, rw.opset(n))
    return d is None or d.deterministic


def _match_fold(rw: Rewriter, n: Node):
    """(node, output arrays, label, input bytes) when every output is known."""
    outs = _fresh_outputs(n)
    if not outs:
        return None
    # The cheap tests that turn nearly every node away come before the registry lookup.
    if all(v.meta.get("sym") is not None for v in outs):
        known = _from_syms(n) if _foldable(rw, n) else None
        if known is not None:
            return n, known, f"{n.op_type} folded (shape known)", None
    if not n.inputs or any(v is not None and const_value(v) is None for v in n.inputs):
        return None
    if any(True for _ in n.subgraphs()) or not _foldable(rw, n):
        return None
    if not any(v.num_uses for v in n.outputs if v is not None):
        return None  # nothing reads it: dead-code elimination takes it, unbuilt
    in_bytes = sum(v.const.nbytes for v in n.inputs if v is not None)
    if _too_big(_predicted_bytes(n), in_bytes):
        return n, None, f"{n.op_type} folded", in_bytes  # declined by _check_fold, unrun
    results = run_kernel(n, rw.opset(n))
    if results is None:
        return None
    return n, results, f"{n.op_type} folded", in_bytes


def _predicted_bytes(n: Node) -> int | None:
    """Size of the node's outputs from their inferred types (None if any is unknown)."""
    total = 0
    for v in n.outputs:
        t = tensor_type(v) if v is not None else None
        if v is None:
            continue
        if t is None or t.shape is None or t.dtype == DType.UNDEFINED or \
                not all(isinstance(d, int) for d in t.shape):
            return None
        total += int(np.prod(t.shape, dtype=object)) * t.dtype.numpy.itemsize
    return total


def _too_big(out_bytes: int | None, in_bytes: int) -> bool:
    return out_bytes is not None and out_bytes > max(2 * in_bytes, GROWTH_LIMIT_BYTES)


def _check_fold(rw: Rewriter, m) -> str | None:
    _, results, _, in_bytes = m
    if in_bytes is None:
        return None
    if results is None or _too_big(sum(r.nbytes for r in results if r is not None), in_bytes):
        return "the constant would be large and much bigger than its inputs"
    return None


def _apply_fold(rw: Rewriter, m) -> str:
    n, results, label, _ = m
    for v, arr in zip([v for v in n.outputs if v is not None] if label.startswith("Constant")
                      else n.outputs, results):
        if v is not None:
            rw.make_const(v, arr)
    rw.remove(n)
    return label


def run_kernel(n: Node, opset: int) -> list[np.ndarray] | None:
    """The node's outputs computed by its NumPy kernel (None if it has none, fails, or
    gives something other than one array per output of the dtype the spec says)."""
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
            return None  # trust the kernel only where it agrees with the spec's type
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


def _match_if(rw: Rewriter, n: Node):
    """The branch an ``If`` with a constant condition takes."""
    cond = const_value(n.inputs[0]) if n.inputs else None
    if cond is None or cond.size != 1:
        return None
    branch = n.attrs.get("then_branch" if bool(cond.reshape(-1)[0]) else "else_branch")
    if not isinstance(branch, Graph) or branch.inputs:
        return None
    if any(v.meta.get("overridable") for v in branch.initializers.values()):
        return None
    return n, branch


def _inline_if(rw: Rewriter, m) -> str:
    """Move the taken branch's nodes before the ``If``, then an Identity per output
    (freezing removes those it can), and drop the ``If``."""
    n, branch = m
    g = n.graph
    for v in branch.initializers.values():
        adopt_const(g, v)
    nodes = list(branch.nodes)
    for x in nodes:
        branch.remove_node(x)
    for i, (out, src) in enumerate(zip(n.outputs, branch.outputs)):
        if out is not None:
            # one name per node: onnxruntime refuses a graph where two share one (silero's
            # VAD, an If of two outputs inside an If)
            nodes.append(Node("Identity", [src], [out], name=f"{n.name}_out{i or ''}"))
            if out.type is None and isinstance(src.type, TensorType):
                out.type = src.type
    rw.replace([n], nodes)
    return "If with constant condition inlined"
