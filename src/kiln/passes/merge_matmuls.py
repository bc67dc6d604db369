"""Merge products of one input by several constant weights into one wider product:

    MatMul(x, Wq) + bq, MatMul(x, Wk) + bk, MatMul(x, Wv) + bv
        -> Split(FusedMatMul(x, [Wq Wk Wv], [bq bk bv]), [nq, nk, nv], axis=-1)

Transformer layers project the same hidden state three times (query, key, value). One
GEMM three times as wide keeps the machine busier than three small ones and pays one
call's fixed cost instead of three; onnxruntime does the same inside its attention
fusion. The Split's outputs are views of the wide product on both backends.

Runs after the activation fusion (its own stage), so each product's bias and activation
are already part of it. Products merge when they read the same ``x`` as their first
input, have constant 2-D float weights of ``x``'s type, constant 1-D biases or none (a
missing one becomes zeros), no residual input, and the same activation.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Node, Value
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import RulePass, const_value, dtype_of, fresh_value, shape_of
from kiln.passes.rewrite import Rewriter, Rule, ops

_ACT_ATTRS = ("activation", "activation_params")


class MergeMatMuls(RulePass):
    """Sibling MatMul/FusedMatMul nodes on one input -> one FusedMatMul + Split."""

    name = "merge_matmuls"
    level = 2
    stage = 4
    creates = ("FusedMatMul",)

    def rules(self) -> list[Rule]:
        return [Rule("siblings", ops("MatMul") | ops("FusedMatMul", domain=KILN_DOMAIN),
                     _match, _apply)]


def _product(n: Node, x: Value):
    """(weight, bias or None, activation attributes) of a product of ``x`` that can
    merge, else None."""
    if (n.domain, n.op_type) not in (("", "MatMul"), (KILN_DOMAIN, "FusedMatMul")):
        return None
    ins = n.inputs
    if ins[0] is not x or ins[1] is x or (len(ins) > 3 and ins[3] is not None):
        return None
    w = const_value(ins[1])
    if w is None or w.ndim != 2 or w.dtype.kind != "f" or dtype_of(ins[1]) != dtype_of(x):
        return None
    b = const_value(ins[2]) if len(ins) > 2 and ins[2] is not None else None
    if len(ins) > 2 and ins[2] is not None and (b is None or b.shape != w.shape[1:]
                                                 or b.dtype != w.dtype):
        return None
    return w, b, tuple((k, repr(n.attrs.get(k))) for k in _ACT_ATTRS)


def _match(rw: Rewriter, root: Node) -> tuple[list[Node], list] | None:
    """(the products to merge, in graph order; their (weight, bias, activation))."""
    x = root.inputs[0] if root.inputs else None
    shape = shape_of(x)
    if shape is None or len(shape) < 2:
        return None
    mine = _product(root, x)
    if mine is None:
        return None
    group, parts = [], []
    for n in dict.fromkeys(x.consumers()):
        p = _product(n, x) if n.graph is root.graph else None
        if p is not None and p[0].shape[0] == mine[0].shape[0] and p[2] == mine[2]:
            group.append(n)
            parts.append(p)
    if len(group) < 2:
        return None
    order = sorted(range(len(group)), key=lambda i: rw.order.get(group[i], 0))
    return [group[i] for i in order], [parts[i] for i in order]


def _apply(rw: Rewriter, m) -> str:
    nodes, parts = m
    first = nodes[0]
    g, x, base = first.graph, first.inputs[0], first.name or "merged"
    widths = [w.shape[1] for w, _, _ in parts]
    w = rw.add_const(g, f"{base}_weights", np.concatenate([w for w, _, _ in parts], axis=1))
    ins = [x, w]
    if any(b is not None for _, b, _ in parts):
        ins.append(rw.add_const(g, f"{base}_bias", np.concatenate(
            [b if b is not None else np.zeros(wi, p.dtype)
             for (p, b, _), wi in zip(parts, widths)])))
    attrs = {k: first.attrs[k] for k in _ACT_ATTRS if k in first.attrs}
    y = fresh_value(first.outputs[0], "merged")
    if len(ins) == 2 and not attrs:
        wide = Node("MatMul", ins, [y], name=first.name)
    else:
        wide = Node("FusedMatMul", ins, [y], attrs, domain=KILN_DOMAIN, name=first.name)
    outs = [n.outputs[0] for n in nodes]
    if rw.model.opset_of("") >= 13:
        sizes = rw.add_const(g, f"{base}_split", np.array(widths, np.int64))
        split = Node("Split", [y, sizes], outs, {"axis": -1}, name=f"{base}/Split")
    else:
        split = Node("Split", [y], outs, {"axis": -1, "split": widths}, name=f"{base}/Split")
    # x and the constants are defined before the first product, which precedes every
    # product's readers
    rw.insert_before(first, [wide, split])
    rw.remove(*nodes)
    return f"{len(nodes)} products of one input -> one FusedMatMul + Split"
