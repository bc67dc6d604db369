"""Dead-code elimination: remove nodes none of whose outputs is read (by a node, a nested
subgraph or as a graph output), then initializers nothing reads.

A rule on the use-lists: a node whose outputs have no uses goes, and removing it queues
its inputs' producers, so a whole dead chain goes in time linear in its length. Graph
inputs are the model's interface and stay, even unread; overridable initializers
(initializers a feed may replace, which are also inputs) stay too.
"""

from __future__ import annotations

from kiln.ir import Model, Node
from kiln.passes.base import PassRecord, RulePass, graphs
from kiln.passes.rewrite import Rewriter, Rule


class DeadCodeElimination(RulePass):
    """Remove unread nodes and unused initializers."""

    name = "dce"
    level = 1

    def rules(self) -> list[Rule]:
        return [Rule("dead node", None, _match_dead, _remove_dead, needs_types=False)]

    def finish(self, model: Model, record: PassRecord) -> None:
        for g in list(graphs(model.graph)):
            unused = [k for k, v in g.initializers.items()
                      if not v.is_used() and not v.meta.get("overridable")]
            for k in unused:
                del g.initializers[k]
            record.add("unused initializers removed", len(unused))


def _match_dead(rw: Rewriter, n: Node) -> Node | None:
    return None if any(v is not None and v.is_used() for v in n.outputs) else n


def _remove_dead(rw: Rewriter, n: Node) -> str:
    rw.remove(n)
    return "dead nodes removed"
