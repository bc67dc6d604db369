"""Fold an explicit constant ``Pad`` into the Conv, AveragePool or MaxPool that alone
reads it: the padding becomes the layer's own ``pads`` attribute.

Exporters write the same padding either way: PyTorch's ``nn.ZeroPad2d``/``F.pad`` before a
convolution, TensorFlow's "same" padding through tf2onnx, and some torchvision exports
write a ``Pad`` per depthwise convolution, which then costs a full copy of the activation
each (18 Pads were 26% of one MobileNetV2's time). Folded, every export of a model gets the
same fused layers.

Only zero padding of the spatial axes folds into Conv and AveragePool (the pool then
counts the padded zeros, ``count_include_pad=1``, as the explicit Pad made it do), and only
``-inf`` padding into MaxPool, whose own padding is never the maximum.
"""

from __future__ import annotations

import math

from kiln.ir import Node
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import RulePass, const_value
from kiln.passes.rewrite import Rewriter, Rule, ops, single_reader


class FoldPad(RulePass):
    """Pad -> Conv/AveragePool/MaxPool becomes the layer with larger ``pads``."""

    name = "fold_pad"
    level = 1

    def rules(self) -> list[Rule]:
        roots = ops("Conv", "AveragePool", "MaxPool") | ops("FusedConv", domain=KILN_DOMAIN)
        return [Rule("pad", roots, _match, _apply, _check)]


def _match(rw: Rewriter, layer: Node):
    if not layer.inputs or layer.inputs[0] is None:
        return None
    pad = single_reader(layer.inputs[0], layer, "Pad")
    return None if pad is None else (pad, layer)


def _amounts(rw: Rewriter, pad: Node) -> tuple[list[int], float] | None:
    """(pads as ONNX lists them, begins then ends per axis; the padding value), or None
    when either is not constant or the mode is not "constant"."""
    mode = pad.attrs.get("mode", "constant")
    if (mode.decode() if isinstance(mode, bytes) else mode) != "constant":
        return None
    opset = rw.opset(pad)
    if opset < 2:
        return None
    if opset < 11:
        return [int(p) for p in pad.attrs.get("pads", [])], float(pad.attrs.get("value", 0.0))
    pads = const_value(pad.inputs[1]) if len(pad.inputs) > 1 else None
    if pads is None:
        return None
    value = 0.0
    if len(pad.inputs) > 2 and pad.inputs[2] is not None:
        c = const_value(pad.inputs[2])
        if c is None or c.size != 1:
            return None
        value = float(c.reshape(-1)[0])
    pads = [int(p) for p in pads.reshape(-1)]
    if len(pad.inputs) > 3 and pad.inputs[3] is not None:  # opset 18: only these axes
        axes = const_value(pad.inputs[3])
        shape = pad.inputs[0].shape if pad.inputs[0] is not None else None
        if axes is None or shape is None:
            return None
        rank = len(shape)
        full = [0] * (2 * rank)
        axes = [int(a) % rank for a in axes.reshape(-1)]
        for k, a in enumerate(axes):
            full[a], full[rank + a] = pads[k], pads[len(axes) + k]
        pads = full
    return pads, value


def _check(rw: Rewriter, m) -> str | None:
    pad, layer = m
    got = _amounts(rw, pad)
    if got is None:
        return "Pad amounts or value not constant, or not constant mode"
    pads, value = got
    rank = len(pads) // 2
    if rank < 3 or any(p < 0 for p in pads) or pads[0] or pads[1] or pads[rank] \
            or pads[rank + 1]:
        return "pads batch/channel axes or crops"
    auto = layer.attrs.get("auto_pad", "NOTSET")
    if (auto.decode() if isinstance(auto, bytes) else auto) not in ("NOTSET", "VALID"):
        return "the layer pads itself (auto_pad SAME)"
    if layer.op_type == "MaxPool":
        return None if value == -math.inf else "MaxPool after a Pad by a finite value"
    if value != 0.0:
        return "Pad by a non-zero value"
    if layer.op_type == "AveragePool":
        if layer.attrs.get("ceil_mode", 0):
            return "AveragePool with ceil_mode"
        if not layer.attrs.get("count_include_pad", 0) and any(layer.attrs.get("pads") or []):
            return "AveragePool pads without counting them"
    return None


def _apply(rw: Rewriter, m) -> str | None:
    pad, layer = m
    pads, _ = _amounts(rw, pad)
    rank = len(pads) // 2
    n = rank - 2
    own = list(layer.attrs.get("pads") or [0] * (2 * n))
    add = pads[2:rank] + pads[rank + 2:]
    attrs = dict(layer.attrs)
    attrs["pads"] = [a + b for a, b in zip(own, add)]
    attrs.pop("auto_pad", None)
    if layer.op_type == "AveragePool":
        attrs["count_include_pad"] = 1
    new = Node(layer.op_type, [pad.inputs[0]] + list(layer.inputs[1:]), [None], attrs,
               domain=layer.domain, name=layer.name)
    new.outputs = list(layer.outputs)
    rw.replace([pad, layer], [new])
    return f"Pad folded into {layer.op_type}"
