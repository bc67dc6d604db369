"""Value rules ONNX's schemas do not encode but its spec states: the allowed values of
enumerated string attributes, int attributes that are 0/1 flags, and axes against the rank
of the input they index. One table each, checked for every node of every graph when the
model is loaded (before ONNX's own C++ shape inference sees the node) and again, for
ranks only inference finds, when the optimizer types the graph.

A file that breaks one has no single meaning (onnxruntime, ``onnx.reference`` and PyTorch
read such values differently, or crash), so it is refused with
:class:`~kiln.errors.InvalidAttributeError` naming the node, the attribute and what is
allowed. ``tests/runtime/test_never_silently_wrong.py`` checks every table entry against ONNX's
schemas (each name exists with the type used here) and the refusals against onnxruntime.
"""

from __future__ import annotations

import functools
import locale as pylocale
from collections.abc import Mapping, Sequence

import onnx

from kiln.errors import InvalidAttributeError
from kiln.ir import DType, TensorType

_AUTO_PAD = frozenset({"NOTSET", "SAME_UPPER", "SAME_LOWER", "VALID"})
_LOSS_REDUCTION = frozenset({"none", "sum", "mean"})
_POST_TRANSFORM = frozenset({"NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO", "PROBIT"})
_RNN_DIRECTION = frozenset({"forward", "reverse", "bidirectional"})
_RESIZE_COORDS = frozenset({"half_pixel", "pytorch_half_pixel", "align_corners",
                            "asymmetric", "tf_crop_and_resize"})

# (domain, op) -> attribute -> [(since opset, allowed values)], the last entry whose
# ``since`` is at most the node's op version applies. Values are exact (case-sensitive), as
# onnxruntime compares them. A STRINGS attribute is checked element by element.
ENUMS: dict[tuple[str, str], dict[str, list[tuple[int, frozenset]]]] = {
    ("", "SoftmaxCrossEntropyLoss"): {"reduction": [(1, _LOSS_REDUCTION)]},
    ("", "NegativeLogLikelihoodLoss"): {"reduction": [(1, _LOSS_REDUCTION)]},
    ("", "ScatterElements"): {"reduction": [(16, frozenset({"none", "add", "mul"})),
                                            (18, frozenset({"none", "add", "mul", "max",
                                                            "min"}))]},
    ("", "ScatterND"): {"reduction": [(16, frozenset({"none", "add", "mul"})),
                                      (18, frozenset({"none", "add", "mul", "max", "min"}))]},
    ("", "BitShift"): {"direction": [(11, frozenset({"LEFT", "RIGHT"}))]},
    ("", "Resize"): {
        "mode": [(10, frozenset({"nearest", "linear"})),
                 (11, frozenset({"nearest", "linear", "cubic"}))],
        "coordinate_transformation_mode": [
            (11, _RESIZE_COORDS | {"tf_half_pixel_for_nn"}),
            (13, _RESIZE_COORDS),
            (19, _RESIZE_COORDS | {"half_pixel_symmetric"})],
        "nearest_mode": [(11, frozenset({"round_prefer_floor", "round_prefer_ceil", "floor",
                                         "ceil"}))],
        "keep_aspect_ratio_policy": [(18, frozenset({"stretch", "not_larger",
                                                     "not_smaller"}))]},
    ("", "Upsample"): {"mode": [(1, frozenset({"nearest", "bilinear"})),
                                (7, frozenset({"nearest", "linear"}))]},
    ("", "GridSample"): {"mode": [(16, frozenset({"bilinear", "nearest", "bicubic"})),
                                  (20, frozenset({"linear", "nearest", "cubic"}))],
                         "padding_mode": [(16, frozenset({"zeros", "border", "reflection"}))]},
    ("", "Pad"): {"mode": [(1, frozenset({"constant", "reflect", "edge"})),
                           (19, frozenset({"constant", "reflect", "edge", "wrap"}))]},
    ("", "DepthToSpace"): {"mode": [(11, frozenset({"DCR", "CRD"}))]},
    ("", "StringNormalizer"): {"case_change_action": [(10, frozenset({"LOWER", "UPPER",
                                                                      "NONE"}))]},
    ("", "Gelu"): {"approximate": [(20, frozenset({"none", "tanh"}))]},
    ("", "RoiAlign"): {"mode": [(10, frozenset({"avg", "max"}))],
                       "coordinate_transformation_mode": [
                           (16, frozenset({"half_pixel", "output_half_pixel"}))]},
    ("", "TfIdfVectorizer"): {"mode": [(9, frozenset({"TF", "IDF", "TFIDF"}))]},
    ("", "ImageDecoder"): {"pixel_format": [(20, frozenset({"RGB", "BGR", "Grayscale"}))]},
    **{("", op): {"direction": [(1, _RNN_DIRECTION)]} for op in ("RNN", "LSTM")},
    # GRU-1's schema spells its default "foward"; files of that version may carry it
    ("", "GRU"): {"direction": [(1, _RNN_DIRECTION | {"foward"}), (3, _RNN_DIRECTION)]},
    **{("", op): {"auto_pad": [(1, _AUTO_PAD)]}
       for op in ("Conv", "ConvTranspose", "ConvInteger", "QLinearConv", "AveragePool",
                  "MaxPool", "LpPool")},
    **{("ai.onnx.ml", op): {"post_transform": [(1, _POST_TRANSFORM)]}
       for op in ("LinearClassifier", "LinearRegressor", "SVMClassifier", "SVMRegressor",
                  "TreeEnsembleClassifier", "TreeEnsembleRegressor")},
    ("ai.onnx.ml", "Normalizer"): {"norm": [(1, frozenset({"MAX", "L1", "L2"}))]},
}

