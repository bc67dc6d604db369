"""Operators that the ONNX spec defines as functions of other operators (e.g. Celu,
Range, MeanVarianceNormalization): their spec bodies, as IR Functions, for ops Kiln has
no kernel for."""

from __future__ import annotations

import functools

import onnx

from kiln.ir import Function, Node, TensorType
from kiln.onnxio.exporter import Names, attr, type_proto
from kiln.onnxio.importer import ModelImporter


def spec_function(node: Node, opset: int) -> Function | None:
    """The spec's function body for ``node`` at ``opset``, or None if the spec has none
    (or it depends on input types Kiln does not know yet)."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, node.domain)
    except onnx.defs.SchemaError:
        return None
    if schema.has_function:
        return _static_body(node.op_type, node.domain, schema.since_version)
    if schema.has_context_dependent_function:
        types = [v.type if v is not None else None for v in node.inputs]
        if any(v is not None and not isinstance(t, TensorType) for v, t in
               zip(node.inputs, types)):
            return None
        np_ = onnx.NodeProto(op_type=node.op_type, domain=node.domain)
        names = Names()
        np_.input.extend(names(v) for v in node.inputs)
        np_.output.extend(names(v) for v in node.outputs)
        for k, val in node.attrs.items():
            np_.attribute.append(attr(k, val, names, node))
        tps = [type_proto(t) for t in types]
        try:
            raw = schema.get_context_dependent_function(
                schema.since_version, np_.SerializeToString(),
                [t.SerializeToString() for t in tps])
        except Exception:  # noqa: BLE001 - the builder rejects what it cannot type
            return None
        fp = onnx.FunctionProto()
        fp.ParseFromString(raw)
        if not fp.node:
            return None
        return ModelImporter(onnx.ModelProto()).function(fp)
    return None


@functools.cache
def _static_body(op_type: str, domain: str, since: int) -> Function:
    schema = onnx.defs.get_schema(op_type, since, domain)
    fp = schema.function_body
    f = ModelImporter(onnx.ModelProto()).function(fp)
    f.attr_defaults = {**{k: _default(a) for k, a in schema.attributes.items()
                          if a.default_value.type != 0}, **f.attr_defaults}
    return f


def _default(a):
    return ModelImporter(onnx.ModelProto()).attr_value(a.default_value)
