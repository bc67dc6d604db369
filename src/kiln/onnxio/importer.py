"""ONNX ModelProto -> Kiln IR. Protobuf objects stop here; nothing after sees them."""

from __future__ import annotations

import contextlib
import difflib
import functools
import mmap
import os
from collections import ChainMap
from collections.abc import Callable, Container
from pathlib import Path
from typing import Any, NamedTuple

import onnx
import onnx.defs
from google.protobuf.message import DecodeError

from kiln.errors import ModelLoadError
from kiln.ir import (
    AttrRef,
    DType,
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
    collector_paused,
    parse_dim,
)
from kiln.onnxio import rules, schema_file
from kiln.onnxio.tensors import raw_array, sparse_to_array, to_array
from kiln.onnxio.wire import Malformed, split_initializers

A = onnx.AttributeProto

# ONNX files cannot nest deeper than protobuf's 100-message decode limit (about 33 levels of
# If/Loop bodies); an in-memory ModelProto can, and would exhaust Python's stack later on.
MAX_SUBGRAPH_DEPTH = 64


def load(source: str | os.PathLike | bytes | onnx.ModelProto, base_dir=None) -> Model:
    """Import an ONNX model from a file path, serialized bytes or a ModelProto.

    External data is read only from ``base_dir`` (the model file's folder when loading a
    path); locations outside it are refused.
    """
    raw = None
    if isinstance(source, onnx.ModelProto):
        proto = source
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
        try:
            rest, spans = split_initializers(data)
        except Malformed:
            proto = _parse(data, "<bytes>")
        else:
            proto, raw = _parse(rest, "<bytes>"), RawData(spans, buffer=data)
    else:
        path = Path(source)
        if path.is_dir():
            inside = sorted(p.name for p in path.glob("*.onnx"))[:5]
            raise ModelLoadError(f"{path} is a folder, not a model file; give the .onnx file"
                                 + (f" (it holds {', '.join(inside)})" if inside else ""))
        if not path.is_file():
            raise ModelLoadError(f"no model file at {path}")
        base_dir = path.parent if base_dir is None else base_dir
        proto, raw = _read(path, str(source)[:80])
    _check_depth(proto)
    with raw or contextlib.nullcontext(), collector_paused():
        model = ModelImporter(proto, base_dir, raw).model()
    _save_schema_facts()
    return model


