"""Writing trained modules back to ONNX: a KilnModule is its own graph with the current
weights; ``nn.Sequential(kiln_module, *head)`` is that graph with the head's nodes
(exported by ``torch.onnx.export``) appended after it."""

from __future__ import annotations

import io

import onnx
import torch
from onnx import compose
from torch import nn

from kiln.errors import InputError
from kiln.ir import Model, plain_shape
from kiln.onnxio import load, to_proto
from kiln.train.module import KilnModule


def module_to_model(obj) -> Model | None:
    """The Model :func:`kiln.save` writes for ``obj``, or None when ``obj`` is not a module
    built on kiln.to_torch."""
    if isinstance(obj, KilnModule):
        return obj.kiln_model()
    if isinstance(obj, nn.Sequential) and len(obj) and isinstance(obj[0], KilnModule):
        if len(obj) == 1:
            return obj[0].kiln_model()
        return _with_head(obj[0], nn.Sequential(*list(obj)[1:]))
    return None


def _with_head(body: KilnModule, head: nn.Module) -> Model:
    base = to_proto(body.kiln_model())
    outs = list(base.graph.output)
    if len(outs) != 1:
        raise InputError(f"a head can follow a graph with one output; this one has "
                         f"{[o.name for o in outs]}: cut it with outputs=[name]")
    v = body.kiln_graph_model.graph.outputs[0]
    shape = plain_shape(v.type.shape) if v.type is not None and \
        getattr(v.type, "shape", None) is not None else None
    if shape is None:
        raise InputError(f"the shape of {v.name!r} is unknown, so the head cannot be "
                         "exported; give the model's inputs fixed or symbolic shapes")
    sample = torch.zeros([d if isinstance(d, int) else 2 for d in shape],
                         device=next(head.parameters(), torch.zeros(0)).device)
    dynamic = {i: f"d{i}" for i, d in enumerate(shape) if not isinstance(d, int)}
    buf = io.BytesIO()
    was = head.training
    head.eval()
    try:
        torch.onnx.export(head, (sample,), buf, dynamo=False, input_names=["x"],
                          output_names=["y"], opset_version=max(base.opset_import[0].version, 7)
                          if base.opset_import else 17,
                          dynamic_axes={"x": dynamic, "y": {0: "d0"}} if dynamic else None)
    finally:
        head.train(was)
    tail = onnx.load_from_string(buf.getvalue())
    tail.ir_version = base.ir_version
    opsets = {o.domain: o.version for o in base.opset_import}
    for o in tail.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = opsets.get("", opsets.get("ai.onnx", o.version))
    merged = compose.merge_models(base, compose.add_prefix(tail, "head/"),
                                  io_map=[(outs[0].name, "head/x")])
    return load(merged)