FLAGS = frozenset({
    "keepdims", "noop_with_empty_axes", "is_causal", "sorted", "interleaved", "ceil_mode",
    "count_include_pad", "exclusive", "reverse", "select_last_index", "largest", "allowzero",
    "onesided", "inverse", "linear_before_reset", "input_forget", "transA", "transB",
    "new_axis", "fmod", "exclude_outside", "center_point_box", "upper", "detect_negative",
    "detect_positive", "layout", "training_mode", "saturate", "storage_order"})
"""INT attributes the spec defines as 0 or 1 on every standard op that has them (a test
checks each is an INT with default 0 or 1 wherever ONNX's schemas use the name).
Implementations read other values differently: onnxruntime treats ``keepdims=7`` as 0, the
reference as 1."""

INT_CHOICES: dict[tuple[str, str], dict[str, frozenset[int]]] = {
    ("", "LpNormalization"): {"p": frozenset({1, 2})},
    ("", "ReverseSequence"): {"batch_axis": frozenset({0, 1}), "time_axis": frozenset({0, 1})},
}

DTYPES: dict[str, str] = {
    **{op: "dtype" for op in ("RandomNormal", "RandomUniform", "RandomNormalLike",
                              "RandomUniformLike", "Multinomial", "Bernoulli", "EyeLike",
                              "SequenceEmpty")},
    "Cast": "to", "BitCast": "to", "QuantizeLinear": "output_dtype",
    "DequantizeLinear": "output_dtype"}
"""Standard ops' INT attributes naming an element type: a number that is no
``TensorProto.DataType`` has no meaning (0 only where the spec reads it as "unset")."""
_ELEMENT_TYPES = frozenset(onnx.TensorProto.DataType.values()) - {0}

