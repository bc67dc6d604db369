"""Function bodies for Kiln's own ops (domain ``ai.kiln``): when a model is saved, each
fused node gets a model-local ONNX function written in standard ops, so onnxruntime and
other runtimes run a file ``kiln optimize`` wrote. Kiln itself keeps running its kernels.

An op definition owns its body (``OpDef.body``, attached with :func:`function_body`): a
function that writes the node's computation on a :class:`Body`. A body is specific to one
node's attributes, input dtype and present inputs, so every distinct variant is one
overload of the function (IR 10), shared by the nodes that have the same variant.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from kiln.ir import Node, TensorType
from kiln.onnxio import exporter
from kiln.onnxio.tensors import from_array
from kiln.ops import registry


class NoBody(Exception):
    """Raised by a body writer that cannot express this node in standard ops (the node is
    saved without a function: Kiln runs the file, other runtimes do not)."""


class Body:
    """A function body being written: its formal inputs and outputs, the nodes so far, and
    facts about the node it stands for (attributes, input types, the model's opset)."""

    def __init__(self, node: Node, opset: int):
        self.node = node
        self.attrs = dict(node.attrs)
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self.inputs = [f"in{i}" if v is not None else None for i, v in enumerate(node.inputs)]
        self.outputs = [f"out{i}" for i in range(len(node.outputs))]
        t = node.inputs[0].type if node.inputs and node.inputs[0] is not None else None
        self.dtype = t.dtype.numpy if isinstance(t, TensorType) and t.dtype.value else \
            np.dtype(np.float32)
        self._count = 0

    def input(self, i: int) -> str | None:
        """Formal input ``i``'s name, None when the node leaves it out."""
        return self.inputs[i] if i < len(self.inputs) else None

    def rank(self, i: int) -> int | None:
        """Input ``i``'s rank when known."""
        v = self.node.inputs[i] if i < len(self.node.inputs) else None
        t = v.type if v is not None else None
        return t.rank if isinstance(t, TensorType) else None

    def need_rank(self, i: int) -> int:
        """Input ``i``'s rank; a body that cannot be written without it is left out."""
        r = self.rank(i)
        if r is None:
            raise NoBody(f"{self.node.op_type}: the rank of input {i} is unknown")
        return r

    def op(self, op_type: str, *inputs: str | None, **attrs) -> str:
        """Add a node; returns its output's name."""
        self._count += 1
        out = f"t{self._count}"
        self.nodes.append(helper.make_node(op_type, [i or "" for i in inputs], [out],
                                           **attrs))
        return out

    def const(self, value, dtype=None) -> str:
        """A constant tensor (in the node's float type unless ``dtype`` says)."""
        self._count += 1
        out = f"c{self._count}"
        arr = np.asarray(value, dtype=dtype or self.dtype)
        self.nodes.append(helper.make_node("Constant", [], [out], value=from_array(arr, out)))
        return out

    def ints(self, values) -> str:
        """A constant int64 vector (axes, shapes)."""
        return self.const(list(values), np.int64)

    def reduce_mean(self, x: str, axes: list[int]) -> str:
        """ReduceMean over ``axes``, kept dims, in this opset's form."""
        if self.opset >= 18:
            return self.op("ReduceMean", x, self.ints(axes), keepdims=1)
        return self.op("ReduceMean", x, axes=axes, keepdims=1)

    def finish(self, *results: str) -> None:
        """Write ``results`` to the formal outputs."""
        for name, out in zip(results, self.outputs):
            self.nodes.append(helper.make_node("Identity", [name], [out]))


def function_body(op_type: str, since: int = 1, *, domain: str = registry.KILN_DOMAIN
                  ) -> Callable[[Callable], Callable]:
    """Decorator attaching a body writer (``fn(b: Body) -> None``) to ``op_type``."""

    def attach(fn: Callable) -> Callable:
        for d in registry.registered():
            if d.domain == domain and d.op_type == op_type and d.since >= since:
                d.body = fn
        return fn

    return attach


def function_for(node: Node, opsets: dict[str, int]) -> onnx.FunctionProto | None:
    """The model-local function (an overload per variant) standing for ``node``, or None
    when its op has no body."""
    d = registry.lookup(node.domain, node.op_type, opsets.get(node.domain, 1))
    if d is None or d.body is None:
        return None
    opset = opsets.get("", opsets.get("ai.onnx", 1))
    b = Body(node, opset)
    try:
        d.body(b)
    except NoBody:
        return None
    used = b.inputs[:max((i + 1 for i, n in enumerate(b.inputs) if n), default=0)]
    formal = [n or f"unused{i}" for i, n in enumerate(used)]
    fp = helper.make_function(node.domain, node.op_type, formal, b.outputs, b.nodes,
                              [helper.make_opsetid("", opset)],
                              attributes=sorted(node.attrs))
    # Nodes with the same body share one overload: name it by the body's contents.
    fp.overload = hashlib.sha1(fp.SerializeToString()).hexdigest()[:16]
    return fp


exporter.set_function_source(function_for)