def _read(path: Path, what: str) -> tuple[onnx.ModelProto, RawData | None]:
    """The model at ``path``, its main graph's initializer bytes left in the file for
    :class:`RawData` to read into their arrays (a file not well-formed is parsed whole,
    which reports what is wrong)."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            rest, spans = split_initializers(mm)
    except (Malformed, ValueError, OSError):  # an empty file cannot be mapped
        return _parse(path.read_bytes(), what), None
    return _parse(rest, what), RawData(spans, path=path)


class RawData:
    """Where the bytes :func:`split_initializers` cut out are (a file or a buffer), read
    into each initializer's array when the importer reaches it; a context manager that
    closes the file."""

    def __init__(self, spans: list[tuple[int, int] | None], path: Path | None = None,
                 buffer: bytes | None = None):
        self.spans = spans
        self.path = path
        self.buffer = memoryview(buffer) if buffer is not None else None
        self.file = None

    def __enter__(self) -> RawData:
        return self

    def __exit__(self, *exc) -> None:
        if self.file is not None:
            self.file.close()

    def array(self, i: int, t: onnx.TensorProto, base_dir) -> Any:
        """The array of initializer ``i`` of the main graph, ``t`` its proto."""
        span = self.spans[i] if i < len(self.spans) else None
        if span is None:
            return to_array(t, base_dir)
        offset, length = span
        return raw_array(t, length, lambda out: self._fill(offset, out), base_dir)

    def _fill(self, offset: int, out: memoryview) -> None:
        if self.buffer is not None:
            out[:] = self.buffer[offset:offset + len(out)]
            return
        if self.file is None:
            self.file = open(self.path, "rb")  # noqa: SIM115 - closed by __exit__
        self.file.seek(offset)
        done = 0
        while done < len(out):
            n = self.file.readinto(out[done:])
            if not n:
                raise ModelLoadError(f"{self.path} changed while it was being read")
            done += n


def _parse(data: bytes, what: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as e:
        raise ModelLoadError(
            f"{what} is not a valid ONNX model (protobuf decode failed: {e}); the file may be "
            "truncated or not an .onnx file") from None
    if not proto.HasField("graph") or proto.ir_version <= 0:
        raise ModelLoadError(
            f"{what} is not a valid ONNX model (no graph or no ir_version); the file may be "
            "truncated or not an .onnx file")
    return proto


def _check_depth(proto: onnx.ModelProto) -> None:
    """Refuse subgraphs nested deeper than MAX_SUBGRAPH_DEPTH (walked without recursion)."""
    stack = [(proto.graph, 0)] + [(f, 0) for f in proto.functions]
    while stack:
        g, depth = stack.pop()
        if depth > MAX_SUBGRAPH_DEPTH:
            raise ModelLoadError(
                f"subgraphs are nested more than {MAX_SUBGRAPH_DEPTH} levels deep; Kiln (like "
                "protobuf's decoder for ONNX files) refuses such models")
        for n in g.node:
            for a in n.attribute:
                if a.type == A.GRAPH:
                    stack.append((a.g, depth + 1))
                elif a.type == A.GRAPHS:
                    stack.extend((sg, depth + 1) for sg in a.graphs)


def dtype_of(number: int, what: str) -> DType:
    """The DType of an ONNX element-type number, or ModelLoadError naming ``what``."""
    try:
        return DType(number)
    except ValueError:
        raise ModelLoadError(f"{what} has unknown element type {number}; the model is "
                             "malformed or needs a newer ONNX than Kiln knows") from None


def text(s: str | bytes, what: str) -> str:
    """A name from the proto; protobuf hands invalid UTF-8 over as bytes, which ONNX
    forbids (names and op types are UTF-8 strings)."""
    if isinstance(s, str):
        return s
    raise ModelLoadError(f"{what} {s!r} is not valid UTF-8; the model is malformed")


class _Schema(NamedTuple):
    """What load-time validation needs of an op's schema, kept per op version."""

    since: int
    inputs: tuple[int, int]
    outputs: tuple[int, int]
    attr_types: dict[str, int | None]
    """Attribute name -> AttributeProto type (None: any type)."""
    closed: bool
    """Whether an attribute the schema does not name is refused."""
    required: frozenset[str]
    single_inputs: tuple[int, ...] = ()
    """Positions of the inputs that must be given: an empty name there is malformed."""
    single_outputs: tuple[int, ...] = ()
    input_types: tuple = ()
    """Type constraints per formal input (:func:`kiln.onnxio.rules.input_types`)."""


def _singles(params) -> tuple[int, ...]:
    single = onnx.defs.OpSchema.FormalParameterOption.Single
    return tuple(i for i, p in enumerate(params) if p.option == single)


_ONNX_DOMAINS = ("", "ai.onnx.ml", "ai.onnx.preview.training")
_ANY_COUNT = (0, 2**31)
_UNDEFINED = object()

AttributeSource = Callable[[str, str, int], "tuple[int, frozenset[str] | None] | None"]
_attribute_source: AttributeSource | None = None

# onnx defines LayerNormalization-17 with AllowUncheckedAttributes, so onnx's checker and
# onnxruntime accept any extra attribute on it; it is the only standard op that does.
_OPEN_SCHEMAS = {("", "LayerNormalization", 17)}


def set_attribute_source(source: AttributeSource | None) -> None:
    """Where load-time validation learns of ops ONNX's schemas do not define
    (``source(domain, op_type, opset) -> (since, attribute names or None where unchecked)``,
    None where it does not know the op): Kiln's op definitions (layered above this module)
    register here when imported. An op in ONNX's own domains that neither knows is refused."""
    global _attribute_source
    _attribute_source = source


