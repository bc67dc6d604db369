"""Kiln IR -> ONNX ModelProto, and ``save`` with large weights as external data."""

from __future__ import annotations

import errno
import os
import re
import socket
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper
from onnx.external_data_helper import (
    convert_model_to_external_data,
    write_external_data_tensors,
)

from kiln.errors import InputError, SaveError
from kiln.ir import (
    AttrRef,
    Function,
    Graph,
    MapType,
    Model,
    Node,
    OptionalType,
    SequenceType,
    TensorType,
    Value,
    ValueType,
)
from kiln.onnxio.tensors import from_array

A = onnx.AttributeProto


def type_proto(t: ValueType | None) -> onnx.TypeProto:
    """ONNX TypeProto for an IR type (an empty proto when the type is unknown)."""
    tp = onnx.TypeProto()
    if isinstance(t, TensorType):
        tp.tensor_type.elem_type = int(t.dtype)
        if t.shape is not None:
            shape = tp.tensor_type.shape
            shape.SetInParent()
            for d in t.shape:
                dim = shape.dim.add()
                if isinstance(d, int):
                    dim.dim_value = d
                elif d is not None:
                    dim.dim_param = str(d)
    elif isinstance(t, SequenceType):
        tp.sequence_type.elem_type.CopyFrom(type_proto(t.elem))
    elif isinstance(t, OptionalType):
        tp.optional_type.elem_type.CopyFrom(type_proto(t.elem))
    elif isinstance(t, MapType):
        tp.map_type.key_type = int(t.key)
        tp.map_type.value_type.CopyFrom(type_proto(t.value))
    return tp


FunctionSource = Callable[[Node, dict[str, int]], "onnx.FunctionProto | None"]
_function_source: FunctionSource | None = None


def set_function_source(source: FunctionSource | None) -> None:
    """Where saving gets a model-local function body for a node (``source(node, opsets)``,
    None for nodes that need none): Kiln's op definitions (layered above this module) own
    the bodies of Kiln's own ops and register them here when imported."""
    global _function_source
    _function_source = source


class Names:
    """Gives every Value one unique name across the whole model (passes may create clashes):
    call it with a Value for its name in the proto. Also collects the function bodies the
    model's nodes call (see :func:`set_function_source`)."""

    def __init__(self, opsets: dict[str, int] | None = None):
        self.by_value: dict[Value, str] = {}
        self.taken: set[str] = set()
        self.opsets = opsets or {}
        self.bodies: dict[tuple[str, str, str], onnx.FunctionProto] = {}

    def __call__(self, v: Value | None) -> str:
        if v is None:
            return ""
        name = self.by_value.get(v)
        if name is None:
            base = name = v.name or "v"
            k = 1
            while name in self.taken:
                name, k = f"{base}__{k}", k + 1
            self.taken.add(name)
            self.by_value[v] = name
        return name


def to_proto(model: Model) -> onnx.ModelProto:
    """The ModelProto for ``model`` (all tensors inline)."""
    names = Names(model.opset_imports)
    graph = _graph(model.graph, names, top=True)
    opsets = [helper.make_opsetid(d, v) for d, v in sorted(model.opset_imports.items())]
    proto = helper.make_model(graph, opset_imports=opsets, producer_name=model.producer_name
                              or "kiln", producer_version=model.producer_version)
    # function overloads (one body per variant of a fused op) need IR 10
    proto.ir_version = max(model.ir_version, 10 if names.bodies else 3)
    proto.domain, proto.model_version, proto.doc_string = (model.domain, model.model_version,
                                                           model.doc)
    for k, v in model.metadata.items():
        proto.metadata_props.add(key=k, value=v)
    regenerated = {(d, n) for d, n, _ in names.bodies}
    for f in model.functions.values():
        if (f.domain, f.name) not in regenerated:  # a body read from an earlier save
            proto.functions.append(_function(f))
    proto.functions.extend(names.bodies.values())
    return proto


def _graph(g: Graph, names: Names, top: bool = False) -> onnx.GraphProto:
    gp = onnx.GraphProto(name=g.name or "graph", doc_string=g.doc)
    for v in g.initializers.values():
        gp.initializer.append(from_array(v.const, names(v)))
    for v in g.inputs:
        gp.input.append(helper.make_value_info(names(v), type_proto(v.type)))
    for v in g.initializers.values():
        if v.meta.get("overridable"):
            gp.input.append(helper.make_value_info(names(v), type_proto(v.type)))
    for n in g.nodes:
        gp.node.append(_node(n, names))
    for v in g.outputs:
        gp.output.append(helper.make_value_info(names(v), type_proto(v.described_type())))
    io = {id(v) for v in g.inputs} | {id(v) for v in g.outputs}
    for n in g.nodes:
        for v in n.outputs:
            t = v.described_type() if v is not None and id(v) not in io else None
            if t is not None:
                gp.value_info.append(helper.make_value_info(names(v), type_proto(t)))
    return gp


