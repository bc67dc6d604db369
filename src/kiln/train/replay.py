"""A KilnModule under ``torch.onnx.export`` (the TorchScript exporter): the module's own
ONNX nodes are written into the export, not the torch ops its kernels happen to run.

Traced kernels are not ONNX's semantics (an integer Div, a Squeeze's axes, TopK, Softplus
through ``aten::logaddexp`` come back different or refused), so while an export runs the
module's forward is one ``torch.autograd.Function`` whose ``symbolic`` replays the graph
node by node, converted to the export's opset by ``onnx.version_converter`` when it
differs. Parameters and buffers are the Function's inputs, so the exporter stores them
as initializers under the exported module's ``state_dict`` keys.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper, version_converter

from kiln.errors import UnsupportedOpError
from kiln.onnxio import to_proto

_SUFFIX = {onnx.AttributeProto.FLOAT: "f", onnx.AttributeProto.INT: "i",
           onnx.AttributeProto.STRING: "s", onnx.AttributeProto.TENSOR: "t",
           onnx.AttributeProto.FLOATS: "f", onnx.AttributeProto.INTS: "i",
           onnx.AttributeProto.STRINGS: "s"}


def exported(module, inputs: list, run) -> Any:
    """``module``'s outputs on ``inputs`` (computed by ``run``), recorded for the exporter
    as the module's ONNX graph; None when the graph does not convert to the export's
    opset (the caller then lets the exporter trace the kernels' torch ops)."""
    slots = list(module._slots)
    tensors = [getattr(owner, attr) for _, owner, attr in slots]
    names = [v.name for v, _, _ in slots]
    graph = _at_opset(to_proto(module.kiln_model()), _export_opset())
    if graph is None:
        return None
    n_out = len(graph.graph.output)

    class Graph(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *xs):
            # the values only: the tracer would record the kernels' ops as this op's body
            state = torch._C._get_tracing_state()
            torch._C._set_tracing_state(None)
            try:
                out = run(list(xs[:len(inputs)]))
            finally:
                torch._C._set_tracing_state(state)
            return tuple(t.detach() for t in (out if isinstance(out, tuple) else (out,)))

        @staticmethod
        def symbolic(g, *vals):
            params = dict(zip(names, vals[len(inputs):]))
            outs = _replay(g, graph, list(vals[:len(inputs)]), params)
            return outs if n_out > 1 else outs[0]

    out = Graph.apply(*inputs, *tensors)
    return out[0] if n_out == 1 else tuple(out)


def _export_opset() -> int | None:
    """The opset the running torch.onnx.export writes (torch keeps it in its globals;
    None where this torch keeps it elsewhere)."""
    import importlib

    for name in ("torch.onnx._internal.torchscript_exporter._globals", "torch.onnx._globals"):
        try:
            glob = importlib.import_module(name).GLOBALS
        except (ImportError, AttributeError):
            continue
        return getattr(glob, "export_onnx_opset_version", None)
    return None


def _at_opset(proto: onnx.ModelProto, target: int | None) -> onnx.ModelProto | None:
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 1)
    if target == opset:
        return proto
    if target is None:
        return None
    try:
        return version_converter.convert_version(proto, target)
    except Exception:  # no adapter for some op between the two versions
        return None


def _replay(g, proto: onnx.ModelProto, inputs: list, params: dict) -> list:
    """Emit ``proto``'s nodes into the exporter's graph ``g``; returns its outputs."""
    env: dict[str, Any] = dict(zip([i.name for i in proto.graph.input], inputs))
    for init in proto.graph.initializer:
        env[init.name] = params[init.name] if init.name in params else \
            g.op("Constant", value_t=torch.from_numpy(np.array(numpy_helper.to_array(init))))
    for n in proto.graph.node:
        if n.domain not in ("", "ai.onnx") or any(
                a.type not in _SUFFIX for a in n.attribute):
            raise UnsupportedOpError(
                f"torch.onnx.export cannot write the Kiln module's node {n.name!r} "
                f"({n.domain or 'ai.onnx'}.{n.op_type}: another domain or a subgraph "
                "attribute); write the module with kiln.save", [n.op_type])
        args = [env[x] if x else _absent(g) for x in n.input]
        attrs = {f"{a.name}_{_SUFFIX[a.type]}": _attr(a) for a in n.attribute}
        if n.op_type == "Transpose" and "perm_i" not in attrs:
            # ONNX's default (reverse the axes); the exporter's Transpose requires perm
            rank = args[0].type().dim() if hasattr(args[0].type(), "dim") else None
            if rank is None:
                raise UnsupportedOpError(
                    f"torch.onnx.export cannot write Transpose {n.name!r} without perm on an "
                    "input of unknown rank; write the module with kiln.save", ["Transpose"])
            attrs["perm_i"] = list(range(rank))[::-1]
        out = g.op(n.op_type, *args, outputs=len(n.output), **attrs)
        for name, v in zip(n.output, out if len(n.output) > 1 else [out]):
            if name:
                env[name] = v
    return [env[o.name] for o in proto.graph.output]


def _absent(g):
    """An omitted optional input (written as the empty name)."""
    v = g.op("prim::Constant")
    v.setType(torch._C.OptionalType.ofTensor())
    return v


def _attr(a: onnx.AttributeProto):
    v = onnx.helper.get_attribute_value(a)
    if a.type == onnx.AttributeProto.TENSOR:
        return torch.from_numpy(np.array(numpy_helper.to_array(v)))
    if a.type == onnx.AttributeProto.STRING:
        return v.decode()
    if a.type == onnx.AttributeProto.STRINGS:
        return [s.decode() for s in v]
    return list(v) if a.type in (onnx.AttributeProto.INTS, onnx.AttributeProto.FLOATS) else v
