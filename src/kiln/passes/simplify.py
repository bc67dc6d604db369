"""Algebraic simplification with standard ops (the result still runs on any ONNX runtime):

- ``Transpose(Transpose(x))`` becomes one Transpose (or nothing);
- a Reshape of a Reshape/Flatten/Squeeze/Unsqueeze reshapes the original directly;
- ``Squeeze`` of an ``Unsqueeze`` on the same axes, and the reverse, cancel;
- a Reshape (or Expand) whose target shape is *computed* (``Shape -> Gather -> Concat``)
  gets a constant target when symbolic shapes tell what it is, using 0 ("keep this dim")
  and -1 ("whatever is left"): ``[batch, seq, 12, 64]`` from ``[batch, seq, 768]`` is
  ``[0, 0, 12, 64]``. The shape-computing nodes then die;
- ``MatMul + Add`` on 2-D operands becomes ``Gemm``, and the Reshape -> Gemm -> Reshape
  sandwich exporters write for a linear layer on a 3-D input becomes ``MatMul + Add``.

Every rewrite reuses the final node's output value, so readers need no change.
"""

from __future__ import annotations

import numpy as np

from kiln.ir import Node, Value
from kiln.ops import symdim
from kiln.passes.base import (
    RulePass,
    const_value,
    fresh_value,
    rank_of,
    shape_of,
    tensor_type,
)
from kiln.passes.rewrite import (
    Rewriter,
    Rule,
    apply_plan,
    only_consumer,
    ops,
    producer,
    single_reader,
)


class Simplify(RulePass):
    """Collapse transpose/reshape chains, constant-ize shape targets, MatMul+Add -> Gemm."""

    name = "simplify"
    level = 1

    def rules(self) -> list[Rule]:
        return [Rule("transpose chain", ops("Transpose"), _transpose, apply_plan),
                Rule("reshape chain", ops("Reshape"), _merge_reshape, apply_plan),
                Rule("constant target", ops("Reshape", "Expand"), _constant_target,
                     apply_plan),
                Rule("squeeze pair", ops("Squeeze", "Unsqueeze"), _cancel, apply_plan),
                Rule("matmul + add", ops("Add"), _add, apply_plan),
                Rule("linear layer", ops("Gemm"), _gemm, apply_plan)]


# -- Transpose chains
def _transpose(rw: Rewriter, n: Node):
    inner = producer(n.inputs[0], n, "Transpose")
    if inner is None:
        return None
    rank = rank_of(inner.inputs[0])
    p1 = inner.attrs.get("perm") or (list(range(rank))[::-1] if rank else None)
    p2 = n.attrs.get("perm") or (list(range(len(p1)))[::-1] if p1 else None)
    if p1 is None or p2 is None or len(p1) != len(p2):
        return None
    perm = [p1[j] for j in p2]
    src = inner.inputs[0]
    if perm == list(range(len(perm))) and _can_bypass(src, n):
        def cancel(rw: Rewriter) -> bool:
            if not rw.bypass(src, n.outputs[0]):
                return False
            rw.remove(n)
            return True
        return "Transpose pairs cancelled", cancel

    def merge(rw: Rewriter) -> None:
        n.attrs["perm"] = perm
        rw.set_input(n, 0, src)
    return "Transpose chains merged", merge


# -- Reshape chains and constant targets
def _merge_reshape(rw: Rewriter, n: Node):
    target = const_value(n.inputs[1]) if len(n.inputs) > 1 else None
    if target is None:
        return None
    if not n.attrs.get("allowzero", 0) and (target == 0).any():
        return None  # 0 copies a dim of the intermediate: not ours to drop
    inner = producer(n.inputs[0], n, "Reshape", "Flatten", "Squeeze", "Unsqueeze")
    if inner is None or inner.inputs[0] is None:
        return None
    return f"{inner.op_type} + Reshape merged", lambda rw: rw.set_input(n, 0, inner.inputs[0])


