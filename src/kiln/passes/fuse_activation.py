"""Fuse Conv / Gemm / MatMul with what follows them into one Kiln op:

    Conv   [+ Add(bias)] [+ Add(residual)] [+ activation]  -> ai.kiln.FusedConv
    Gemm   [+ Add(bias)] [+ activation]                    -> ai.kiln.FusedGemm
    MatMul [+ Add(bias)] [+ Add(residual)] [+ activation]  -> ai.kiln.FusedMatMul

Activations: Relu, LeakyRelu, Clip (Relu6), Sigmoid, HardSigmoid, HardSwish (the op,
``x * HardSigmoid(x)``, or ``x * Clip(x + 3, 0, 6) / 6``), SiLU (``x * Sigmoid(x)``), GELU
(ONNX's ``Gelu`` or Kiln's, which the GELU pass makes from the decomposed forms), Tanh.

The fused kernel applies the bias, residual (a same-shape tensor added after the bias, as
in ResNet blocks and transformer layers) and activation in place on the fresh output of the
convolution or product: one buffer instead of one per op. A Conv followed only by a
constant bias Add just gets that bias folded into its own ``B`` (no Kiln op needed).
Every intermediate must be read by the next op of the chain alone.
"""

from __future__ import annotations

import math

import numpy as np

from kiln.ir import Node, Value
from kiln.ops import symdim
from kiln.ops.fused import ACTIVATIONS
from kiln.ops.registry import KILN_DOMAIN, lookup
from kiln.passes.base import RulePass, const_value, dtype_of, scalar_value, shape_of
from kiln.passes.rewrite import Rewriter, Rule, ops

_FUSED = {"Conv": "FusedConv", "Gemm": "FusedGemm", "MatMul": "FusedMatMul"}
_CONV_ATTRS = ("auto_pad", "dilations", "group", "kernel_shape", "pads", "strides")
_GEMM_ATTRS = ("alpha", "beta", "transA", "transB")


class FuseActivation(RulePass):
    """Conv/Gemm/MatMul + bias + residual + activation -> one fused Kiln op."""

    name = "fuse_activation"
    level = 2
    stage = 3
    creates = ("FusedConv", "FusedGemm", "FusedMatMul")

    def rules(self) -> list[Rule]:
        roots = ops(*_FUSED) | ops(*_FUSED.values(), domain=KILN_DOMAIN)
        return [Rule("activation", roots, _match, _apply, _check)]


class _Const:
    """A constant the fusion will add (only once it is applied: matching has no effects)."""

    def __init__(self, name: str, array: np.ndarray):
        self.name, self.array = name, array


def _const(x) -> np.ndarray | None:
    return x.array if isinstance(x, _Const) else const_value(x)


class _Chain:
    """What has been gathered for one anchor node."""

    def __init__(self, anchor: Node):
        self.anchor = anchor
        self.kind = anchor.op_type.removeprefix("Fused")
        self.inputs: list = list(anchor.inputs)
        self.attrs = dict(anchor.attrs)
        self.absorbed: list[Node] = []
        self.out: Value = anchor.outputs[0]
        self.activation = self.attrs.get("activation", "")
        self.params = list(self.attrs.get("activation_params", []))

    def slot(self, i: int):
        return self.inputs[i] if i < len(self.inputs) else None

    def set_slot(self, i: int, v) -> None:
        while len(self.inputs) <= i:
            self.inputs.append(None)
        self.inputs[i] = v


def _match(rw: Rewriter, n: Node):
    if n.domain == KILN_DOMAIN and n.attrs.get("activation"):
        return None
    if len(n.outputs) != 1 or n.outputs[0] is None:
        return None
    return n


def _check(rw: Rewriter, n: Node) -> str | None:
    t = dtype_of(n.outputs[0])
    if t is None or not t.is_float:
        return "output is not a float tensor (or its type is unknown)"
    if n.op_type == "Conv" and lookup("", "Conv", 10**6) is None:
        return "no Conv kernel"
    return None


def _apply(rw: Rewriter, n: Node) -> str | None:
    ch = _Fuser(rw, n).gather()
    if not ch.absorbed:
        return None
    g = n.graph
    ch.inputs = [rw.add_const(g, x.name, x.array) if isinstance(x, _Const) else x
                 for x in ch.inputs]
    fused = _build(ch)
    fused.outputs = [ch.out]
    rw.replace([n] + ch.absorbed, [fused])
    return f"{n.op_type} + " + " + ".join(x.op_type for x in ch.absorbed) + \
        f" -> {fused.op_type}"


