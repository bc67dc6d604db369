"""ONNX's own shape/type inference for one IR node: the node as a NodeProto, its inputs'
types (and small constant contents, for data-dependent ops), ONNX's inference function,
and the outputs' types back in the IR."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import numpy as np
import onnx
from onnx import numpy_helper

from kiln.ir import DType, Node, TensorType, Value
from kiln.onnxio.exporter import Names, attr, type_proto
from kiln.onnxio.importer import value_type

log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=4096)
def op_schema(op_type: str, opset: int, domain: str):
    """ONNX's schema of the op at ``opset``, None when ONNX does not define it."""
    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None


def onnx_infer(n: Node, opset: int, opset_imports: dict[str, int],
               data_of: Callable[[Value], np.ndarray | None] = lambda v: None) -> list:
    """Output types from ONNX's own inference function for ``n`` (None where it says
    nothing or fails); ``data_of(value)`` gives the contents it may use, if known."""
    spec = op_schema(n.op_type, opset, n.domain)
    if spec is None:
        return [None] * len(n.outputs)
    proto = onnx.NodeProto(op_type=n.op_type, domain=n.domain)
    names, types, data = [], {}, {}
    for i, v in enumerate(n.inputs):
        if v is None:
            names.append("")
            continue
        name = f"in{i}"
        names.append(name)
        types[name] = type_proto(v.type) if v.type is not None else onnx.TypeProto()
        arr = data_of(v)
        if arr is not None:
            data[name] = numpy_helper.from_array(arr, name)
    proto.input.extend(names)
    proto.output.extend(f"out{i}" if v is not None else "" for i, v in enumerate(n.outputs))
    try:
        for key, val in n.attrs.items():
            proto.attribute.append(attr(key, val, Names(), n))
        res = onnx.shape_inference.infer_node_outputs(
            spec, proto, types, data,
            opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opset_imports.items()])
    except Exception as e:  # noqa: BLE001 - ONNX rejects what it cannot type; keep going
        log.debug("ONNX inference for %s failed: %s", n.op_type, e)
        return [None] * len(n.outputs)
    out = []
    for i, v in enumerate(n.outputs):
        tp = res.get(f"out{i}") if v is not None else None
        t = None
        if tp is not None:
            try:
                t = value_type(tp)
            except Exception:  # noqa: BLE001
                t = None
        if isinstance(t, TensorType) and t.dtype == DType.UNDEFINED:
            t = None
        out.append(t)
    return out