# op -> (attribute, input whose rank bounds it, how far past the rank it may reach below and
# above). An axis of a rank-r input lies in [-r - low, r - 1 + high]; "unsqueeze" widens the
# rank by the number of axes first. Ops missing here either have no axis or ignore it in some
# cases (QuantizeLinear with a scalar scale).
AXES: dict[str, tuple[str, int, tuple[int, int] | str]] = {
    **{op: ("axis", 0, (0, 0)) for op in (
        "ArgMax", "ArgMin", "Compress", "Concat", "Gather", "GatherElements", "Hardmax",
        "LogSoftmax", "Softmax", "LayerNormalization", "LpNormalization", "RMSNormalization",
        "Scatter", "ScatterElements", "Split", "SplitToSequence", "TopK", "Unique")},
    **{op: ("axes", 0, (0, 0)) for op in (
        "ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean",
        "ReduceMin", "ReduceProd", "ReduceSum", "ReduceSumSquare", "Squeeze",
        "MeanVarianceNormalization")},
    "Flatten": ("axis", 0, (0, 1)),  # axis == rank flattens to [n, 1]
    "OneHot": ("axis", 0, (1, 1)),  # the output has one dim more than the indices
    "Unsqueeze": ("axes", 0, "unsqueeze"),
}

_INT32 = 2**31

# op -> inputs the spec defines as 1-D tensors (shapes, axes, bounds): a tensor of another
# rank is flattened by no implementation the same way, and onnxruntime refuses it.
ONE_D: dict[str, tuple[int, ...]] = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Pad": (1,),
    "ConstantOfShape": (0,),  # not Squeeze/Unsqueeze: onnx and onnxruntime take scalar axes
    **{op: (1,) for op in ("ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp",
                           "ReduceMax", "ReduceMean", "ReduceMin", "ReduceProd", "ReduceSum",
                           "ReduceSumSquare")}}

# op -> attribute -> entries per spatial dim of input 0 (rank - 2 spatial dims): a list of
# another length is no convolution or pool ONNX defines (onnxruntime refuses it).
SPATIAL: dict[str, dict[str, int]] = {
    **{op: {"kernel_shape": 1, "strides": 1, "dilations": 1, "pads": 2} for op in (
        "Conv", "ConvInteger", "QLinearConv", "MaxPool", "AveragePool", "LpPool",
        "DeformConv")},
    "ConvTranspose": {"kernel_shape": 1, "strides": 1, "dilations": 1, "pads": 2,
                      "output_padding": 1, "output_shape": 1},
}

_SPATIAL_LEAST = {"kernel_shape": 1, "strides": 1, "dilations": 1, "pads": 0}
"""The spec's lower bounds of the window attributes' entries (onnxruntime refuses less)."""

RANKED = frozenset(AXES) | frozenset(ONE_D) | frozenset(SPATIAL) | {"Transpose"}
"""Ops whose checks need their inputs' ranks (:func:`check_axes`): callers build the
ranks only for these."""


def check_values(op_type: str, domain: str, since: int, attrs: Mapping[str, object],
                 where: object) -> None:
    """Enumerations, 0/1 flags and int choices of one node's plain attribute values
    (``attrs``: name -> Python value; references to a function's attributes are skipped).
    An axis too large for any tensor's rank is refused here too, before ONNX's C++ shape
    inference (which crashes on an axis past 2^31) can see it."""
    for name, value in attrs.items():
        if name in FLAGS and isinstance(value, int) and value not in (0, 1) and \
                (domain == "" or name == "keepdims"):
            _refuse(where, op_type, name, value, "only 0 and 1")
    enums = ENUMS.get((domain, op_type))
    if enums:
        for name, versions in enums.items():
            value = attrs.get(name)
            if value is None:
                continue
            allowed = _at(versions, since)
            for v in value if isinstance(value, list) else (value,):
                if isinstance(v, str) and v not in allowed and not (
                        name == "auto_pad" and v == ""):
                    _refuse(where, op_type, name, v, _listed(allowed))
    choices = INT_CHOICES.get((domain, op_type))
    if choices:
        for name, allowed in choices.items():
            value = attrs.get(name)
            if isinstance(value, int) and value not in allowed:
                _refuse(where, op_type, name, value, _listed(allowed))
    if domain == "" and op_type in SPATIAL:
        for name, least in _SPATIAL_LEAST.items():
            value = attrs.get(name)
            if isinstance(value, list) and any(isinstance(v, int) and v < least
                                               for v in value):
                _refuse(where, op_type, name, value,
                        "only positive entries" if least else "no negative entries")
    if domain == "" and op_type in DTYPES:
        name = DTYPES[op_type]
        value = attrs.get(name)
        if isinstance(value, int) and value not in _ELEMENT_TYPES and not (
                value == 0 and name == "output_dtype"):
            _refuse(where, op_type, name, value, "a TensorProto.DataType number")
    if domain == "" and op_type == "StringNormalizer":
        _check_locale(attrs, where)
    if domain == "" and op_type == "Constant":
        given = sorted(name for name in attrs if name in _CONSTANT_VALUES)
        if len(given) != 1:
            _refuse(where, op_type, "value", given or "absent",
                    "exactly one of value, sparse_value and value_* (the spec says so; "
                    "onnxruntime refuses other counts, even on a node nothing reads)")
    if domain == "" and op_type in AXES:
        name = AXES[op_type][0]
        value = attrs.get(name)
        for a in value if isinstance(value, list) else (value,):
            if isinstance(a, int) and not -_INT32 <= a < _INT32:
                _refuse(where, op_type, name, a, "an axis of its input's rank")


