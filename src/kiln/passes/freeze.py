"""Freezing for inference: remove what only training needs or what does nothing.

- ``Dropout`` (not in training mode) and ``Identity`` pass their input through;
- no-ops: ``Cast``/``CastLike`` to the dtype the input already has, ``Reshape``/``Expand``/
  ``Slice`` whose output has the input's shape (steps of 1), ``Transpose`` by the identity
  permutation, ``Pad`` by zeros, ``Tile`` by ones, one-input ``Concat``/``Sum``/``Max``...,
  one-way ``Split``;
- training-only outputs: optional outputs nothing reads (BatchNormalization's running
  statistics, Dropout's mask, LayerNormalization's mean...) are dropped from their node, so
  its kernel may skip computing them;
- training mode: ``BatchNormalization`` with ``training_mode=1`` (``is_test=0`` before
  opset 7) normalizes with its running statistics instead of the batch's, and ``Dropout``
  with a constant true ``training_mode`` (``is_test=0`` before opset 7) passes its input
  through, as in inference. Not when the running statistics or the mask are read.

A removed node's readers read its input instead. When its output is a graph output (whose
name is the model's interface), the input's producer is made to compute that output
instead; when that is impossible too (the input is a graph input), the node stays.
"""

from __future__ import annotations

import onnx

from kiln.ir import Node
from kiln.onnxio.infer import op_schema
from kiln.ops import symdim
from kiln.passes.base import RulePass, const_value, dtype_of, shape_of
from kiln.passes.rewrite import Rewriter, Rule, ops

_VARIADIC_SAME = {"Concat", "Sum", "Max", "Min", "Mean"}
_UNTYPED = ("Identity", "Dropout")
_TYPED = ("Cast", "CastLike", "Reshape", "Expand", "Slice", "Tile", "Transpose", "Pad",
          "Split", *_VARIADIC_SAME)


class Freeze(RulePass):
    """Drop inference no-ops and training-only outputs."""

    name = "freeze"
    level = 1

    def rules(self) -> list[Rule]:
        return [Rule("passthrough", ops(*_UNTYPED), _match_passthrough, _remove,
                     _check_passthrough, needs_types=False),
                Rule("no-op", ops(*_TYPED), _match_passthrough, _remove, _check_passthrough),
                Rule("unused outputs", None, _match_unused_outputs, _drop_outputs,
                     needs_types=False),
                Rule("training mode", ops("BatchNormalization", "Dropout"), _match_training,
                     _to_inference, _check_training, needs_types=False)]


def _match_passthrough(rw: Rewriter, n: Node):
    if not n.outputs or n.outputs[0] is None or any(v is not None for v in n.outputs[1:]):
        return None
    src = passthrough(n, rw.opset(n))
    return None if src is None else (n, src)


def _check_passthrough(rw: Rewriter, m) -> str | None:
    n, src = m
    dst = n.outputs[0]
    if dst.is_output_of(n.graph) and (src.producer is None or src.producer.graph is not n.graph
                                      or src.is_output_of(n.graph)):
        return "its output is a graph output computed from a graph input"
    return None


def _remove(rw: Rewriter, m) -> str | None:
    n, src = m
    if not rw.bypass(src, n.outputs[0]):
        return None
    rw.remove(n)
    return f"{n.op_type} removed"


