"""What onnxruntime does to a model before its session sees it, done on the ONNX proto:
initializers given by the session options (``add_initializer``, external initializers,
external-data files in memory), free dimensions by denotation, the ``ort_config`` a model
may carry, and sparse tensors (Kiln computes on dense arrays; the sparse inputs and outputs
are converted at the session's edge)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from kiln.errors import ModelLoadError


@dataclass
class Prepared:
    """A model ready for Kiln: ``source`` (path, bytes or proto) and ``base_dir`` for its
    external data, with the names of inputs and outputs onnxruntime declares sparse."""

    source: object
    base_dir: str | None = None
    sparse_inputs: set[str] = field(default_factory=set)
    sparse_outputs: set[str] = field(default_factory=set)


def read_proto(src, is_path: bool) -> onnx.ModelProto:
    """The ModelProto of ``src`` without its external data (Kiln reads that itself)."""
    if isinstance(src, onnx.ModelProto):
        return src
    try:
        if is_path:
            if not os.path.exists(src):
                raise ModelLoadError(f"no model file at {src}")
            return onnx.load(os.fspath(src), load_external_data=False)
        return onnx.load_from_string(bytes(src))
    except (DecodeError, ValueError, OSError) as e:
        raise ModelLoadError(f"the model is not a valid ONNX model (protobuf decode "
                             f"failed: {e})") from e


def ort_config(src, is_path: bool) -> dict:
    """The ``session_options`` of the model's ``ort_config`` metadata (ORT_LOAD_CONFIG_
    FROM_MODEL=1), {} when it has none."""
    proto = read_proto(src, is_path)
    for p in proto.metadata_props:
        if p.key == "ort_config":
            try:
                return dict(json.loads(p.value).get("session_options", {}))
            except (ValueError, AttributeError) as e:
                raise ModelLoadError(f"the model's ort_config metadata is not valid JSON "
                                     f"with a session_options object: {e}") from e
    return {}


def needs_edit(so) -> bool:
    """Whether the session options change the model itself."""
    return bool(so.initializers or so.external_initializers or so.files_in_memory
                or so.denotation_dims)


def has_sparse(proto: onnx.ModelProto) -> bool:
    g = proto.graph
    return any(vi.type.HasField("sparse_tensor_type") for vi in [*g.input, *g.output]) or any(
        a.type == onnx.AttributeProto.SPARSE_TENSOR for n in g.node for a in n.attribute) \
        or any(n.op_type == "SparseToDenseMatMul" for n in g.node)


def prepare(src, is_path: bool, so) -> Prepared:
    """``src`` edited as the session options ask, its sparse parts made dense."""
    proto = onnx.ModelProto()
    proto.CopyFrom(read_proto(src, is_path))
    base = str(Path(src).parent) if is_path else None
    g = proto.graph
    out = Prepared(proto, base)
    for vi in g.input:
        if vi.type.HasField("sparse_tensor_type"):
            out.sparse_inputs.add(vi.name)
    for vi in g.output:
        if vi.type.HasField("sparse_tensor_type"):
            out.sparse_outputs.add(vi.name)
    for vi in [*g.input, *g.output]:
        _dense_type(vi.type)
        for d in vi.type.tensor_type.shape.dim:
            if d.denotation in so.denotation_dims:
                d.dim_value = so.denotation_dims[d.denotation]
    for node in g.node:
        _dense_node(node)
    if any(n.op_type == "Gemm" for n in g.node) and not any(
            o.domain in ("", "ai.onnx") for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("", 13))  # for the Gemm above
    given = {**so.initializers, **so.external_initializers}
    for i, t in enumerate(g.initializer):
        if t.name in given:
            g.initializer[i].CopyFrom(numpy_helper.from_array(given[t.name], t.name))
        elif t.data_location == onnx.TensorProto.EXTERNAL:
            _from_memory(t, so.files_in_memory)
    return out


def _dense_type(tp: onnx.TypeProto) -> None:
    if tp.HasField("sparse_tensor_type"):
        s = tp.sparse_tensor_type
        tp.tensor_type.elem_type = s.elem_type
        if s.HasField("shape"):
            tp.tensor_type.shape.CopyFrom(s.shape)


def _dense_node(node: onnx.NodeProto) -> None:
    # onnxruntime takes a Constant whose `value` holds a SparseTensorProto (its own test
    # models have one); ONNX spells that `sparse_value`.
    if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
        for a in node.attribute:
            if a.name == "value" and a.type == onnx.AttributeProto.SPARSE_TENSOR:
                a.name = "sparse_value"
    if node.op_type == "SparseToDenseMatMul" and node.domain == "com.microsoft":
        # A (sparse, 2-D) times B (dense, 2-D), scaled: Gemm on the dense A.
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        node.op_type, node.domain = "Gemm", ""
        del node.attribute[:]
        node.attribute.extend([onnx.helper.make_attribute(k, attrs[k]) for k in
                               ("alpha", "transA", "transB") if k in attrs])


def _from_memory(t: onnx.TensorProto, files: dict[str, bytes]) -> None:
    info = {e.key: e.value for e in t.external_data}
    data = files.get(info.get("location", ""))
    if data is None:
        return
    offset = int(info.get("offset", 0))
    length = int(info.get("length", len(data) - offset))
    t.raw_data = data[offset:offset + length]
    del t.external_data[:]
    t.data_location = onnx.TensorProto.DEFAULT