def _schema(op_type: str, domain: str, version: int) -> _Schema | None:
    s = _onnx_schema(op_type, domain, version)
    if s is not None:
        return s
    # Not cached: ops registered after a model was loaded count for the next one.
    known = _attribute_source(domain, op_type, version) if _attribute_source else None
    if known is None:
        return None  # custom domains and model-local functions: their kernels check
    since, names = known
    return _Schema(since, _ANY_COUNT, _ANY_COUNT, dict.fromkeys(names or ()),
                   names is not None, frozenset())


def _onnx_schema(op_type: str, domain: str, version: int) -> _Schema | None:
    known, unsaved = _schema_facts()
    key = f"{domain}|{op_type}|{version}"
    got = known.get(key, ())
    if isinstance(got, list):  # as read from the file
        got = known[key] = _schema_from_list(got)
    if got == ():
        try:
            s = onnx.defs.get_schema(op_type, version, domain)
        except onnx.defs.SchemaError:
            got = None
        else:
            got = _Schema(s.since_version, (s.min_input, s.max_input),
                          (s.min_output, s.max_output),
                          {name: int(a.type) for name, a in s.attributes.items()},
                          (domain, op_type, s.since_version) not in _OPEN_SCHEMAS,
                          frozenset(name for name, a in s.attributes.items() if a.required),
                          _singles(s.inputs), _singles(s.outputs), rules.input_types(s))
        known[key] = got
        unsaved.add(key)
    return got


def _schema_as_list(s: _Schema) -> list:
    """``s`` as the schema file keeps it (JSON has no tuples or sets)."""
    return [s.since, s.inputs, s.outputs, s.attr_types, s.closed, sorted(s.required),
            s.single_inputs, s.single_outputs,
            [s.input_types[0] and [[n, sorted(a)] for n, a in s.input_types[0]],
             s.input_types[1]] if s.input_types else []]


def _schema_from_list(kept: list) -> _Schema | tuple:
    """The schema a file entry holds; () where it is not in this format."""
    try:
        since, ins, outs, types, closed, required, single_in, single_out, in_types = kept
        in_types = (tuple((str(n), frozenset(a)) for n, a in in_types[0]),
                    bool(in_types[1])) if in_types else ()
        return _Schema(int(since), tuple(ins), tuple(outs), dict(types), bool(closed),
                       frozenset(required), tuple(single_in), tuple(single_out), in_types)
    except (TypeError, ValueError):
        return ()


@functools.cache
def _schema_facts() -> tuple[dict, set]:
    """The schema facts known in this process (read once from :mod:`schema_file`) and the
    keys found since, not yet written back."""
    return schema_file.read(schema_file.path()), set()


def _save_schema_facts() -> None:
    known, unsaved = _schema_facts()
    if unsaved:
        unsaved.clear()
        schema_file.write(schema_file.path(), {
            k: s if s is None or isinstance(s, list) else _schema_as_list(s)
            for k, s in list(known.items())})


class _NodeWhere:
    """How errors name a node, formatted only when one is raised (a long graph's nodes
    would otherwise each build the text once)."""

    __slots__ = ("name", "op_type")

    def __init__(self, name: str, op_type: str):
        self.name, self.op_type = name, op_type

    def __str__(self) -> str:
        return f"node {self.name or self.op_type!r} ({self.op_type})"