_CONSTANT_VALUES = frozenset({"value", "sparse_value", "value_float", "value_floats",
                              "value_int", "value_ints", "value_string", "value_strings"})
_OWN_CASE_RULES = frozenset({"tr", "az"})
"""Languages whose locales change case by rules of their own (a dotless i): onnxruntime
follows the C library's locale there, Kiln has only Unicode's mapping."""


def _check_locale(attrs: Mapping[str, object], where: object) -> None:
    """StringNormalizer's ``locale``, where it changes case: onnxruntime refuses a name the
    C library cannot build a locale of; Kiln refuses a language Python's locale table does
    not know, and those with case rules of their own, which it does not implement."""
    loc = attrs.get("locale")
    if not isinstance(loc, str) or not loc or attrs.get("case_change_action") in (None, "NONE"):
        return
    lang = loc.split(".")[0].split("@")[0]
    if lang.split("_")[0].lower() in _OWN_CASE_RULES:
        _refuse(where, "StringNormalizer", "locale", loc,
                "locales with Unicode's case mapping (Kiln does not implement this "
                "language's own; onnxruntime follows the C library there)")
    if lang not in ("C", "POSIX") and lang.lower() not in pylocale.locale_alias:
        _refuse(where, "StringNormalizer", "locale", loc,
                "a locale name such as en_US, de_DE.UTF-8 or C (onnxruntime refuses a name "
                "the C library cannot build a locale of)")