def _node(n: Node, names: Names) -> onnx.NodeProto:
    np_ = onnx.NodeProto(op_type=n.op_type, domain=n.domain, name=n.name, doc_string=n.doc)
    np_.input.extend(names(v) for v in n.inputs)
    np_.output.extend(names(v) for v in n.outputs)
    for key, val in n.attrs.items():
        np_.attribute.append(attr(key, val, names, n))
    if _function_source is not None and n.domain not in ("", "ai.onnx"):
        body = _function_source(n, names.opsets)
        if body is not None:
            np_.overload = body.overload
            names.bodies.setdefault((body.domain, body.name, body.overload), body)
    return np_


def attr(key: str, val: Any, names: Names, node: Node | None = None) -> onnx.AttributeProto:
    """The AttributeProto of attribute ``key`` of ``node`` (value ``val``); subgraphs name
    their values with ``names``."""
    if isinstance(val, AttrRef):
        a = onnx.AttributeProto(name=key, ref_attr_name=val.name)
        a.type = _schema_attr_type(node, key) or A.INT
        return a
    if isinstance(val, Graph):
        return helper.make_attribute(key, _graph(val, names))
    if isinstance(val, np.ndarray):
        if key == "sparse_value":
            return helper.make_attribute(key, _sparse(val))
        return helper.make_attribute(key, from_array(val, ""))
    if isinstance(val, (TensorType, SequenceType, OptionalType, MapType)):
        return helper.make_attribute(key, type_proto(val))
    if isinstance(val, (list, tuple)):
        val = list(val)
        if not val:
            a = onnx.AttributeProto(name=key)
            a.type = _schema_attr_type(node, key) or A.INTS
            return a
        if isinstance(val[0], Graph):
            return helper.make_attribute(key, [_graph(g, names) for g in val])
        if isinstance(val[0], np.ndarray):
            return helper.make_attribute(key, [from_array(x, "") for x in val])
        if any(isinstance(x, float) for x in val):
            return helper.make_attribute(key, [float(x) for x in val], attr_type=A.FLOATS)
    if isinstance(val, bool):
        val = int(val)
    return helper.make_attribute(key, val)


def _schema_attr_type(node: Node | None, key: str) -> int | None:
    if node is None:
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, domain=node.domain)
        return int(schema.attributes[key].type)
    except Exception:  # noqa: BLE001 - custom ops and missing schemas have no answer
        return None


def _sparse(dense: np.ndarray) -> onnx.SparseTensorProto:
    flat = dense.ravel()
    idx = np.flatnonzero(flat).astype(np.int64)
    return helper.make_sparse_tensor(from_array(flat[idx], ""), from_array(idx, ""),
                                     list(dense.shape))


def _function(f: Function) -> onnx.FunctionProto:
    names = Names()
    for v in f.graph.inputs:
        names(v)
    nodes = [_node(n, names) for n in f.graph.nodes]
    fp = helper.make_function(
        f.domain, f.name, [names(v) for v in f.graph.inputs], [names(v) for v in f.graph.outputs],
        nodes, [helper.make_opsetid(d, v) for d, v in sorted(f.opset_imports.items())],
        attributes=[a for a in f.attr_names if a not in f.attr_defaults],
        doc_string=f.doc)
    for k, v in f.attr_defaults.items():
        fp.attribute_proto.append(attr(k, v, names))
    return fp


_CONVERTERS: list[Callable[[Any], Model | None]] = []


def register_converter(convert: Callable[[Any], Model | None]) -> None:
    """Let :func:`save` write objects other than a Model: ``convert(obj)`` returns the Model
    to write, or None when it does not know ``obj`` (kiln.train registers torch modules)."""
    _CONVERTERS.append(convert)


