"""Algebraic identities that leave a value unchanged, bit for bit, NaN and signed zeros
included, stated in the pattern language (:mod:`kiln.passes.pattern`):

- ``x * 1``, ``1 * x``, ``x / 1``, ``x ^ 1`` (Pow), ``x - 0`` (a +0: ``-0 - +0`` is -0);
- ``x + (-0)`` and ``(-0) + x``, not ``x + 0``: ``-0 + +0`` is +0, so adding a +0 changes a
  -0 (integer zeros have no sign: any integer zero is an identity);
- ``And(x, true)``, ``Or(x, false)``, ``Xor(x, false)``, ``Neg(Neg(x))``, ``Not(Not(x))``.

Every constant element must be the identity (a mixed constant is not), and the result must
have ``x``'s element type and shape exactly: a constant that broadcasts ``x`` to a larger
shape keeps its node (the pattern language checks this for every rule whose result is a
variable).
"""

from __future__ import annotations

from kiln.passes.base import RulePass
from kiln.passes.pattern import Const, Op, Var, equals, pattern_rule
from kiln.passes.rewrite import Rule

X = Var("x")
ONE, PLUS_ZERO, MINUS_ZERO = Const(equals(1)), Const(equals(0.0)), Const(equals(-0.0))
TRUE, FALSE = Const(equals(True)), Const(equals(False))


def identity_rules() -> list[Rule]:
    """The identities as rules (new objects each call: a pass sets their owner)."""
    return [
        pattern_rule("x * 1", Op("Mul", X, ONE, commutative=True), X),
        pattern_rule("x / 1", Op("Div", X, ONE), X),
        pattern_rule("x ^ 1", Op("Pow", X, ONE), X),
        pattern_rule("x - 0", Op("Sub", X, PLUS_ZERO), X),
        pattern_rule("x + (-0)", Op("Add", X, MINUS_ZERO, commutative=True), X),
        pattern_rule("x and true", Op("And", X, TRUE, commutative=True), X),
        pattern_rule("x or false", Op("Or", X, FALSE, commutative=True), X),
        pattern_rule("x xor false", Op("Xor", X, FALSE, commutative=True), X),
        pattern_rule("-(-x)", Op("Neg", Op("Neg", X)), X),
        pattern_rule("not not x", Op("Not", Op("Not", X)), X),
    ]


class Identities(RulePass):
    """Drop arithmetic and logic that returns its input unchanged."""

    name = "identities"
    level = 1

    def rules(self) -> list[Rule]:
        return identity_rules()