def check_node(np_: onnx.NodeProto, domain: str, opsets: dict[str, int],
               where: str | _NodeWhere, input_names: list[str], output_names: list[str],
               local_functions: Container[tuple[str, str]] = ()
               ) -> tuple[int, tuple] | None:
    """The op exists (in ONNX's own domains), input/output counts and required ones named,
    attribute names (unknown, repeated, required) and attribute types against the op's
    schema (onnxruntime rejects the same graphs); the schema lookup is cached per op type
    and opset. ``input_names``/``output_names`` are the node's, read from it once. Returns
    the op version the node runs (its schema's) and its inputs' type constraints, None where
    no schema checks it; the attributes' values and the inputs' types are checked against
    :mod:`kiln.onnxio.rules` once they are read."""
    # A model that imports no default-domain opset runs its ONNX ops at opset 1 (Model.opset)
    version = opsets.get(domain, 1 if domain == "" else None)
    if version is None and (domain, np_.op_type) not in local_functions:
        raise ModelLoadError(  # onnxruntime refuses it too, used or not
            f"{where}: its domain {domain!r} has no entry in the model's opset_import; a "
            f"model must import every domain its nodes use (add opset_import "
            f"{{domain: {domain!r}, version: N}})")
    schema = None if version is None else _schema(np_.op_type, domain, version)
    if schema is None and version is not None and domain in _ONNX_DOMAINS and \
            (domain, np_.op_type) not in local_functions:
        raise ModelLoadError(
            f"{where}: {domain or 'ai.onnx'} has no op {np_.op_type!r} at opset {version}; "
            f"the model is malformed, or needs a newer ONNX than the installed "
            f"onnx {onnx.__version__}")
    if schema is None:  # onnxruntime refuses repeated attributes on any node
        names = [a.name for a in np_.attribute]
        if len(set(names)) < len(names):
            raise ModelLoadError(f"{where}: an attribute appears twice in {names}; the model "
                                 "is malformed")
        return None
    for kind, names, (lo, hi), singles in (
            ("inputs", input_names, schema.inputs, schema.single_inputs),
            ("outputs", output_names, schema.outputs, schema.single_outputs)):
        n = len(names)
        if not lo <= n <= hi:
            want = str(lo) if lo == hi else f"{lo} to {hi}" if hi < 2**30 else f"at least {lo}"
            raise ModelLoadError(f"{where} has {n} {kind}, but {np_.op_type}-{schema.since} "
                                 f"takes {want}; the model is malformed")
        for i in singles:
            if i < n and not names[i]:
                raise ModelLoadError(
                    f"{where}: its {kind[:-1]} {i} has an empty name, but "
                    f"{np_.op_type}-{schema.since} requires it; the model is malformed")
    types = schema.attr_types
    seen = set()
    for a in np_.attribute:
        name = a.name  # each read of a protobuf field builds a new object: read once
        if name in seen:
            raise ModelLoadError(f"{where}: attribute {name!r} appears twice; the model is "
                                 "malformed")
        seen.add(name)
        _check_data_field(a, name, where)
        want_type = types.get(name, _UNDEFINED)
        if want_type is _UNDEFINED:
            # Names starting with "__" are ONNX's internal symbols, which schemas never check.
            if schema.closed and not (isinstance(name, str) and name.startswith("__")):
                raise ModelLoadError(_unknown_attribute(np_, name, schema, where))
        elif want_type is not None and a.type != want_type and not a.ref_attr_name:
            got = A.AttributeType.Name(a.type) if a.type in A.AttributeType.values() else a.type
            raise ModelLoadError(
                f"{where}: attribute {name!r} is {got}, but {np_.op_type} takes "
                f"{A.AttributeType.Name(want_type)}; the model is malformed")
    if not schema.required <= seen:
        missing = ", ".join(map(repr, sorted(schema.required - seen)))
        raise ModelLoadError(f"{where} lacks {np_.op_type}-{schema.since}'s required "
                             f"attribute {missing}; the model is malformed")
    return schema.since, schema.input_types


_DATA_FIELDS = {A.FLOAT: "f", A.INT: "i", A.STRING: "s", A.TENSOR: "t", A.GRAPH: "g",
                A.SPARSE_TENSOR: "sparse_tensor", A.TYPE_PROTO: "tp", A.FLOATS: "floats",
                A.INTS: "ints", A.STRINGS: "strings", A.TENSORS: "tensors",
                A.GRAPHS: "graphs", A.SPARSE_TENSORS: "sparse_tensors",
                A.TYPE_PROTOS: "type_protos"}
_NOT_DATA = frozenset({"name", "type", "doc_string", "ref_attr_name"})


def _check_data_field(a: onnx.AttributeProto, name: object, where: object) -> None:
    """The attribute's value sits in the field its type names (onnxruntime refuses "type
    field and data field mismatch"): Kiln reads the field the type names, so a value
    elsewhere would be silently replaced by that field's default."""
    data = {f.name for f, _ in a.ListFields()} - _NOT_DATA
    if data and data != {_DATA_FIELDS.get(a.type)}:
        raise ModelLoadError(
            f"{where}: attribute {name!r} says its type is "
            f"{A.AttributeType.Name(a.type) if a.type in A.AttributeType.values() else a.type}"
            f" but holds its value in {', '.join(sorted(data))}; the model is malformed")


