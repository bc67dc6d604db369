"""Fuse ShuffleNet's channel shuffle, as exporters write it, into one op:

    Reshape(x, [N, g, C/g, *S]) -> Transpose(perm=[0, 2, 1, 3, ...]) -> Reshape([N, C, *S])
        -> ai.kiln.ChannelShuffle(x, group=g)

``x`` has a known channel count and spatial sizes (the batch may be symbolic: the shapes'
first entry is 0, -1 or the batch itself). On torch the op is one ``channel_shuffle`` in
the input's layout, faster than the three ops, which also copy an NHWC tensor to NCHW
(docs/performance.md).
"""

from __future__ import annotations

from kiln.ir import Node, Value
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import RulePass, const_value
from kiln.passes.rewrite import Rewriter, Rule, only_consumer, ops, producer


class FuseChannelShuffle(RulePass):
    """Reshape -> Transpose(0, 2, 1, ...) -> Reshape  ->  ChannelShuffle."""

    name = "fuse_channel_shuffle"
    level = 2
    stage = 2
    creates = ("ChannelShuffle",)

    def rules(self) -> list[Rule]:
        return [Rule("channel_shuffle", ops("Transpose"), _match, _apply)]


def _target(reshape: Node, batch) -> list[int] | None:
    """A Reshape's constant target shape with its first entry standing for ``batch``."""
    s = const_value(reshape.inputs[1]) if len(reshape.inputs) > 1 else None
    if s is None or s.ndim != 1 or s.size < 3:
        return None
    s = [int(d) for d in s]
    if reshape.attrs.get("allowzero", 0) and 0 in s:
        return None  # a zero that means zero, not "as the input"
    return s if s[0] in (0, -1) or s[0] == batch else None


def _match(rw: Rewriter, t: Node) -> tuple[Value, int, list[Node]] | None:
    """(x, group, [first Reshape, the Transpose, last Reshape])."""
    first = producer(t.inputs[0], t, "Reshape")
    last = only_consumer(t.outputs[0], "Reshape")
    x = first.inputs[0] if first is not None else None
    shape = x.shape if x is not None else None
    if last is None or shape is None or len(shape) < 3 or \
            only_consumer(first.outputs[0]) is not t or \
            not all(isinstance(d, int) for d in shape[1:]):
        return None
    rank = len(shape)
    if list(t.attrs.get("perm", [])) != [0, 2, 1] + list(range(3, rank + 1)):
        return None
    split, joined = _target(first, shape[0]), _target(last, shape[0])
    if split is None or joined is None or len(split) != rank + 1 or \
            split[3:] != list(shape[2:]) or joined[1:] != list(shape[1:]):
        return None
    g, per = split[1], split[2]
    if g < 1 or per < 1 or g * per != shape[1]:
        return None
    return x, g, [first, t, last]


def _apply(rw: Rewriter, m) -> str:
    x, g, nodes = m
    first, _, last = nodes
    fused = Node("ChannelShuffle", [x], [None], {"group": g}, domain=KILN_DOMAIN,
                 name=last.name or first.name)
    fused.outputs = [last.outputs[0]]
    rw.replace(nodes, [fused])
    return f"Reshape -> Transpose -> Reshape -> ChannelShuffle (group {g})"