def passthrough(n: Node, opset: int):
    """The input ``n`` returns unchanged (None when ``n`` does real work)."""
    op = n.op_type
    x = n.inputs[0] if n.inputs else None
    if x is None:
        return None
    if op == "Identity":
        return x
    if op == "Dropout":
        training = n.inputs[2] if len(n.inputs) > 2 else None
        if training is not None:
            c = const_value(training)
            if c is None or bool(c.reshape(-1)[0]):
                return None
        if opset < 7 and not n.attrs.get("is_test", 0):
            return None  # old Dropout is in training mode unless told otherwise
        mask = n.outputs[1] if len(n.outputs) > 1 else None
        if mask is not None:
            return None  # drop_unused_outputs removes the mask first when unread
        return x
    out = n.outputs[0] if n.outputs else None
    if out is None:
        return None
    if op in ("Cast", "CastLike"):
        a, b = dtype_of(x), dtype_of(out)
        return x if a is not None and a == b else None
    if op in ("Reshape", "Expand", "Slice", "Tile"):
        if op == "Slice" and not _unit_steps(n, opset):
            return None
        if op == "Tile":
            reps = symdim.known_ints(symdim.sym_of(n.inputs[1]) if len(n.inputs) > 1 else None)
            return x if reps is not None and all(r == 1 for r in reps) else None
        return x if _same_shape(shape_of(x), shape_of(out)) else None
    if op == "Transpose":
        perm = n.attrs.get("perm")
        rank = len(shape_of(x)) if shape_of(x) is not None else None
        if perm is None:
            return x if rank is not None and rank <= 1 else None
        return x if list(perm) == list(range(len(perm))) else None
    if op == "Pad":
        pads = n.attrs.get("pads") if opset < 11 else \
            symdim.known_ints(symdim.sym_of(n.inputs[1]) if len(n.inputs) > 1 else None)
        return x if pads is not None and all(p == 0 for p in pads) else None
    if op in _VARIADIC_SAME and len(n.inputs) == 1:
        return x
    if op == "Split" and len(n.outputs) == 1:
        # one output is the input only where the sizes (if given) are that one whole part:
        # other sizes make the model invalid, which the kernel reports (onnxruntime too)
        given = n.attrs.get("split") if opset < 13 else (
            symdim.known_ints(symdim.sym_of(n.inputs[1])) if len(n.inputs) > 1 and
            n.inputs[1] is not None else None)
        if given is None and (opset < 13 or len(n.inputs) < 2 or n.inputs[1] is None):
            return x
        shape = shape_of(x)
        ax = n.attrs.get("axis", 0)
        if given is not None and len(given) == 1 and shape is not None and \
                -len(shape) <= ax < len(shape) and shape[ax] == given[0]:
            return x
    return None


def _unit_steps(n: Node, opset: int) -> bool:
    if opset < 10 or len(n.inputs) < 5 or n.inputs[4] is None:
        return True
    steps = symdim.known_ints(symdim.sym_of(n.inputs[4]))
    return steps is not None and all(s == 1 for s in steps)


def _same_shape(a, b) -> bool:
    """Both shapes fully known and equal dim by dim."""
    if a is None or b is None or len(a) != len(b):
        return False
    return all(symdim.same(x, y) for x, y in zip(a, b))


def _match_unused_outputs(rw: Rewriter, n: Node):
    """Indices of unread optional outputs of ``n`` (None if there are none)."""
    if n.domain != "" or len(n.outputs) < 2:
        return None
    if all(v is None or v.is_used() for v in n.outputs[1:]):
        return None
    schema = op_schema(n.op_type, rw.model.opset_imports.get("", rw.model.opset), "")
    if schema is None:
        return None
    formal = list(schema.outputs)
    if not formal or formal[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        return None
    drop = [i for i, v in enumerate(n.outputs) if i >= 1 and v is not None and
            i < len(formal) and not v.is_used() and
            formal[i].option == onnx.defs.OpSchema.FormalParameterOption.Optional]
    return (n, drop) if drop else None


def _drop_outputs(rw: Rewriter, m) -> str | None:
    """Set unread optional outputs to None (trailing ones are removed), so the kernel may
    skip computing them."""
    n, drop = m
    outs = [None if i in drop else v for i, v in enumerate(n.outputs)]
    while len(outs) > 1 and outs[-1] is None:
        outs.pop()
    n.outputs = outs
    rw.touch(n)
    rw.records["freeze"].add(f"unused {n.op_type} outputs dropped", len(drop) - 1)
    return f"unused {n.op_type} outputs dropped"


def _match_training(rw: Rewriter, n: Node):
    """A BatchNormalization or Dropout in training mode (a constant says so)."""
    opset = rw.opset(n)
    if opset < 7 and n.attrs.get("is_test", 0) == 0:
        return n
    if n.op_type == "BatchNormalization":
        return n if opset >= 14 and n.attrs.get("training_mode", 0) == 1 else None
    if opset >= 12 and len(n.inputs) > 2 and n.inputs[2] is not None:
        c = const_value(n.inputs[2])
        return n if c is not None and c.size and bool(c.reshape(-1)[0]) else None
    return None


def _check_training(rw: Rewriter, n: Node) -> str | None:
    if any(v is not None and v.is_used() for v in n.outputs[1:]):
        what = "running statistics" if n.op_type == "BatchNormalization" else "mask"
        return f"its {what} output is read"
    return None


def _to_inference(rw: Rewriter, n: Node) -> str | None:
    """Switch the node to inference: its unread training outputs go, the flag flips."""
    n.outputs = n.outputs[:1]
    if rw.opset(n) < 7:
        n.attrs["is_test"] = 1
    elif n.op_type == "BatchNormalization":
        n.attrs.pop("training_mode", None)
    else:
        ins = list(n.inputs[:2])
        while len(ins) > 1 and ins[-1] is None:
            ins.pop()
        n.inputs = ins
    rw.stale(n)
    rw.touch(n)
    return f"{n.op_type} training mode turned off"