def save(model: Model, path: str | os.PathLike, external_data: bool | None = None,
         size_threshold: int = 1024) -> Path:
    """Write ``model`` (a Model, or a torch module built on :func:`kiln.to_torch`) as an
    ONNX file. Weights go to a ``.data`` file beside it when
    ``external_data`` is True, or (by default) when the model would not fit in one protobuf.

    The save is atomic: everything is written under temporary names in the target folder,
    flushed to disk, then renamed into place (the data file before the model), so a crash
    at any point leaves the previous model or the new one, each loadable. Re-saving over a
    model with external data writes the weights under a fresh name
    (``<file>.<token>.data``), because the old model keeps reading its own data file until
    the new model replaces it; the old data file is removed afterwards.

    The folder must exist (a typo in it is not silently created). A failed write (disk
    full, no permission) raises :class:`~kiln.errors.SaveError` and leaves the previous
    file as it was; temporary folders that killed saves of ``path`` left behind
    (``.<file>.*``) are removed by the next save."""
    path = Path(path)
    if not isinstance(model, Model):
        model = _converted(model)
    proto = to_proto(model)
    if external_data is None:
        external_data = proto.ByteSize() > 1_800_000_000
    folder = path.parent
    if not folder.is_dir():
        raise SaveError(f"cannot save {path}: the folder {folder} does not exist "
                        f"(create it first: mkdir -p {folder})", errno.ENOENT)
    if path.is_dir():
        raise SaveError(f"cannot save {path}: it is a folder; give a file name "
                        f"({path / 'model.onnx'}, say)", errno.EISDIR)
    _remove_stale_temps(path)
    try:
        _write(proto, path, external_data, size_threshold)
    except OSError as e:
        if isinstance(e, SaveError):
            raise
        why = {errno.ENOSPC: "the disk is full: free space or save elsewhere",
               errno.EDQUOT: "the disk quota is exceeded: free space or save elsewhere",
               errno.EACCES: "no permission to write there: save elsewhere",
               errno.EROFS: "the file system is read-only: save elsewhere"}.get(
                   e.errno, f"{e.strerror or e}")
        kept = " The file that was there is unchanged." if path.exists() else ""
        raise SaveError(f"could not save {path}: {why}.{kept}", e.errno) from e
    return path


# A save's temporary folder holds this file naming its host and process, so that a later
# save can tell a folder a killed save left from one a running save is writing.
_OWNER = ".kiln-save-owner"
_STALE_AFTER_S = 24 * 3600  # a folder without a readable owner, untouched this long


def _remove_stale_temps(path: Path) -> None:
    """Removes ``.<name>.*`` folders earlier saves of ``path`` left when they were killed:
    those whose owner process (on this host) is gone, or, without an owner file, untouched
    for a day. A running save's folder is never removed."""
    import shutil

    pattern = re.compile(r"\." + re.escape(path.name) + r"\.[A-Za-z0-9_]{8}")
    try:
        entries = list(path.parent.iterdir())
    except OSError:
        return
    for d in entries:
        if not pattern.fullmatch(d.name) or not d.is_dir() or d.is_symlink():
            continue
        if _abandoned(d):
            shutil.rmtree(d, ignore_errors=True)


def _abandoned(folder: Path) -> bool:
    try:
        host, _, pid = (folder / _OWNER).read_text().partition(":")
    except OSError:
        try:
            return time.time() - folder.stat().st_mtime > _STALE_AFTER_S
        except OSError:
            return False
    if host != socket.gethostname() or not pid.isdigit():
        try:  # another machine's save (a shared folder): only by age
            return time.time() - folder.stat().st_mtime > _STALE_AFTER_S
        except OSError:
            return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, owned by another user
        return False
    return False


def _write(proto: onnx.ModelProto, path: Path, external_data: bool,
           size_threshold: int) -> None:
    folder = path.parent
    stale = _kiln_data_files(path)
    with tempfile.TemporaryDirectory(prefix=f".{path.name}.", dir=folder) as tmp:
        (Path(tmp) / _OWNER).write_text(f"{socket.gethostname()}:{os.getpid()}")
        moves: list[tuple[Path, Path]] = []
        if external_data:
            location = path.name + ".data"
            if (folder / location).exists():
                location = f"{path.name}.{uuid.uuid4().hex[:8]}.data"
            convert_model_to_external_data(proto, all_tensors_to_one_file=True,
                                           location=location, size_threshold=size_threshold)
            write_external_data_tensors(proto, tmp)
            if (Path(tmp) / location).exists():
                moves.append((Path(tmp) / location, folder / location))
                stale.discard(folder / location)
        staged = Path(tmp) / path.name
        staged.write_bytes(proto.SerializeToString())
        moves.append((staged, path))
        for src, _ in moves:
            _fsync(src)
        for src, dst in moves:
            os.replace(src, dst)
        _fsync(folder)
    for old in stale:  # data the replaced model read; nothing references it now
        old.unlink(missing_ok=True)


def _converted(obj: Any) -> Model:
    for convert in _CONVERTERS:
        got = convert(obj)
        if got is not None:
            return got
    raise InputError(f"kiln.save writes a kiln Model, what kiln.quantize returns or a "
                     f"module built on kiln.to_torch, not {type(obj).__name__}")


def _kiln_data_files(path: Path) -> set[Path]:
    """The external-data files earlier saves of ``path`` wrote (``<file>.data``,
    ``<file>.<token>.data``)."""
    pattern = re.compile(re.escape(path.name) + r"(\.[0-9a-f]{8})?\.data")
    if not path.parent.is_dir():
        return set()
    return {p for p in path.parent.iterdir() if pattern.fullmatch(p.name)}


def _fsync(p: Path) -> None:
    """Flush ``p`` (a file, or a folder's entries) to disk; folders cannot be opened for
    this on Windows, where the rename is already durable enough."""
    try:
        fd = os.open(p, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
