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

from kiln.ir import Graph, Model, Node, Value
from kiln.passes import symdim
from kiln.passes.base import (
    Pass,
    PassRecord,
    Uses,
    add_const,
    bypass,
    const_value,
    fresh_value,
    graphs,
    producers,
    rank_of,
    rebuild,
    shape_of,
    tensor_type,
)


class Simplify(Pass):
    """Collapse transpose/reshape chains, constant-ize shape targets, MatMul+Add -> Gemm."""

    name = "simplify"
    level = 1

    def run(self, model: Model, record: PassRecord) -> None:
        for g in list(graphs(model.graph)):
            _Simplifier(g, model, record).run()


class _Simplifier:
    def __init__(self, g: Graph, model: Model, record: PassRecord):
        self.g, self.model, self.record = g, model, record
        self.opset = model.opset
        self.uses = Uses(g)
        self.prod = producers(g)
        self.remove: set[Node] = set()
        self.insert: dict[Node, list[Node]] = {}

    def run(self) -> None:
        for n in self.g.nodes:
            if n in self.remove or n.domain != "":
                continue
            fn = getattr(self, f"_{n.op_type.lower()}", None)
            if fn is not None:
                fn(n)
        if self.remove or self.insert:
            rebuild(self.g, self.remove, self.insert)

    # -- helpers
    def _single(self, v: Value | None, op_type: str, reader: Node) -> Node | None:
        """The producer of ``v`` if it is an ``op_type`` node read only by ``reader``."""
        if v is None:
            return None
        p = self.prod.get(v)
        if p is None or p.op_type != op_type or p.domain != "" or p in self.remove:
            return None
        return p if self.uses.only_reader(v, reader) else None

    def _producer(self, v: Value | None, *op_types: str) -> Node | None:
        p = self.prod.get(v) if v is not None else None
        if p is None or p.domain != "" or p.op_type not in op_types or p in self.remove:
            return None
        return p

    def _replace_input(self, n: Node, i: int, v: Value) -> None:
        n.inputs = [v if k == i else x for k, x in enumerate(n.inputs)]

    # -- Transpose chains
    def _transpose(self, n: Node) -> None:
        inner = self._producer(n.inputs[0], "Transpose")
        if inner is None:
            return
        rank = rank_of(inner.inputs[0])
        p1 = inner.attrs.get("perm") or (list(range(rank))[::-1] if rank else None)
        p2 = n.attrs.get("perm") or (list(range(len(p1)))[::-1] if p1 else None)
        if p1 is None or p2 is None or len(p1) != len(p2):
            return
        perm = [p1[j] for j in p2]
        src = inner.inputs[0]
        if perm == list(range(len(perm))) and bypass(self.g, src, n.outputs[0]):
            self.remove.add(n)
            self.record.add("Transpose pairs cancelled")
            return
        self._replace_input(n, 0, src)
        n.attrs["perm"] = perm
        self.record.add("Transpose chains merged")

    # -- Reshape chains and constant targets
    def _reshape(self, n: Node) -> None:
        if self._merge_reshape(n):
            return
        self._constant_target(n, "Reshape")

    def _merge_reshape(self, n: Node) -> bool:
        target = const_value(n.inputs[1]) if len(n.inputs) > 1 else None
        if target is None:
            return False
        if not n.attrs.get("allowzero", 0) and (target == 0).any():
            return False  # 0 copies a dim of the intermediate: not ours to drop
        inner = self._producer(n.inputs[0], "Reshape", "Flatten", "Squeeze", "Unsqueeze")
        if inner is None or inner.inputs[0] is None:
            return False
        self._replace_input(n, 0, inner.inputs[0])
        self.record.add(f"{inner.op_type} + Reshape merged")
        return True

    def _constant_target(self, n: Node, op: str) -> None:
        if len(n.inputs) < 2 or const_value(n.inputs[1]) is not None:
            return
        if op == "Reshape" and n.attrs.get("allowzero", 0):
            return
        src, out = shape_of(n.inputs[0]), shape_of(n.outputs[0])
        if src is None or out is None:
            return
        target = _reshape_target(src, out) if op == "Reshape" else _expand_target(src, out)
        if target is None:
            return
        c = add_const(self.g, f"{n.outputs[0].name}_shape", np.array(target, np.int64))
        self._replace_input(n, 1, c)
        self.record.add(f"{op} target made constant")

    def _expand(self, n: Node) -> None:
        self._constant_target(n, "Expand")

    # -- Squeeze / Unsqueeze pairs
    def _axes(self, n: Node) -> list[int] | None:
        if self.opset < 13:
            return n.attrs.get("axes")
        if len(n.inputs) < 2 or n.inputs[1] is None:
            return None
        return symdim.known_ints(symdim.sym_of(n.inputs[1]))

    def _squeeze(self, n: Node) -> None:
        self._cancel(n, "Unsqueeze")

    def _unsqueeze(self, n: Node) -> None:
        self._cancel(n, "Squeeze")

    def _cancel(self, n: Node, inverse: str) -> None:
        inner = self._producer(n.inputs[0], inverse)
        if inner is None:
            return
        # Normalize both against the rank of the unsqueezed side.
        wide = n.outputs[0] if n.op_type == "Unsqueeze" else n.inputs[0]
        rank = rank_of(wide)
        a, b = self._axes(inner), self._axes(n)
        if rank is None or a is None or b is None:
            return
        if sorted(x % rank for x in a) != sorted(x % rank for x in b):
            return
        if bypass(self.g, inner.inputs[0], n.outputs[0]):
            self.remove.add(n)
            self.record.add(f"{inverse} + {n.op_type} cancelled")

    # -- MatMul + Add -> Gemm; Reshape -> Gemm -> Reshape -> MatMul + Add
    def _add(self, n: Node) -> None:
        if self.opset < 7 or "axis" in n.attrs:
            return  # before opset 7, Add and Gemm broadcast only when told, and differently
        t = tensor_type(n.outputs[0])
        if t is None or not t.dtype.is_float:
            return
        for i in (0, 1):
            mm = self._single(n.inputs[i], "MatMul", n)
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
            gemm = Node("Gemm", [mm.inputs[0], mm.inputs[1], c], [n.outputs[0]],
                        name=n.name or mm.name)
            self.insert[n] = [gemm]
            self.remove.update({n, mm})
            self.record.add("MatMul + Add -> Gemm")
            return

    def _gemm(self, n: Node) -> None:
        """Reshape(x -> [P, K]) -> Gemm -> Reshape([..., N]) on an x of rank >= 3."""
        if n.attrs.get("transA", 0) or len(n.inputs) < 2 or self.opset < 7:
            return
        r1 = self._single(n.inputs[0], "Reshape", n)
        readers = self.uses.consumers(n.outputs[0])
        if r1 is None or len(readers) != 1 or self.uses.outputs[n.outputs[0]]:
            return
        r2 = readers[0]
        if r2.op_type != "Reshape" or r2.domain != "" or r2.inputs[0] is not n.outputs[0]:
            return
        x = r1.inputs[0]
        xs, ys, flat = shape_of(x), shape_of(r2.outputs[0]), shape_of(r1.outputs[0])
        b = const_value(n.inputs[1])
        if xs is None or ys is None or flat is None or len(ys) < 3 or b is None or \
                b.ndim != 2 or len(flat) != 2:
            return
        k, nn = (b.shape[1], b.shape[0]) if n.attrs.get("transB", 0) else b.shape
        lead = tuple(ys[:-1])
        if not symdim.same(ys[-1], nn) or not symdim.same(flat[1], k) or \
                not symdim.same(symdim.product(lead), flat[0]):
            return
        pre = None
        if not _same(xs, lead + (k,)):
            # x is not [lead..., K] (e.g. [b, s, heads, d]): one Reshape gets it there
            target = _reshape_target(xs, lead + (k,))
            if target is None:
                return
            tv = add_const(self.g, f"{x.name}_lead", np.array(target, np.int64))
            pre = Node("Reshape", [x, tv], [fresh_value(x, "lead")], name=r1.name)
            x = pre.outputs[0]
        c = n.inputs[2] if len(n.inputs) > 2 else None
        cv = const_value(c) if c is not None else None
        if c is not None and (cv is None or cv.size not in (1, nn) or
                              (cv.ndim == 2 and cv.shape[0] != 1)):
            return
        alpha, beta = n.attrs.get("alpha", 1.0), n.attrs.get("beta", 1.0)
        w = b.T if n.attrs.get("transB", 0) else b
        if alpha != 1.0:
            w = (w * alpha).astype(b.dtype)
        wv = add_const(self.g, f"{n.inputs[1].name}_mm", np.ascontiguousarray(w))
        out = r2.outputs[0]
        nodes = [pre] if pre is not None else []
        if cv is None:
            nodes.append(Node("MatMul", [x, wv], [out], name=n.name))
        else:
            bias = (cv.reshape(-1) * beta).astype(cv.dtype) if beta != 1.0 else cv.reshape(-1)
            bv = add_const(self.g, f"{c.name}_bias", bias)
            mid = fresh_value(out, "matmul", tensor_type(out))
            nodes.append(Node("MatMul", [x, wv], [mid], name=n.name))
            nodes.append(Node("Add", [mid, bv], [out], name=f"{n.name}_bias"))
        self.insert[r2] = nodes
        self.remove.update({r1, n, r2})
        self.record.add("Reshape + Gemm + Reshape -> MatMul + Add")


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