class _Fuser:
    def __init__(self, rw: Rewriter, anchor: Node):
        self.rw, self.anchor = rw, anchor
        self.g = anchor.graph
        self.taken: set[Node] = set()

    def _next(self, v: Value) -> Node | None:
        """The one node of this graph reading ``v``, if exactly one node reads it once."""
        if v.is_returned or v.num_reads != 1:
            return None
        r = next(v.readers())
        return r if r.graph is self.g and r not in self.taken else None

    def gather(self) -> _Chain:
        n = self.anchor
        ch = _Chain(n)
        m = self._next(ch.out)
        if m is not None and m.domain == "" and m.op_type == "Add" and self._bias(ch, m):
            m = self._next(ch.out)
        if ch.kind in ("Conv", "MatMul") and m is not None and m.domain == "" and \
                m.op_type == "Add":
            self._residual(ch, m)
        self._activation(ch)
        return ch

    # -- pieces of the chain
    def _other(self, ch: _Chain, m: Node) -> Value | None:
        if "axis" in m.attrs:
            return None  # opset < 7 Add broadcasting from a given axis: not a plain add
        a, b = m.inputs[0], m.inputs[1] if len(m.inputs) > 1 else None
        if a is ch.out and b is not ch.out:
            return b
        if b is ch.out and a is not ch.out:
            return a
        return None

    def _bias(self, ch: _Chain, m: Node) -> bool:
        other = self._other(ch, m)
        c = const_value(other)
        out_shape = shape_of(ch.out)
        if c is None or out_shape is None or c.dtype != dtype_of(ch.out).numpy:
            return False
        if ch.kind == "Conv":
            vec = _channel_vector(c, len(out_shape))
            if vec is None or len(out_shape) < 2 or not isinstance(out_shape[1], int):
                return False
            vec = np.broadcast_to(vec, (out_shape[1],))
            slot = 2
        elif ch.kind == "MatMul":
            vec = _last_axis_vector(c, len(out_shape))
            if vec is None:
                return False
            slot = 2
        else:
            return self._gemm_bias(ch, m, c)
        old = ch.slot(slot)
        if old is not None:
            oc = _const(old)
            if oc is None:
                return False
            vec = oc + vec
        ch.set_slot(slot, _Const(f"{ch.out.name}_bias", np.asarray(vec, c.dtype)))
        return self._take(ch, m)

    def _gemm_bias(self, ch: _Chain, m: Node, c: np.ndarray) -> bool:
        out_shape = shape_of(ch.out)
        if len(out_shape) != 2 or c.ndim > 2:
            return False
        pad = (1,) * (2 - c.ndim) + c.shape
        if not all(p == 1 or symdim.same(p, o) for p, o in zip(pad, out_shape)):
            return False
        old = ch.slot(2)
        beta = ch.attrs.get("beta", 1.0)
        if old is not None:
            oc = _const(old)
            if oc is None:
                return False
            c = (oc * beta + c).astype(c.dtype)
        ch.set_slot(2, _Const(f"{ch.out.name}_bias", c))
        ch.attrs["beta"] = 1.0
        return self._take(ch, m)

    def _residual(self, ch: _Chain, m: Node) -> bool:
        if ch.slot(3) is not None:
            return False
        z = self._other(ch, m)
        a, b, o = shape_of(z), shape_of(ch.out), shape_of(m.outputs[0])
        if z is None or not _same(a, b) or not _same(b, o) or dtype_of(z) != dtype_of(ch.out):
            return False
        ch.set_slot(3, z)
        return self._take(ch, m)

    def _take(self, ch: _Chain, m: Node) -> bool:
        ch.absorbed.append(m)
        self.taken.add(m)
        ch.out = m.outputs[0]
        return True

    def _activation(self, ch: _Chain) -> None:
        if ch.activation:
            return
        v = ch.out
        readers = v.consumers()
        if v.is_returned or any(r.graph is not self.g or r in self.taken for r in readers):
            return
        if len(readers) == 1 and v.num_reads == 1:
            m = readers[0]
            act = single_activation(m, self.rw.opset(m))
            if act is not None:
                ch.activation, ch.params = act
                self._take(ch, m)
            return
        if len(readers) == 2 and v.num_reads == 2:
            self._gated(ch, readers)

    def _gated(self, ch: _Chain, readers: list[Node]) -> None:
        """``y * Sigmoid(y)`` (SiLU) and ``y * HardSigmoid(y)`` (HardSwish)."""
        if self._hard_swish_decomposed(ch, readers):
            return
        gate = next((r for r in readers if r.domain == "" and
                     r.op_type in ("Sigmoid", "HardSigmoid")), None)
        mul = next((r for r in readers if r.domain == "" and r.op_type == "Mul"), None)
        if gate is None or mul is None or gate.inputs[0] is not ch.out:
            return
        if set(mul.inputs) != {ch.out, gate.outputs[0]} or self._next(gate.outputs[0]) is not mul:
            return
        if gate.op_type == "Sigmoid":
            ch.activation = "Silu"
        elif math.isclose(gate.attrs.get("alpha", 0.2), 1 / 6, rel_tol=1e-5) and \
                math.isclose(gate.attrs.get("beta", 0.5), 0.5, rel_tol=1e-6):
            ch.activation = "HardSwish"
        else:
            return
        ch.params = []
        ch.absorbed.append(gate)
        self._take(ch, mul)

    def _hard_swish_decomposed(self, ch: _Chain, readers: list[Node]) -> bool:
        """``y * Clip(y + 3, 0, 6) / 6`` (paddle2onnx's HardSwish, 18 times in PaddleOCR's
        text-line classifier) taken as HardSwish: four layers fewer per activation."""
        add = next((r for r in readers if r.domain == "" and r.op_type == "Add"), None)
        mul = next((r for r in readers if r.domain == "" and r.op_type == "Mul"), None)
        if add is None or mul is None or len(add.inputs) != 2:
            return False
        other = add.inputs[1] if add.inputs[0] is ch.out else add.inputs[0]
        if other is ch.out or scalar_value(other) != 3.0:
            return False
        clip = self._next(add.outputs[0])
        if clip is None or clip.op_type != "Clip" or \
                single_activation(clip, self.rw.opset(clip)) != ("Clip", [0.0, 6.0]):
            return False
        if self._next(clip.outputs[0]) is not mul or set(mul.inputs) != {ch.out, clip.outputs[0]}:
            return False
        div = self._next(mul.outputs[0])
        if div is None or div.domain != "" or div.op_type != "Div" or \
                div.inputs[0] is not mul.outputs[0] or scalar_value(div.inputs[1]) != 6.0:
            return False
        shape = shape_of(ch.out)  # one number of no higher rank than y: y's shape stays
        if shape is None or any(const_value(c).ndim > len(shape) for c in (other, div.inputs[1])):
            return False
        ch.activation, ch.params = "HardSwish", []
        ch.absorbed += [add, clip, mul]
        self.taken.update((add, clip, mul))
        return self._take(ch, div)