def _constant_target(rw: Rewriter, n: Node):
    op = n.op_type
    if len(n.inputs) < 2 or const_value(n.inputs[1]) is not None:
        return None
    if op == "Reshape" and n.attrs.get("allowzero", 0):
        return None
    src, out = shape_of(n.inputs[0]), shape_of(n.outputs[0])
    if src is None or out is None:
        return None
    target = _reshape_target(src, out) if op == "Reshape" else _expand_target(src, out)
    if target is None:
        return None

    def do(rw: Rewriter) -> None:
        c = rw.add_const(n.graph, f"{n.outputs[0].name}_shape", np.array(target, np.int64))
        rw.set_input(n, 1, c)
    return f"{op} target made constant", do


# -- Squeeze / Unsqueeze pairs
def _axes(rw: Rewriter, n: Node) -> list[int] | None:
    if rw.model.opset < 13:
        return n.attrs.get("axes")
    if len(n.inputs) < 2 or n.inputs[1] is None:
        return None
    return symdim.known_ints(symdim.sym_of(n.inputs[1]))


def _cancel(rw: Rewriter, n: Node):
    inverse = "Unsqueeze" if n.op_type == "Squeeze" else "Squeeze"
    inner = producer(n.inputs[0], n, inverse)
    if inner is None:
        return None
    # Normalize both against the rank of the unsqueezed side.
    wide = n.outputs[0] if n.op_type == "Unsqueeze" else n.inputs[0]
    rank = rank_of(wide)
    a, b = _axes(rw, inner), _axes(rw, n)
    if rank is None or a is None or b is None:
        return None
    if sorted(x % rank for x in a) != sorted(x % rank for x in b):
        return None

    def do(rw: Rewriter) -> bool:
        if not rw.bypass(inner.inputs[0], n.outputs[0]):
            return False
        rw.remove(n)
        return True
    return f"{inverse} + {n.op_type} cancelled", do


# -- MatMul + Add -> Gemm; Reshape -> Gemm -> Reshape -> MatMul + Add
def _add(rw: Rewriter, n: Node):
    # A plain producer test turns nearly every Add away at a third of single_reader's cost
    if not any(v is not None and v.producer is not None and v.producer.op_type == "MatMul"
               for v in n.inputs):
        return None
    if rw.model.opset < 7 or "axis" in n.attrs:
        return None  # before opset 7, Add and Gemm broadcast only when told, and differently
    t = tensor_type(n.outputs[0])
    if t is None or not t.dtype.is_float:
        return None
    for i in (0, 1):
        mm = single_reader(n.inputs[i], n, "MatMul")
        c = n.inputs[1 - i]
        if mm is None or const_value(c) is None or mm.inputs[1] is None:
            continue
        if rank_of(mm.inputs[0]) != 2 or rank_of(mm.inputs[1]) != 2:
            continue
        out = shape_of(mm.outputs[0])
        if out is None or len(out) != 2 or not _gemm_bias_ok(const_value(c).shape, out):
            continue
        if not _same(shape_of(n.outputs[0]), out):
            continue
        gemm = Node("Gemm", [mm.inputs[0], mm.inputs[1], c], [None], name=n.name or mm.name)

        def do(rw: Rewriter, gemm=gemm, mm=mm) -> None:
            gemm.outputs = [n.outputs[0]]
            rw.replace([mm, n], [gemm])
        return "MatMul + Add -> Gemm", do
    return None