def check_axes(op_type: str, domain: str, attrs: Mapping[str, object],
               shapes: Sequence[Sequence[object] | None], where: object,
               since: int | None = None) -> None:
    """The node's axis attribute against the rank of the input it indexes, and its other
    rank- and shape-bound attributes, where the shape is known (``shapes[i]``: input i's
    dims, ints or symbols, or None). An absent axis is its schema's default at opset
    ``since`` (onnxruntime checks that one too: Softmax-13's default -1 on a scalar)."""
    if domain != "":
        return
    ranks = [len(s) if s is not None else None for s in shapes]
    spatial = SPATIAL.get(op_type)
    if spatial and ranks and ranks[0] is not None:
        for name, per in spatial.items():
            value = attrs.get(name)
            if isinstance(value, list) and len(value) != per * (ranks[0] - 2):
                _refuse(where, op_type, name, value,
                        f"{per * (ranks[0] - 2)} entries for its rank-{ranks[0]} input")
    _check_kernel_shape(op_type, attrs, shapes, where)
    if op_type == "Transpose" and ranks and ranks[0] is not None:
        perm = attrs.get("perm")
        if isinstance(perm, list) and sorted(perm) != list(range(ranks[0])):
            _refuse(where, op_type, "perm", perm,
                    f"a permutation of 0..{ranks[0] - 1} for its rank-{ranks[0]} input")
    vectors = ONE_D.get(op_type)
    if vectors:
        for i in vectors:
            if i < len(ranks) and ranks[i] is not None and ranks[i] != 1:
                raise InvalidAttributeError(
                    f"{_node_text(where, op_type)}: input {i} has rank {ranks[i]}, but "
                    f"{op_type} takes a 1-D tensor there (onnxruntime refuses others)",
                    node=str(where), attribute=f"input {i}", allowed="a 1-D tensor")
    if op_type in NOT_SCALAR and ranks and ranks[0] == 0:
        raise InvalidAttributeError(
            f"{_node_text(where, op_type)}: input 0 is a scalar, but {op_type} takes a "
            "tensor of rank 1 or more there (onnxruntime refuses a scalar)",
            node=str(where), attribute="input 0", allowed="rank 1 or more")
    if op_type not in AXES:
        return
    name, i, extra = AXES[op_type]
    value = attrs.get(name)
    if value is None and since is not None:
        value = _axis_default(op_type, since)
    if value is None or i >= len(ranks) or ranks[i] is None:
        return
    axes = value if isinstance(value, list) else [value]
    if not all(isinstance(a, int) for a in axes):
        return
    rank = ranks[i]
    if extra == "unsqueeze":
        rank, extra = rank + len(axes), (0, 0)
    lo, hi = -rank - extra[0], rank - 1 + extra[1]
    for a in axes:
        if not lo <= a <= hi:
            what = name if name in attrs else f"{name} (absent: its default)"
            _refuse(where, op_type, what, a,
                    f"an axis in [{lo}, {hi}] for its rank-{ranks[i]} input")


NOT_SCALAR = frozenset({"Compress", "OneHot"})
"""Ops whose input 0 the spec (and ONNX's shape inference) takes at rank 1 or more and
whose axis has no default to bound it."""

# op -> the input holding the weights whose spatial dims ``kernel_shape`` must repeat
WEIGHTS: dict[str, int] = {"Conv": 1, "ConvTranspose": 1, "ConvInteger": 1, "QLinearConv": 3,
                           "DeformConv": 1}


def _check_kernel_shape(op_type: str, attrs: Mapping[str, object],
                        shapes: Sequence[Sequence[object] | None], where: object) -> None:
    """A convolution's ``kernel_shape`` against its weights' spatial dims: the spec infers
    it from the weights, and a different one has no meaning (onnxruntime refuses it,
    ``onnx.reference`` fails reshaping the weights)."""
    i = WEIGHTS.get(op_type)
    ks = attrs.get("kernel_shape")
    if i is None or not isinstance(ks, list) or i >= len(shapes) or shapes[i] is None:
        return
    dims = list(shapes[i])[2:]
    if len(dims) == len(ks) and all(isinstance(d, int) for d in dims) and dims != ks:
        _refuse(where, op_type, "kernel_shape", ks,
                f"the weights' spatial dims {dims} (input {i} is {list(shapes[i])})")


@functools.lru_cache(maxsize=1024)
def _axis_default(op_type: str, since: int) -> object:
    """The default of ``op_type``'s axis attribute at opset ``since``, None if it has none."""
    try:
        schema = onnx.defs.get_schema(op_type, since, "")
    except onnx.defs.SchemaError:
        return None
    a = schema.attributes.get(AXES[op_type][0])
    if a is None or not a.default_value.name:
        return None
    return onnx.helper.get_attribute_value(a.default_value)


@functools.lru_cache(maxsize=4096)
def _input_types(op_type: str, domain: str, since: int) -> tuple:
    try:
        schema = onnx.defs.get_schema(op_type, since, domain)
    except onnx.defs.SchemaError:
        return ()
    return input_types(schema)