def _build(ch: _Chain) -> Node:
    """The fused node (outputs set by the caller)."""
    n = ch.anchor
    act_attrs = {}
    if ch.activation:
        act_attrs["activation"] = ch.activation
        if ch.params:
            act_attrs["activation_params"] = [float(p) for p in ch.params]
    name = n.name or ch.absorbed[-1].name
    if ch.kind == "Conv":
        attrs = {k: v for k, v in ch.attrs.items() if k in _CONV_ATTRS}
        if not ch.activation and ch.slot(3) is None:
            return Node("Conv", ch.inputs[:3], [None], attrs, name=name)
        return Node("FusedConv", ch.inputs[:4], [None], {**attrs, **act_attrs},
                    domain=KILN_DOMAIN, name=name)
    if ch.kind == "Gemm":
        attrs = {k: v for k, v in ch.attrs.items() if k in _GEMM_ATTRS}
        if not ch.activation:
            return Node("Gemm", ch.inputs[:3], [None], attrs, name=name)
        return Node("FusedGemm", ch.inputs[:3], [None], {**attrs, **act_attrs},
                    domain=KILN_DOMAIN, name=name)
    return Node("FusedMatMul", ch.inputs[:4], [None], act_attrs, domain=KILN_DOMAIN,
                name=name)


def single_activation(m: Node, opset: int) -> tuple[str, list[float]] | None:
    """The fused-activation name and parameters ``m`` computes, if it is one of the
    activations the fused kernels apply (``kiln.ops.fused.ACTIVATIONS``)."""
    name = m.op_type
    if name == "Gelu":
        name = "GeluTanh" if m.attrs.get("approximate") == "tanh" else "Gelu"
    act = ACTIVATIONS.get(name)
    if act is None or m.domain not in ("", KILN_DOMAIN) or lookup(m.domain, m.op_type,
                                                                   opset) is None:
        return None
    if name != "Clip" or opset < 11:
        return name, [float(m.attrs.get(k, d)) for k, d in act.attrs]
    bounds = []
    for i, default in ((1, -math.inf), (2, math.inf)):
        v = m.inputs[i] if len(m.inputs) > i else None
        s = default if v is None else scalar_value(v)
        if s is None:
            return None
        bounds.append(s)
    return name, bounds


def _channel_vector(c: np.ndarray, rank: int) -> np.ndarray | None:
    """A Conv-output bias broadcast only along the channel axis, as a vector."""
    if c.ndim > rank:
        return None
    pad = c.reshape((1,) * (rank - c.ndim) + c.shape)
    if pad.shape[0] != 1 or any(d != 1 for d in pad.shape[2:]):
        return None
    return pad.reshape(-1)


def _last_axis_vector(c: np.ndarray, rank: int) -> np.ndarray | None:
    """A bias broadcast only along the last axis, as a vector."""
    if c.ndim > rank or any(d != 1 for d in c.shape[:-1]):
        return None
    return c.reshape(-1)


def _same(a, b) -> bool:
    return a is not None and b is not None and len(a) == len(b) and \
        all(symdim.same(x, y) for x, y in zip(a, b))
