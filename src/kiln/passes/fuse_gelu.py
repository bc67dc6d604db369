"""Fuse the decomposed GELU patterns into one op:

    erf form:   0.5 * x * (1 + Erf(x / sqrt(2)))                 (or x * 0.7071...)
    tanh form:  0.5 * x * (1 + Tanh(sqrt(2/pi) * (x + 0.044715 * x^3)))

in any of the orders exporters write the two outer products, with ``x^3`` as ``Pow(x, 3)``
or ``x * x * x``. The result is ONNX's ``Gelu`` (``approximate="tanh"`` for the tanh form)
when the model's opset has it (20+) and Kiln has its kernel, else Kiln's ``Gelu``. The
activation-fusion pass may then fold it into the MatMul before it.
"""

from __future__ import annotations

import math

from kiln.ir import Node, Value
from kiln.ops.registry import KILN_DOMAIN, lookup
from kiln.passes.base import RulePass, dtype_of, scalar_value
from kiln.passes.rewrite import Rewriter, Rule, only_consumer, ops, producer


class FuseGelu(RulePass):
    """Decomposed GELU (erf or tanh form) -> one Gelu op."""

    name = "fuse_gelu"
    level = 2
    stage = 2
    creates = ("Gelu",)

    def rules(self) -> list[Rule]:
        return [Rule("gelu", ops("Erf", "Tanh"), _match, _apply, _check)]


def _close(v: float | None, want: float, tol: float = 1e-3) -> bool:
    return v is not None and math.isclose(v, want, rel_tol=tol)


def _match(rw: Rewriter, core: Node):
    return _GeluMatcher(core).match()


def _check(rw: Rewriter, m) -> str | None:
    x = m[0]
    if dtype_of(x) is None or not dtype_of(x).is_float:
        return "input is not a float tensor (or its type is unknown)"
    return None


def _apply(rw: Rewriter, m) -> str:
    x, out, nodes, approximate, core = m
    model = rw.model
    onnx_gelu = model.opset >= 20 and lookup("", "Gelu", model.opset) is not None
    gelu = Node("Gelu", [x], [None], {"approximate": approximate},
                domain="" if onnx_gelu else KILN_DOMAIN, name=core.name)
    gelu.outputs = [out]
    rw.replace(nodes, [gelu])
    return f"GELU ({'erf' if approximate == 'none' else 'tanh'} form) fused"


class _GeluMatcher:
    """Walks the use-lists around one Erf/Tanh node."""

    def __init__(self, core: Node):
        self.core = core

    # -- small matchers; each returns None when the shape is wrong
    def _p(self, v: Value | None, op: str) -> Node | None:
        return producer(v, self.core, op)

    def _reader(self, v: Value, op: str) -> Node | None:
        return only_consumer(v, op)

    @staticmethod
    def _split(n: Node, v: Value) -> Value | None:
        """The other input of a binary node one of whose inputs is ``v``."""
        if len(n.inputs) != 2:
            return None
        a, b = n.inputs
        return b if a is v else a if b is v else None

    def _const_operand(self, n: Node) -> tuple[Value, float] | None:
        """(the variable input, the scalar constant) of a binary node."""
        for i in (0, 1):
            c = scalar_value(n.inputs[1 - i])
            if c is not None:
                return n.inputs[i], c
        return None

    # -- the patterns
    def match(self):
        """(x, output, nodes in order, approximate, core) or None."""
        core = self.core
        arg = core.inputs[0] if core.inputs else None
        if arg is None:
            return None
        if core.op_type == "Erf":
            x, inner = self._erf_arg(arg)
            approximate = "none"
        else:
            x, inner = self._tanh_arg(arg)
            approximate = "tanh"
        if x is None:
            return None
        add = self._reader(core.outputs[0], "Add")
        if add is None or not _close(scalar_value(self._split(add, core.outputs[0])), 1.0):
            return None
        tail = self._outer(x, add.outputs[0])
        if tail is None:
            return None
        out, outer_nodes = tail
        return x, out, inner + [core, add] + outer_nodes, approximate, core

    def _erf_arg(self, v: Value):
        """Erf's argument is x / sqrt(2) or x * (1/sqrt(2))."""
        for op, want in (("Div", math.sqrt(2)), ("Mul", 1 / math.sqrt(2))):
            n = self._p(v, op)
            if n is None or not v.only_reader(self.core):
                continue
            got = self._const_operand(n)
            if got is None or (op == "Div" and n.inputs[1] is got[0]):
                continue
            if _close(got[1], want):
                return got[0], [n]
        return None, []

    def _tanh_arg(self, v: Value):
        """Tanh's argument is sqrt(2/pi) * (x + 0.044715 * x^3)."""
        scale = self._p(v, "Mul")
        if scale is None or len(v.consumers()) != 1:
            return None, []
        got = self._const_operand(scale)
        if got is None or not _close(got[1], math.sqrt(2 / math.pi)):
            return None, []
        s = got[0]
        add = self._p(s, "Add")
        if add is None or not s.only_reader(scale):
            return None, []
        for i in (0, 1):
            x, cubic = add.inputs[i], add.inputs[1 - i]
            mul = self._p(cubic, "Mul")
            if mul is None or not cubic.only_reader(add):
                continue
            got = self._const_operand(mul)
            if got is None or not _close(got[1], 0.044715):
                continue
            cube = self._cube(got[0], x, mul)
            if cube is not None:
                return x, [scale, add, mul] + cube
        return None, []

    def _cube(self, v: Value, x: Value, reader: Node) -> list[Node] | None:
        """Nodes computing ``v = x^3`` (Pow(x, 3), x*(x*x), (x*x)*x), read only by
        ``reader``."""
        if not v.only_reader(reader):
            return None
        pw = self._p(v, "Pow")
        if pw is not None:
            return [pw] if pw.inputs[0] is x and _close(scalar_value(pw.inputs[1]), 3.0) \
                else None
        m = self._p(v, "Mul")
        if m is None:
            return None
        other = self._split(m, x)
        sq = self._p(other, "Mul") if other is not None else None
        if sq is None or sq.inputs[0] is not x or sq.inputs[1] is not x or \
                not other.only_reader(m):
            return None
        return [m, sq]

    def _outer(self, x: Value, one_plus: Value):
        """The two outer products: (x * (1+e)) * 0.5, (x * 0.5) * (1+e), x * ((1+e) * 0.5).
        Returns (final output value, [nodes in order])."""
        m1 = self._reader(one_plus, "Mul")
        if m1 is None:
            return None
        other = self._split(m1, one_plus)
        if other is x:  # x * (1+e), then * 0.5
            m2 = self._reader(m1.outputs[0], "Mul")
            if m2 is not None and _close(scalar_value(self._split(m2, m1.outputs[0])), 0.5):
                return m2.outputs[0], [m1, m2]
            return None
        if _close(scalar_value(other), 0.5):  # (1+e) * 0.5, then * x
            m2 = self._reader(m1.outputs[0], "Mul")
            if m2 is not None and self._split(m2, m1.outputs[0]) is x:
                return m2.outputs[0], [m1, m2]
            return None
        half = self._p(other, "Mul")  # (x * 0.5) * (1+e)
        if half is not None and other.only_reader(m1):
            got = self._const_operand(half)
            if got is not None and got[0] is x and _close(got[1], 0.5):
                return m1.outputs[0], [half, m1]
        return None
