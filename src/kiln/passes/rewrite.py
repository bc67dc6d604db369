"""The rewrite engine: passes stated as rules, applied with a worklist.

A :class:`Rule` is a pattern (the op types its root node may have, plus a ``match``
function that looks around the root through producers and use-lists), a ``check`` that
may decline a match and say why (counted in the pass's ``PassRecord.declined``), and an
``apply`` that rewrites through the :class:`Rewriter`. The rewriter records every node a
rewrite touched and queues the nodes near it (a few hops up and down the use-lists), so
after the first sweep over the graph only the neighbourhoods of changes are visited
again: the total work is linear in the graph plus the changes, not one whole-graph pass
per change.

Rewrites may make types stale (a folded input, a new node): those nodes are re-inferred
(:func:`kiln.passes.infer_shapes.infer_node`) before a rule looks at them, and when their
outputs' types change their readers are re-inferred in turn.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.ir import DType, Graph, Model, Node, TensorType, Value
from kiln.passes.core import PassRecord, add_const, adopt_const, graphs

NEIGHBOURHOOD = 4
"""Hops up and down from a change whose nodes are visited again (the longest pattern's
distance from its root)."""
NEIGHBOURHOOD_CAP = 256
"""At most this many nodes queued per change (a shape value read by hundreds of nodes
must not make one change cost a graph sweep)."""


@dataclass
class Rule:
    """One rewrite: ``match(rw, root) -> m | None`` finds the pattern at ``root`` (an op of
    ``roots``, or any node when ``roots`` is None), ``check(rw, m) -> reason | None``
    declines it, ``apply(rw, m) -> label`` rewrites and returns what the change is called
    in the report (None: nothing changed after all)."""

    name: str
    roots: frozenset[tuple[str, str]] | None
    match: Callable[[Rewriter, Node], Any]
    apply: Callable[[Rewriter, Any], str | None]
    check: Callable[[Rewriter, Any], str | None] | None = None
    needs_types: bool = True
    """False: the rule is valid before shape inference ran (Identity removal, DCE...)."""
    owner: str = ""
    """The pass it belongs to (set by the pass): its record and its ``disable=`` name."""


def ops(*op_types: str, domain: str = "") -> frozenset[tuple[str, str]]:
    """Root op types for a :class:`Rule`."""
    return frozenset((domain, t) for t in op_types)


class Rewriter:
    """The engine and the editing API rules use. Every edit goes through it so the
    neighbourhood of the change is queued again."""

    def __init__(self, model: Model, rules: Iterable[Rule], records: dict[str, PassRecord],
                 infer: bool = True, budget: int | None = None,
                 sweep: Iterable[Rule] | None = None, state: dict[str, Any] | None = None):
        self.model = model
        self.rules = list(rules)
        self._sweep = None if sweep is None else {id(r) for r in sweep}
        """Rules the first visit of an untouched node tries (None: all). A stage whose
        other rules already ran to a fixed point sweeps with its new rules only."""
        self._full: set[Node] = set()
        self.records = records
        self.infer = infer
        self._by_root: dict[tuple[str, str], list[Rule]] = {}
        self._any: list[Rule] = []
        for r in self.rules:
            if r.roots is None:
                self._any.append(r)
            else:
                for key in r.roots:
                    self._by_root.setdefault(key, []).append(r)
        self._rule_cache: dict[tuple[tuple[str, str], bool], tuple[tuple[str, Rule], ...]] = {}
        self._queue: deque[Node] = deque()
        self._seeds: dict[Node, int] = {}
        self._queued: set[Node] = set()
        self._stale: set[Node] = set()
        self.order: dict[Node, int] = {}
        self._next_pos = 0
        self._declines: dict[tuple[str, Node], str] = {}
        self.applied = 0
        self.budget = budget
        self.converged = True
        self.state: dict[str, Any] = {} if state is None else state
        """Scratch space for rules (CSE's tables), shared by the stages of one optimize."""

    # -- driving
    def run(self) -> None:
        """Visit every node once, then the neighbourhoods of changes until none is left."""
        for g in graphs(self.model.graph):
            for n in g.nodes:
                self._number(n)
                # A node no sweep rule could root at waits until a change queues it.
                if n not in self._queued and (self._sweep is None or self._rules_for(
                        (n.domain, n.op_type), False)):
                    self._queued.add(n)
                    self._queue.append(n)
        t0 = time.perf_counter()
        while self._queue or self._seeds:
            if not self._queue:
                self._flush()
                continue
            n = self._queue.popleft()
            self._queued.discard(n)
            if n.graph is None:
                continue
            if n in self._stale:
                self._reinfer(n)
            if n.graph is None:
                continue
            self._visit(n)
            if self.budget is not None and self.applied >= self.budget:
                self.converged = False
                break
        for (rule_name, _), reason in self._declines.items():
            owner, _, name = rule_name.partition(":")
            self.records[owner].declined[f"{name}: {reason}"] += 1
        self.seconds = time.perf_counter() - t0

    def _rules_for(self, op: tuple[str, str], full: bool) -> tuple[tuple[str, Rule], ...]:
        """The rules a node of type ``op`` tries, with their labels (built once per type)."""
        rules = self._rule_cache.get((op, full))
        if rules is None:
            found = (*self._by_root.get(op, ()), *self._any)
            if not full:
                found = tuple(r for r in found if id(r) in self._sweep)  # type: ignore[operator]
            rules = self._rule_cache[(op, full)] = tuple(
                (f"{r.owner}:{r.name}", r) for r in found)
        return rules

    def _visit(self, n: Node) -> None:
        full = self._sweep is None or n in self._full
        self._full.discard(n)
        declines = self._declines
        for label, rule in self._rules_for((n.domain, n.op_type), full):
            m = rule.match(self, n)
            if m is None:
                if declines:  # mostly empty: no key to build per rule and node
                    declines.pop((label, n), None)
                continue
            key = (label, n)
            reason = rule.check(self, m) if rule.check is not None else None
            if reason is not None:
                self._declines[key] = reason
                continue
            self._declines.pop(key, None)
            label = rule.apply(self, m)
            if label:
                self.records[rule.owner].add(label)
                self.applied += 1
                self._push(n)
                return  # the node may be gone or different: visit it afresh
            if n.graph is None:
                return

    def _number(self, n: Node, at: Node | None = None) -> None:
        if at is not None and at in self.order:
            self.order[n] = self.order[at]
        else:
            self.order[n] = self._next_pos
            self._next_pos += 1

    def _push(self, n: Node) -> None:
        self._full.add(n)
        if n not in self._queued and n.graph is not None:
            self._queued.add(n)
            self._queue.append(n)

    def touch(self, *nodes: Node | None, radius: int = NEIGHBOURHOOD) -> None:
        """Queue ``nodes`` and the nodes within ``radius`` hops of them for another visit
        (gathered, and walked once for all the rewrites made when the queue drains)."""
        for n in nodes:
            if n is not None:
                r = self._seeds.get(n)
                if r is None or r < radius:
                    self._seeds[n] = radius

    def _flush(self) -> None:
        """One breadth-first walk from every node touched since the last flush."""
        seeds, self._seeds = self._seeds, {}
        if not seeds:
            return
        left: dict[Node, int] = dict(seeds)
        frontier = list(seeds)
        for n in frontier:
            self._push(n)
        while frontier and len(left) <= NEIGHBOURHOOD_CAP * max(1, len(seeds)):
            nxt: list[Node] = []
            for n in frontier:
                r = left[n] - 1
                if r < 0:
                    continue
                around = [v.producer for v in n.inputs if v is not None and v.producer]
                for v in n.outputs:
                    if v is not None:
                        around += v.readers()
                for m in around:
                    if left.get(m, -1) < r:
                        left[m] = r
                        nxt.append(m)
                        self._push(m)
            frontier = nxt

    def touch_value(self, v: Value | None) -> None:
        """Queue the producer and readers of ``v`` (something about it changed)."""
        if v is None:
            return
        self.touch(v.producer, *v.consumers())

    def _reinfer(self, n: Node) -> None:
        self._stale.discard(n)
        if not self.infer:
            return
        from kiln.passes.infer_shapes import infer_node, settled

        if settled(n):  # static shapes: re-inferring ShuffleNetV2's 1,064 nodes refined none
            return

        before = [(v.type, v.meta.get("sym")) if v is not None else None for v in n.outputs]
        try:
            infer_node(n, self.model)
        except Exception:  # noqa: BLE001 - a type we cannot refine stays as it was
            return
        after = [(v.type, v.meta.get("sym")) if v is not None else None for v in n.outputs]
        if before != after:
            for v in n.outputs:
                if v is not None:
                    for m in v.consumers():
                        self._stale.add(m)
                        self._push(m)

    def stale(self, *nodes: Node) -> None:
        """Mark ``nodes`` for re-inference before their next visit (and queue them)."""
        for n in nodes:
            if n is not None:
                self._stale.add(n)
                self._push(n)

    # -- the editing API
    def opset(self, n: Node) -> int:
        return self.model.opset_of(n.domain)

    def insert_before(self, anchor: Node, nodes: list[Node]) -> None:
        """Add ``nodes`` to ``anchor``'s graph just before it (it may be removed next). A
        node of a domain the model does not import yet (a fusion's ``ai.kiln`` op) adds
        that domain's import, at version 1."""
        anchor.graph.insert_before(anchor, nodes)
        for m in nodes:
            self._number(m, anchor)
            if m.domain:
                self.model.opset_imports.setdefault(m.domain, 1)
        # Typed now, in order: a rule at a neighbour may look at their outputs before the
        # engine visits them (a Q after a DQ that moved behind a Reshape)
        for m in nodes:
            self._stale.add(m)
            self._reinfer(m)
        self.touch(*nodes)

    def remove(self, *nodes: Node) -> None:
        """Take nodes out of their graph; their inputs' producers are visited again (a
        value may have lost its last reader, or become single-use)."""
        around: list[Node] = []
        for n in nodes:
            if n.graph is None:
                continue
            around += [v.producer for v in n.inputs if v is not None and v.producer is not None]
            n.graph.remove_node(n)
        self.touch(*[p for p in around if p.graph is not None])

    def replace(self, old: list[Node], new: list[Node]) -> None:
        """Put ``new`` where the last of ``old`` was (it computes the pattern's final
        output, so every input of the pattern is defined before it), then remove ``old``."""
        self.insert_before(old[-1], new)
        self.remove(*old)

    def set_input(self, n: Node, i: int, v: Value | None) -> None:
        old = n.inputs[i] if i < len(n.inputs) else None
        n.set_input(i, v)
        self.stale(n)
        self.touch(n)
        if old is not None and old.producer is not None:
            self.touch(old.producer, radius=2)

    def replace_all_uses(self, old: Value, new: Value, keep_outputs_of: Graph | None) -> int:
        readers = old.consumers()
        k = old.replace_all_uses_with(new, keep_outputs_of=keep_outputs_of)
        self.stale(*readers)
        self.touch(*readers, new.producer, old.producer)
        return k

    def bypass(self, src: Value, dst: Value) -> bool:
        """Make ``dst`` (the output of a node about to be removed) stand for ``src``;
        see :func:`kiln.passes.base.bypass`. Queues what changed."""
        prod = dst.producer
        g = prod.graph if prod is not None else None
        if g is None:
            return False
        if not dst.is_output_of(g):
            self.replace_all_uses(dst, src, keep_outputs_of=None)
            return True
        sp = src.producer
        if sp is None or sp.graph is not g or src.is_output_of(g):
            return False
        # dst's name is the interface: src's producer computes dst directly
        sp.outputs = [dst if v is src else v for v in sp.outputs]
        if dst.type is None:
            dst.type = src.type
        self.replace_all_uses(src, dst, keep_outputs_of=None)
        self.touch(sp)
        return True

    def add_const(self, g: Graph, name: str, array: np.ndarray) -> Value:
        return add_const(g, name, array)

    def make_const(self, v: Value, array: np.ndarray) -> None:
        """Turn ``v`` (an output of a node about to be removed) into an initializer of the
        producer's graph holding ``array``."""
        g = v.producer.graph
        array = np.asarray(array, order="C")
        v.const = array
        v.type = TensorType(DType.from_numpy(array.dtype), tuple(array.shape))
        v.meta.pop("sym", None)
        adopt_const(g, v)
        self.stale(*v.consumers())


def run_rules(model: Model, rules: Iterable[Rule], records: dict[str, PassRecord], *,
              infer: bool = True, budget: int | None = None,
              sweep: Iterable[Rule] | None = None,
              state: dict[str, Any] | None = None) -> Rewriter:
    """Apply ``rules`` to ``model`` until none applies; changes go into ``records`` (one
    per rule owner, created when missing). ``sweep``: the rules the first pass over the
    graph tries (the others are at a fixed point already; they still apply near changes);
    ``state``: the rules' scratch space, to share it with a later run on the same model.
    Returns the engine (for its counters)."""
    rules = list(rules)
    for r in rules:
        records.setdefault(r.owner, PassRecord(r.owner))
    rw = Rewriter(model, rules, records, infer=infer, budget=budget, sweep=sweep, state=state)
    rw.run()
    return rw


__all__ = ["NEIGHBOURHOOD", "Rewriter", "Rule", "apply_plan", "only_consumer", "ops", "producer",
           "run_rules", "single_reader"]


def apply_plan(rw: Rewriter, m: tuple[str, Callable[[Rewriter], bool | None]]) -> str | None:
    """``apply`` for rules whose ``match`` returns ``(label, do)``: ``do(rw)`` rewrites and
    returns False when it could not after all."""
    label, do = m
    return None if do(rw) is False else label


def producer(v: Value | None, reader: Node, *op_types: str) -> Node | None:
    """The producer of ``v`` when it is a standard op of ``op_types`` (any, if none given)
    in ``reader``'s graph: patterns never span graphs."""
    p = v.producer if v is not None else None
    if p is None or p.graph is None or p.graph is not reader.graph or p.domain != "":
        return None
    return p if not op_types or p.op_type in op_types else None


def single_reader(v: Value | None, reader: Node, *op_types: str) -> Node | None:
    """:func:`producer` of ``v``, when ``reader`` is the only use of ``v``."""
    p = producer(v, reader, *op_types)
    return p if p is not None and v.only_reader(reader) else None


def only_consumer(v: Value, *op_types: str) -> Node | None:
    """The one node reading ``v`` (in ``v``'s producer's graph), if exactly one node does,
    nothing returns ``v``, and it is a standard op of ``op_types``."""
    if v.is_returned or not v.num_reads:
        return None
    it = v.readers()
    r = next(it)
    if any(n is not r for n in it):
        return None
    if v.producer is not None and r.graph is not v.producer.graph:
        return None
    if op_types and (r.domain != "" or r.op_type not in op_types):
        return None
    return r