def _unknown_attribute(np_: onnx.NodeProto, name: str | bytes, schema: _Schema,
                       where: str) -> str:
    valid = sorted(schema.attr_types)
    op = f"{np_.op_type}-{schema.since}"
    if isinstance(name, bytes) or not name:
        what = "an attribute with no name" if not name else \
            f"attribute {name!r}, whose name is not valid UTF-8"
    else:
        what = f"unknown attribute {name!r}"
        close = difflib.get_close_matches(name, valid, n=1)
        if close:
            what += f" (did you mean {close[0]!r}?)"
    takes = f"takes {', '.join(map(repr, valid))}" if valid else "takes no attributes"
    return f"{where} has {what}; {op} {takes}; remove or rename it"


def _declared_type(vi: onnx.ValueInfoProto, what: str = "input") -> ValueType | None:
    """A graph input's or output's declared type. A tensor must name its element type: type
    0 (UNDEFINED) leaves a feed unchecked and the passes untyped; onnxruntime refuses it."""
    t = value_type(vi.type)
    if isinstance(t, TensorType) and t.dtype == DType.UNDEFINED:
        raise ModelLoadError(f"{what} {vi.name!r} declares element type 0 (UNDEFINED); give "
                             "it its element type")
    return t


def value_type(tp: onnx.TypeProto) -> ValueType | None:
    """IR type of an ONNX TypeProto (None when the proto declares nothing)."""
    kind = tp.WhichOneof("value")
    if kind in ("tensor_type", "sparse_tensor_type"):
        t = getattr(tp, kind)
        shape = None
        if t.HasField("shape"):
            # Exporters write a dynamic dim as -1, 0 or an empty name too; onnxruntime
            # accepts any size there, so those are unknown dims here, not fixed ones.
            shape = tuple(
                d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else
                (_named_dim(text(d.dim_param, "a dim name")) if d.dim_param else None)
                for d in t.shape.dim)
        return TensorType(dtype_of(t.elem_type, "a tensor type"), shape)
    if kind == "sequence_type":
        return SequenceType(value_type(tp.sequence_type.elem_type))
    if kind == "optional_type":
        return OptionalType(value_type(tp.optional_type.elem_type))
    if kind == "map_type":
        return MapType(dtype_of(tp.map_type.key_type, "a map key"),
                       value_type(tp.map_type.value_type))
    return None


@functools.cache
def _known_opsets() -> dict[str, tuple[int, int]]:
    """ONNX's own domains and the opset range the installed onnx defines for each."""
    return dict(onnx.defs.C.schema_version_map())


def _check_opsets(opsets: dict[str, int], what: str) -> None:
    """An opset of ONNX's own domains past what the installed onnx defines (onnxruntime
    refuses such a model: its ops' meaning is unknown) or below 1 is refused here, before
    any schema lookup sees a number it cannot take."""
    for domain, version in opsets.items():
        known = _known_opsets().get(domain)
        if known is not None and not 1 <= version <= known[1]:
            raise ModelLoadError(
                f"{what} imports opset {version} of {domain or 'ai.onnx'}, but the installed "
                f"onnx {onnx.__version__} defines opsets 1 to {known[1]}; convert the model "
                "to a defined opset (onnx.version_converter) or upgrade onnx")


def _shape(v: Value | None) -> tuple | None:
    t = v.type if v is not None else None
    return t.shape if isinstance(t, TensorType) else None


def _named_dim(name: str):
    """The dim a ``dim_param`` names. Exporters write an unknown dim as ``?`` or ``-1`` too
    (PaddleOCR: ``x[-1,3,?,?]``): onnxruntime takes any size there, and two such dims are
    not one shared dim, so a name without a letter or ``_`` is an unknown dim, as is one
    that reads as a number."""
    if not any(c.isalpha() or c == "_" for c in name):
        return None
    d = parse_dim(name)
    return None if isinstance(d, int) else d


