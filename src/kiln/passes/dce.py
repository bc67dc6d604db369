"""Dead-code elimination: remove nodes none of whose outputs is read (by a node, a nested
subgraph or as a graph output), then initializers nothing reads.

Nodes are visited last to first, so a whole dead chain goes in one sweep. Graph inputs are
the model's interface and stay, even unread; overridable initializers (initializers a feed
may replace, which are also inputs) stay too.
"""

from __future__ import annotations

from collections import Counter

from kiln.ir import Graph, Model, Node
from kiln.passes.base import Pass, PassRecord, graphs, rebuild


class DeadCodeElimination(Pass):
    """Remove unread nodes and unused initializers."""

    name = "dce"
    level = 1

    def run(self, model: Model, record: PassRecord) -> None:
        for g in list(graphs(model.graph)):
            remove_dead(g, record)


def _reads(n: Node) -> Counter:
    """Every read a node makes: its inputs, plus outer values its subgraphs read/return."""
    c = Counter(v for v in n.inputs if v is not None)
    for sub in n.subgraphs():
        for g in graphs(sub):
            for m in g.nodes:
                c.update(v for v in m.inputs if v is not None)
            c.update(g.outputs)
    return c


def remove_dead(g: Graph, record: PassRecord) -> None:
    reads: Counter = Counter(g.outputs)
    per_node = {}
    for n in g.nodes:
        per_node[n] = _reads(n)
        reads.update(per_node[n])
    dead: set[Node] = set()
    for n in reversed(g.nodes):
        if any(v is not None and reads[v] > 0 for v in n.outputs):
            continue
        dead.add(n)
        reads.subtract(per_node[n])
    if dead:
        rebuild(g, dead)
        record.add("dead nodes removed", len(dead))
    unused = [k for k, v in g.initializers.items()
              if reads[v] <= 0 and not v.meta.get("overridable")]
    for k in unused:
        del g.initializers[k]
    record.add("unused initializers removed", len(unused))