def _gemm(rw: Rewriter, n: Node):
    """Reshape(x -> [P, K]) -> Gemm -> Reshape([..., N]) on an x of rank >= 3."""
    if n.attrs.get("transA", 0) or len(n.inputs) < 2 or rw.model.opset < 7:
        return None
    r1 = single_reader(n.inputs[0], n, "Reshape")
    r2 = only_consumer(n.outputs[0], "Reshape")
    if r1 is None or r2 is None or r2.inputs[0] is not n.outputs[0]:
        return None
    x = r1.inputs[0]
    xs, ys, flat = shape_of(x), shape_of(r2.outputs[0]), shape_of(r1.outputs[0])
    b = const_value(n.inputs[1])
    if xs is None or ys is None or flat is None or len(ys) < 3 or b is None or \
            b.ndim != 2 or len(flat) != 2:
        return None
    k, nn = (b.shape[1], b.shape[0]) if n.attrs.get("transB", 0) else b.shape
    lead = tuple(ys[:-1])
    if not symdim.same(ys[-1], nn) or not symdim.same(flat[1], k) or \
            not symdim.same(symdim.product(lead), flat[0]):
        return None
    target = None
    if not _same(xs, lead + (k,)):
        # x is not [lead..., K] (e.g. [b, s, heads, d]): one Reshape gets it there
        target = _reshape_target(xs, lead + (k,))
        if target is None:
            return None
    c = n.inputs[2] if len(n.inputs) > 2 else None
    cv = const_value(c) if c is not None else None
    if c is not None and (cv is None or cv.size not in (1, nn) or
                          (cv.ndim == 2 and cv.shape[0] != 1)):
        return None

    def do(rw: Rewriter) -> None:
        g, src = n.graph, x
        nodes = []
        if target is not None:
            tv = rw.add_const(g, f"{x.name}_lead", np.array(target, np.int64))
            nodes.append(Node("Reshape", [x, tv], [fresh_value(x, "lead")], name=r1.name))
            src = nodes[0].outputs[0]
        alpha, beta = n.attrs.get("alpha", 1.0), n.attrs.get("beta", 1.0)
        w = b.T if n.attrs.get("transB", 0) else b
        if alpha != 1.0:
            w = (w * alpha).astype(b.dtype)
        wv = rw.add_const(g, f"{n.inputs[1].name}_mm", np.ascontiguousarray(w))
        out = r2.outputs[0]
        if cv is None:
            nodes.append(Node("MatMul", [src, wv], [None], name=n.name))
            nodes[-1].outputs = [out]
        else:
            bias = (cv.reshape(-1) * beta).astype(cv.dtype) if beta != 1.0 else cv.reshape(-1)
            bv = rw.add_const(g, f"{c.name}_bias", bias)
            mid = fresh_value(out, "matmul", tensor_type(out))
            nodes.append(Node("MatMul", [src, wv], [mid], name=n.name))
            nodes.append(Node("Add", [mid, bv], [None], name=f"{n.name}_bias"))
            nodes[-1].outputs = [out]
        rw.replace([r1, n, r2], nodes)
    return "Reshape + Gemm + Reshape -> MatMul + Add", do


def _can_bypass(src: Value, n: Node) -> bool:
    """Whether ``n``'s output can be replaced by ``src`` (see ``Rewriter.bypass``)."""
    dst, g = n.outputs[0], n.graph
    if not dst.is_output_of(g):
        return True
    p = src.producer
    return p is not None and p.graph is g and not src.is_output_of(g)


def _same(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and \
        all(symdim.same(x, y) for x, y in zip(a, b))


def _gemm_bias_ok(c_shape: tuple, out: tuple) -> bool:
    """``c_shape`` broadcasts one way to the [M, N] output ``out``."""
    if len(c_shape) > 2:
        return False
    pad = (1,) * (2 - len(c_shape)) + tuple(c_shape)
    return all(c == 1 or symdim.same(c, o) for c, o in zip(pad, out))


def _reshape_target(src, out) -> list[int] | None:
    """A constant Reshape target giving ``out`` from ``src`` (0: copy, -1: infer)."""
    target, infer = [], 0
    for i, d in enumerate(out):
        if isinstance(d, int):
            if d == 0:
                return None  # a literal 0 would read as "copy"
            target.append(d)
        elif i < len(src) and symdim.same(src[i], d):
            target.append(0)
        else:
            target.append(-1)
            infer += 1
    return target if infer <= 1 else None


def _expand_target(src, out) -> list[int] | None:
    """A constant Expand target giving ``out`` from ``src`` (1: keep the input's dim)."""
    if len(out) < len(src):
        return None
    src = (1,) * (len(out) - len(src)) + tuple(src)
    target = []
    for s, d in zip(src, out):
        if symdim.same(s, d):
            target.append(1)
        elif isinstance(d, int) and s == 1:
            target.append(d)
        else:
            return None
    return target