class ModelImporter:
    """Builds the IR for one ModelProto; holds the scope chain while walking graphs."""

    def __init__(self, proto: onnx.ModelProto, base_dir=None, raw: RawData | None = None):
        self.proto = proto
        self.base_dir = base_dir
        self.raw = raw
        """The main graph's initializer bytes when they were cut out of ``proto``."""
        self.opsets: dict[str, int] = {}
        self.function_keys = {(f.domain, f.name) for f in proto.functions}

    def model(self) -> Model:
        p = self.proto
        if p.ir_version > onnx.IR_VERSION:
            raise ModelLoadError(
                f"the model's IR version is {p.ir_version}, past {onnx.IR_VERSION}, the newest "
                f"the installed onnx {onnx.__version__} defines (onnxruntime refuses it too): "
                "a newer format may hold what Kiln cannot read; save it at an older IR version "
                "or upgrade onnx")
        opsets = {(o.domain if o.domain != "ai.onnx" else ""): o.version for o in p.opset_import}
        if not opsets:
            if p.ir_version >= 3:
                raise ModelLoadError(
                    f"the model (IR version {p.ir_version}) imports no opset; from IR version 3 "
                    "on ONNX requires one (onnxruntime refuses it too): add the opset its ops "
                    "were written for")
            opsets = {"": 1}  # IR v1/v2 models predate opset_import
        _check_opsets(opsets, "the model")
        self.opsets = opsets
        functions = {(f.domain, f.name): self.function(f) for f in p.functions}
        graph = self.graph(p.graph, ChainMap(), top=True)
        return Model(
            graph=graph, opset_imports=opsets, functions=functions, ir_version=p.ir_version,
            producer_name=p.producer_name, producer_version=p.producer_version,
            domain=p.domain, model_version=p.model_version, doc=p.doc_string,
            metadata={e.key: e.value for e in p.metadata_props})

    def function(self, f: onnx.FunctionProto) -> Function:
        scope: ChainMap = ChainMap()
        inputs = [Value(n) for n in f.input]
        for v in inputs:
            scope[v.name] = v
        body = Graph(inputs=inputs, name=f.name)
        outer_opsets = self.opsets
        self.opsets = {(o.domain if o.domain != "ai.onnx" else ""): o.version
                       for o in f.opset_import} or outer_opsets
        _check_opsets(self.opsets, f"function {f.name!r}")
        try:
            for np_, ins, outs in _toposort(list(f.node), set(f.input), f.name):
                body.nodes.append(self.node(np_, scope, ins, outs))
        finally:
            self.opsets = outer_opsets
        body.outputs = [self._lookup(scope, n, f"function {f.name} output") for n in f.output]
        defaults = {a.name: self.attr_value(a) for a in f.attribute_proto}
        return Function(
            domain=f.domain, name=f.name, graph=body,
            attr_names=list(f.attribute) + [a.name for a in f.attribute_proto],
            attr_defaults=defaults, doc=f.doc_string, overload=getattr(f, "overload", ""),
            opset_imports={(o.domain if o.domain != "ai.onnx" else ""): o.version
                           for o in f.opset_import})

    def graph(self, gp: onnx.GraphProto, outer: ChainMap, top: bool = False) -> Graph:
        scope = outer.new_child()
        g = Graph(name=gp.name, doc=gp.doc_string)
        init_names = set()
        for i, t in enumerate(gp.initializer):
            const = self.raw.array(i, t, self.base_dir) if top and self.raw is not None \
                else to_array(t, self.base_dir)
            v = Value(text(t.name, "initializer name"),
                      TensorType(DType(t.data_type), tuple(t.dims)), const=const)
            g.initializers[t.name] = scope[t.name] = v
            init_names.add(t.name)
        for s in gp.sparse_initializer:
            arr = sparse_to_array(s, self.base_dir)
            v = Value(s.values.name, TensorType(DType.from_numpy(arr.dtype), arr.shape), const=arr)
            g.initializers[v.name] = scope[v.name] = v
            init_names.add(v.name)
        for vi in gp.input:
            if vi.name in init_names:
                # An input with a default (older IR): a feed may override the initializer.
                scope[vi.name].meta["overridable"] = True
                continue
            t = _declared_type(vi)
            if t is None and top:
                raise ModelLoadError(f"input {vi.name!r} declares no type; ONNX requires one "
                                     "for a model's inputs (onnxruntime refuses it too)")
            v = Value(text(vi.name, "input name"), t)
            g.inputs.append(v)
            scope[vi.name] = v
        known = set(scope.keys())
        for np_, ins, outs in _toposort(list(gp.node), known, gp.name or "main graph"):
            g.nodes.append(self.node(np_, scope, ins, outs))
        # What a file declares of a computed value (value_info, graph outputs) is a claim,
        # never a fact: it goes in meta["declared"], where only descriptions (get_outputs,
        # saving) read it, and shape inference computes the value's type from its inputs.
        # Trusting it let a wrong declaration change a Reshape's or Expand's result.
        for vi in gp.value_info:
            v = scope.maps[0].get(vi.name)
            if v is not None and v.producer is not None:
                declared = value_type(vi.type)
                if declared is not None:
                    v.meta["declared"] = declared
        for vo in gp.output:
            v = self._lookup(scope, vo.name, f"graph {gp.name!r} output")
            if not top and vo.name not in scope.maps[0]:
                raise ModelLoadError(
                    f"subgraph {gp.name!r} returns {vo.name!r} of the enclosing graph directly "
                    "(onnxruntime refuses this too); put an Identity node between them")
            # onnxruntime refuses element type 0 on the model's outputs (not in subgraphs)
            declared = _declared_type(vo, "output") if top else value_type(vo.type)
            if declared is not None:
                if v.producer is not None:
                    v.meta["declared"] = declared
                elif v.type is None:
                    v.type = declared
            g.outputs.append(v)
        return g

    def node(self, np_: onnx.NodeProto, scope: ChainMap, input_names: list[str],
             output_names: list[str]) -> Node:
        """The IR node of ``np_``, whose input and output names (read from the proto once:
        each read of a repeated string field makes new strings) are given."""
        # Once per node of the model: names are looked up in this graph's own dict before
        # the (slower) scope chain.
        op_type = text(np_.op_type, "op type")
        domain = np_.domain
        domain = "" if domain == "ai.onnx" else text(domain, "op domain")
        name = text(np_.name, "node name")
        where = _NodeWhere(name, op_type)
        checked = check_node(np_, domain, self.opsets, where, input_names, output_names,
                             self.function_keys)
        since, spec = checked if checked is not None else (None, ())
        local = scope.maps[0]
        inputs = []
        for n in input_names:
            v = local.get(n) if n else None
            if v is None and n:
                v = self._lookup(scope, n, where)
            inputs.append(v)
        attrs = {}
        for a in np_.attribute:
            attrs[a.name] = AttrRef(a.ref_attr_name) if a.ref_attr_name else \
                self.attr_value(a, scope)
        if since is not None:
            rules.check_types(op_type, domain, since,
                              [v.type if v is not None else None for v in inputs], where,
                              spec)
            if attrs or op_type == "Constant":
                rules.check_values(op_type, domain, since, attrs, where)
            if op_type in rules.RANKED:
                rules.check_axes(op_type, domain, attrs, [_shape(v) for v in inputs], where,
                                 since)
        outputs = []
        for n in output_names:
            if not n:
                outputs.append(None)
                continue
            if not isinstance(n, str):
                text(n, f"{where}: output name")
            if n in local:
                raise ModelLoadError(f"{where}: value {n!r} is defined twice; ONNX graphs are "
                                     "single-assignment, so the model is malformed")
            v = local[n] = Value(n)
            outputs.append(v)
        node = Node(op_type, inputs, outputs, attrs, domain=domain, name=name)
        node.doc = np_.doc_string
        return node

    def attr_value(self, a: onnx.AttributeProto, scope: ChainMap | None = None) -> Any:
        t = a.type
        if t == A.FLOAT:
            return float(a.f)
        if t == A.INT:
            return int(a.i)
        if t == A.STRING:
            return a.s.decode("utf-8", "surrogateescape")
        if t == A.TENSOR:
            return to_array(a.t, self.base_dir)
        if t == A.SPARSE_TENSOR:
            return sparse_to_array(a.sparse_tensor, self.base_dir)
        if t == A.GRAPH:
            return self.graph(a.g, scope if scope is not None else ChainMap())
        if t == A.TYPE_PROTO:
            return value_type(a.tp)
        if t == A.FLOATS:
            return [float(x) for x in a.floats]
        if t == A.INTS:
            return [int(x) for x in a.ints]
        if t == A.STRINGS:
            return [s.decode("utf-8", "surrogateescape") for s in a.strings]
        if t == A.TENSORS:
            return [to_array(x, self.base_dir) for x in a.tensors]
        if t == A.GRAPHS:
            return [self.graph(g, scope if scope is not None else ChainMap()) for g in a.graphs]
        if t == A.TYPE_PROTOS:
            return [value_type(x) for x in a.type_protos]
        if t == A.SPARSE_TENSORS:
            return [sparse_to_array(x, self.base_dir) for x in a.sparse_tensors]
        raise ModelLoadError(f"attribute {a.name!r} has no value or an unknown type ({t})")

    @staticmethod
    def _lookup(scope: ChainMap, name: str, where: str) -> Value:
        name = text(name, f"{where}: value name")
        try:
            return scope[name]
        except KeyError:
            raise ModelLoadError(
                f"{where} reads value {name!r}, which no input, initializer or node defines; "
                "the model is malformed") from None


