"""The pass framework: a :class:`Pass` takes a Model and changes it, filling a
:class:`PassRecord` with what it changed (and, for rule passes, why a rule declined).
Rewrites are :class:`kiln.passes.rewrite.Rule` objects grouped in a :class:`RulePass`;
``kiln.optimize`` runs the rules of all enabled passes through one worklist engine.

The graph-editing helpers passes share (replacing a value by another, bypassing a node,
adding constants) live in :mod:`kiln.passes.core`, below the engine, and are re-exported
here.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import ClassVar

from kiln.ir import Model
from kiln.passes.core import (
    Pass,
    PassRecord,
    add_const,
    adopt_const,
    bypass,
    clone_model,
    const_value,
    count_nodes,
    dtype_of,
    fresh_value,
    graphs,
    make_const,
    op_histogram,
    rank_of,
    replace_uses,
    scalar_value,
    shape_of,
    tensor_type,
)
from kiln.passes.rewrite import Rule, run_rules

__all__ = ["add_const", "adopt_const", "bypass", "clone_model", "const_value", "count_nodes",
           "dtype_of", "fresh_value", "graphs", "make_const", "op_histogram",
           "OptimizeReport", "Pass", "PassRecord", "rank_of", "replace_uses", "RulePass",
           "scalar_value", "shape_of", "tensor_type"]


class RulePass(Pass):
    """A pass made of rewrite rules. Run alone (``FuseGelu()(model)``) it applies its own
    rules to a fixed point; ``kiln.optimize`` pools the rules of every enabled pass into
    one engine run instead."""

    stage: ClassVar[int] = 1
    """The first engine stage whose rule set includes this pass's rules: 1 cleanup,
    2 pattern fusions, 3 activation fusion, 4 merging of sibling products (later stages
    keep the earlier rules)."""

    def rules(self) -> list[Rule]:
        """This pass's rules (their ``owner`` is set to the pass's name)."""
        raise NotImplementedError

    def finish(self, model: Model, record: PassRecord) -> None:
        """Whole-graph clean-up after the rules ran (linear; e.g. unused initializers)."""

    def owned_rules(self) -> list[Rule]:
        out = self.rules()
        for r in out:
            r.owner = self.name
        return out

    def run(self, model: Model, record: PassRecord) -> None:
        run_rules(model, self.owned_rules(), {self.name: record})
        self.finish(model, record)


@dataclass
class OptimizeReport:
    """Everything a pipeline did to a model: per pass and stage, and the totals."""

    nodes_before: int = 0
    nodes_after: int = 0
    ops_before: Counter = field(default_factory=Counter)
    ops_after: Counter = field(default_factory=Counter)
    records: list[tuple[int, PassRecord]] = field(default_factory=list)
    iterations: int = 0
    """Engine stages run (each: one sweep plus the neighbourhoods of changes)."""
    seconds: float = 0.0
    converged: bool = True
    """False when the rewrite budget ran out before the rules stopped applying."""
    rewrites: int = 0

    def by_pass(self) -> dict[str, Counter]:
        """Changes summed over stages, per pass."""
        out: dict[str, Counter] = {}
        for _, r in self.records:
            out.setdefault(r.name, Counter()).update(r.changes)
        return out

    def declined(self) -> dict[str, Counter]:
        """Why rules declined matches, summed over stages, per pass."""
        out: dict[str, Counter] = {}
        for _, r in self.records:
            if r.declined:
                out.setdefault(r.name, Counter()).update(r.declined)
        return out

    def summary(self) -> str:
        lines = [f"nodes {self.nodes_before} -> {self.nodes_after} in {self.iterations} "
                 f"stage(s), {self.rewrites} rewrite(s), {self.seconds * 1e3:.0f} ms"
                 + ("" if self.converged else " (rewrite budget hit)")]
        for name, changes in self.by_pass().items():
            if changes:
                lines.append(f"  {name}: " + ", ".join(f"{k} x{v}" for k, v in
                                                       sorted(changes.items())))
        return "\n".join(lines)