def input_types(schema: onnx.defs.OpSchema) -> tuple:
    """Per formal input of ONNX's schema: (type parameter or fixed type, the element types
    it allows as ``tensor(float)`` strings), and whether the last input repeats; () for a
    schema with no inputs. Kept in the importer's schema file with the other facts."""
    if not schema.inputs:
        return ()
    allowed = {c.type_param_str: frozenset(c.allowed_type_strs)
               for c in schema.type_constraints}
    params = tuple((p.type_str, allowed.get(p.type_str, frozenset({p.type_str})))
                   for p in schema.inputs)
    last = schema.inputs[-1] if schema.inputs else None
    variadic = last is not None and \
        last.option == onnx.defs.OpSchema.FormalParameterOption.Variadic
    if variadic and not last.is_homogeneous:  # Scan, Loop, If: each its own type
        params = params[:-1] + (("", params[-1][1]),)  # "": binds no type parameter
    return params, variadic


def check_types(op_type: str, domain: str, since: int, types: Sequence[object],
                where: object, spec: tuple | None = None) -> None:
    """Input element types against the op's type constraints, for the inputs whose type is
    known (``types[i]``: an IR type or None), as onnxruntime checks them when it loads the
    model; inputs bound to one type parameter must also agree with each other."""
    if domain not in ("", "ai.onnx.ml"):
        return
    key = (op_type, since, domain, *[t.dtype if isinstance(t, TensorType) else None
                                     for t in types])
    if key in _TYPES_PASSED:  # a long chain repeats a few (op, types) many times
        return
    _check_types(op_type, domain, since, types, where, spec)
    if len(_TYPES_PASSED) > 65536:
        _TYPES_PASSED.clear()
    _TYPES_PASSED.add(key)


_TYPES_PASSED: set[tuple] = set()


def _check_types(op_type: str, domain: str, since: int, types: Sequence[object],
                 where: object, spec: tuple | None) -> None:
    if spec is None:
        spec = _input_types(op_type, domain, since)
    if not spec or not spec[0]:
        return
    params, variadic = spec
    if hasattr(where, "inputs"):  # an IR node
        where = f"node {where.name or op_type!r} ({op_type})"
    bound: dict[str, str] = {}
    for i, t in enumerate(types):
        if not isinstance(t, TensorType) or t.dtype == DType.UNDEFINED:
            continue
        if i >= len(params) and not variadic:
            return  # counts are check_node's; nothing to match here
        name, allowed = params[min(i, len(params) - 1)]
        got = f"tensor({t.dtype.onnx_name})"
        if got not in allowed:
            raise InvalidAttributeError(
                f"{where}: input {i} is {got}, but {op_type}-{since} takes "
                f"{', '.join(sorted(allowed))} there; cast it or fix the model",
                node=str(where), attribute=f"input {i}", allowed=", ".join(sorted(allowed)))
        first = bound.setdefault(name, got)
        if first != got and name and \
                not name.startswith(("tensor(", "seq(", "optional(", "map(")):
            raise InvalidAttributeError(
                f"{where}: input {i} is {got}, but an earlier input of type {name} is "
                f"{first}; {op_type} needs them to be one type", node=str(where),
                attribute=f"input {i}", allowed=first)


def _at(versions: list[tuple[int, frozenset]], since: int) -> frozenset:
    allowed = versions[0][1]
    for v, values in versions:
        if v <= since:
            allowed = values
    return allowed


def _listed(values) -> str:
    return ", ".join(repr(v) for v in sorted(values))


def _node_text(where: object, op_type: str) -> object:
    if hasattr(where, "inputs"):  # an IR node
        return f"node {where.name or op_type!r} ({op_type})"
    return where


def _refuse(where: object, op_type: str, name: str, value: object, allowed: str) -> None:
    where = _node_text(where, op_type)
    raise InvalidAttributeError(
        f"{where}: attribute {name!r} is {value!r}, but {op_type} allows {allowed}; ONNX "
        "gives no meaning to other values (implementations disagree on them), so fix the "
        "model", node=str(where), attribute=name, allowed=allowed)