Entry = tuple[onnx.NodeProto, list[str], list[str]]


def _toposort(nodes: list[onnx.NodeProto], known: set[str], where: str) -> list[Entry]:
    """``(node, input names, output names)`` in an order where producers precede consumers
    (many files are already sorted; some exporters are not careful). Outer-scope names
    count as known."""
    entries = [(n, list(n.input), list(n.output)) for n in nodes]
    if _is_sorted(entries, known):
        return entries
    produced = {o: i for i, (_, _, outs) in enumerate(entries) for o in outs if o}
    order, state = [], [0] * len(entries)

    def deps(i: int):
        n, names, _ = entries[i]
        for a in n.attribute:
            for g in ([a.g] if a.type == A.GRAPH else list(a.graphs)):
                names = [*names, *_graph_free_names(g)]
        return [produced[x] for x in names if x in produced and x not in known]

    for start in range(len(entries)):
        if state[start]:
            continue
        stack = [(start, iter(deps(start)))]
        state[start] = 1
        while stack:
            i, it = stack[-1]
            for j in it:
                if state[j] == 1:
                    raise ModelLoadError(f"{where}: the graph has a cycle through node "
                                         f"{nodes[j].name or nodes[j].op_type!r}")
                if state[j] == 0:
                    state[j] = 1
                    stack.append((j, iter(deps(j))))
                    break
            else:
                stack.pop()
                state[i] = 2
                order.append(entries[i])
    return order


def _is_sorted(entries: list[Entry], known: set[str]) -> bool:
    """Whether every name a node reads (its subgraphs' free names included) is known or
    produced by an earlier node: one cheap pass that spares sorted files the search. A
    name nobody defines also says no (the search is left to report it)."""
    seen = set(known)
    for n, ins, outs in entries:
        for x in ins:
            if x and x not in seen:
                return False
        for a in n.attribute:
            if a.type == A.GRAPH or a.type == A.GRAPHS:
                for g in ([a.g] if a.type == A.GRAPH else a.graphs):
                    if not _graph_free_names(g) <= seen:
                        return False
        seen.update(outs)
    return True


def _graph_free_names(g: onnx.GraphProto) -> set[str]:
    defined = {i.name for i in g.input} | {t.name for t in g.initializer}
    used: set[str] = set()
    for n in g.node:
        used.update(x for x in n.input if x)
        for a in n.attribute:
            for sg in ([a.g] if a.type == A.GRAPH else list(a.graphs)):
                used |= _graph_free_names(sg)
        defined.update(n.output)
    used.update(o.name for o in g.output)
    return used - defined
