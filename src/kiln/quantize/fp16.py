"""Half-precision conversion: weights and arithmetic in float16 (or bfloat16), saved as a
plain ONNX model.

Which layers convert is decided per node: a node converts when it computes on float32
data, ONNX defines it for the half type, it is not on the block list, and it does not
compute a shape, size or scale some other node reads on the host (Reshape's shape,
Resize's scales, Range's bounds: halving those changes the model's geometry). Everything
else keeps float32, and a Cast goes wherever a value crosses between the two worlds,
graph inputs and outputs included when ``keep_io_types``.

Before that, what would break in half precision is taken out of its reach:

- Kiln's fused ops (what ``kiln.optimize`` writes) are expanded into their standard-ONNX
  bodies, so every layer converts (a session fuses them again);
- BatchNormalization is folded into the Conv/Gemm before it (a running variance beyond
  65504 would otherwise be clamped);
- range-sensitive layers stay float32: reductions and normalizations, and the arithmetic
  on their statistics (E[x^2] - E[x]^2 cancels in float16); with calibration data, every
  layer that reads or writes a value beyond half of float16's range (an STFT of int16-scale
  audio); without it, everything a Log of a power (Pow >= 2, x * x) depends on (a log-mel
  front end, whose magnitudes follow the input's scale); a BatchNormalization left
  unfolded whose constants exceed the range. A warning names them.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import numpy as np
import onnx.defs
import onnx.inliner
import onnx.version_converter

from kiln.errors import OptionError
from kiln.ir import DType, Model, Node, TensorType, Value
from kiln.onnxio import load, to_proto
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes.base import clone_model
from kiln.passes.dce import DeadCodeElimination
from kiln.passes.fold_constants import FoldConstants
from kiln.passes.fuse_batchnorm import FuseBatchNorm
from kiln.passes.infer_shapes import infer_model
from kiln.passes.pin_host import STOP as SHAPE_ONLY
from kiln.passes.pin_host import host_read_inputs
from kiln.passes.rewrite import Rule

__all__ = ["FP16_MAX", "RANGE_SENSITIVE", "as_model", "at_opset", "convert_float16",
           "log_of_power", "standard_ops"]

FP16_MAX = float(np.finfo(np.float16).max)

# Kept in float32 whatever their inputs: their float inputs are geometry (Resize's and
# Upsample's scales, Range's bounds) or random draws whose dtype is an attribute.
ALWAYS_FLOAT32 = frozenset({"Resize", "Upsample", "Range", "RandomNormal", "RandomUniform",
                            "RandomNormalLike", "RandomUniformLike", "Multinomial",
                            "NonMaxSuppression", "RoiAlign", "If", "Loop", "Scan"})
# Kept in float32 in float16 files: sums and normalizations whose result or statistics
# leave float16's range or cancel in it (onnxruntime's fused LayerNorm computes in float32
# for the same reason).
RANGE_SENSITIVE = frozenset({
    "ReduceSum", "ReduceSumSquare", "ReduceMean", "ReduceL1", "ReduceL2", "ReduceLogSum",
    "ReduceLogSumExp", "ReduceProd", "CumSum", "LayerNormalization", "GroupNormalization",
    "InstanceNormalization", "RMSNormalization", "LpNormalization",
    "MeanVarianceNormalization", "LayerNorm", "RMSNorm"})
# Arithmetic that keeps a statistic a statistic: a node of these types whose computed
# inputs are all statistics (and that broadcasts nothing larger) stays float32 with them.
_STAT_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Sqrt", "Reciprocal", "Max", "Min", "Pow",
                       "Neg", "Abs", "Clip", "Relu", "Identity", "Reshape", "Squeeze",
                       "Unsqueeze", "Flatten"})
# With calibration data, values beyond this stay float32 (half the range: headroom for
# inputs larger than the calibration set's).
OVERFLOW_AT = FP16_MAX / 2
SHARED_BYTES = 1 << 20
"""A constant at least this large that several nodes read is not folded into a copy."""
# Attributes that name an output dtype, by op.
_DTYPE_ATTRS = {"Cast": "to", "EyeLike": "dtype", "ConstantOfShape": None, "Constant": None}


def convert_float16(model, keep_io_types: bool = True, block_list: Iterable[str] = (),
                    bf16: bool = False, calibration=None, budget=None,
                    budget_seconds: float = 120.0, backend: str | None = None) -> Model:
    """Convert ``model`` (a path, bytes, ModelProto or Kiln Model) to float16 weights and
    compute, or bfloat16 with ``bf16=True``; returns a new Kiln :class:`Model`.

    ``keep_io_types`` keeps float32 graph inputs and outputs (Casts at the boundary).
    ``block_list`` names op types or layer names kept in float32 (Casts around them).
    ``calibration`` (an ``.npz`` path, a feed dict or an iterable of feeds): inputs the
    float32 model is run on to find values beyond float16's range (their layers stay
    float32), and on which the converted model is then measured against float32 on
    ``backend`` (Kiln's reference backend by default); a warning gives the figures.
    ``budget`` (``"rel=0.01"``, ``"top1=0.99"`` or a :class:`kiln.quantize.Budget`, e.g.
    in the task's own terms), with calibration data: the layers whose half-precision error
    costs the budget are kept in float32, the worst first, searched for at most
    ``budget_seconds`` (:mod:`kiln.quantize.half_check`); the warning names them and says
    whether the budget was met. Without calibration data a warning says the accuracy was
    not checked (see the module's docstring for what stays float32 then).
    Float16 constants outside +-65504 are clamped to it with a warning instead of
    becoming Inf (an attention mask's -3.4e38 becomes -65504, which still masks).
    bfloat16 needs opset 13: an older model is converted to opset 13 first (a warning
    says so); where onnxruntime is installed and refuses the bfloat16 file (its CPU
    provider lacks bfloat16 kernels for many ops), a warning says it runs on Kiln only.
    """
    m = as_model(model)
    notes: list[str] = []
    m = _prepare(m, bf16, notes)
    half = DType.BFLOAT16 if bf16 else DType.FLOAT16
    feeds = None
    if calibration is not None:
        from kiln.quantize.calibrate import load_feeds

        feeds = load_feeds(calibration, [v.name for v in m.graph.inputs])
    elif budget is not None:
        raise OptionError("an accuracy budget for half precision needs calibration data to "
                          "measure on (calibration=)")
    blocked = set(block_list)
    convert = {n for n in m.graph.nodes
               if _convertible(n, m, half) and n.op_type not in blocked and n.name not in blocked}
    convert -= _shape_path(m)
    convert -= _subgraph_feeders(m)
    sensitive = _range_sensitive(m, convert, half, feeds)
    convert -= set(sensitive)
    if sensitive:
        notes.append(f"kept {len(sensitive)} range-sensitive layer(s) in float32: "
                     + _names([f"{_label(n)} ({why})" for n, why in sensitive.items()]))
    keys = {_key(n) for n in convert}
    kept: set[str] = set()
    if feeds is not None:
        from kiln.quantize.half_check import check_half

        kept, checked = check_half(
            m, lambda extra: _apply(clone_model(m), half, keys - extra, keep_io_types, []),
            sorted(keys), feeds, budget, budget_seconds, backend, "bfloat16" if bf16
            else "float16")
        notes += checked
    else:
        notes.append("accuracy against float32 was not measured: pass calibration= (and "
                     "budget=) to measure it and keep in float32 the layers that cost it")
    clamped: list[str] = []
    out = _apply(m, half, keys - kept, keep_io_types, clamped)
    if clamped:
        warnings.warn(f"convert_float16: {len(clamped)} constant(s) held values beyond the "
                      f"float16 range, clamped to +-{FP16_MAX:g}: {', '.join(clamped[:5])}"
                      + (" ..." if len(clamped) > 5 else ""), stacklevel=2)
    if bf16:
        refused = _onnxruntime_refuses(out)
        if refused:
            notes.append(f"this bfloat16 file runs on Kiln only: onnxruntime refuses it "
                         f"({refused}); block those op types to keep them float32 there")
    for note in notes:
        warnings.warn(f"convert_float16: {note}", stacklevel=2)
    return out


def _prepare(m: Model, bf16: bool, notes: list[str]) -> Model:
    """``m`` made ready to convert: Kiln's fused ops expanded, opset 13 for bfloat16,
    Constant nodes folded, BatchNorm folded into the layer before it, shapes inferred."""
    m, opaque = standard_ops(m)
    if opaque:
        notes.append(f"{len(opaque)} Kiln op(s) without a standard-ONNX body stay float32: "
                     + _names(opaque))
    if bf16 and m.opset < 13:
        notes.append(f"bfloat16 needs opset 13; the model (opset {m.opset}) was converted to "
                     "opset 13 first")
        m = at_opset(m, 13)
    # Initializers an old-IR file also lists as inputs (feeds may override them) become
    # plain constants: a feed could not override a half weight with float32 data anyway,
    # and BatchNorm folding and the range checks need their values (PaddleOCR's detector
    # lists every weight so).
    for v in m.graph.initializers.values():
        v.meta.pop("overridable", None)
    _FoldWithoutCopies()(m)  # Constant nodes become initializers (PaddleOCR's BN params)
    FuseBatchNorm()(m)
    # What folding and a folded BatchNorm replaced goes, in If/Loop bodies too (silero's
    # VAD kept an LSTM's weights beside their folded copies: 5.44 MB written for 2.33).
    DeadCodeElimination()(m)
    infer_model(m)
    return m


class _FoldWithoutCopies(FoldConstants):
    """Constant folding that declines a node whose large constant input other nodes read
    too: the file would hold that data twice (GPT-2's tied embedding, gathered and read
    through a Transpose by the LM head: folding stored a second, transposed copy and the
    float16 file came out at 0.68x the float32 one, not half). A session folds it again
    at load time."""

    def rules(self) -> list[Rule]:
        out = super().rules()
        for r in out:
            if r.name == "fold":
                r.check = _declining_copies(r.check)
        return out


def _declining_copies(check):
    def wrapped(rw, m):
        n = m[0]
        for v in n.inputs:
            if (v is not None and v.const is not None and v.const.nbytes >= SHARED_BYTES
                    and len(set(v.consumers())) > 1):
                return f"{v.name} is read elsewhere too: folding would store it twice"
        return check(rw, m) if check is not None else None
    return wrapped


def _key(n: Node) -> str:
    """A node's identity across copies of a model: the name of its first output (value
    names are unique in a graph; node names need not exist)."""
    return next(v.name for v in n.outputs if v is not None)


def _apply(m: Model, half: DType, keys: set[str], keep_io_types: bool,
           clamped: list[str]) -> Model:
    """``m`` (edited in place) with the nodes whose :func:`_key` is in ``keys`` computing in
    ``half``, and Casts wherever a value crosses between the two worlds."""
    g = m.graph
    convert = {n for n in g.nodes if _key(n) in keys}

    # Outputs of converted nodes become half (attributes that fix a dtype follow).
    for n in convert:
        _retype_attrs(n, half, clamped)
        for v in n.outputs:
            if v is not None and v.dtype == DType.FLOAT:
                v.type = TensorType(half, v.shape)

    # Float32 constants read only by converted nodes become half themselves.
    for name, v in list(g.initializers.items()):
        readers = v.consumers()
        if v.dtype == DType.FLOAT and readers and all(r in convert for r in readers):
            v.const = _to_half(v.const, half, name, clamped)
            v.type = TensorType(half, tuple(v.const.shape))

    if not keep_io_types:
        for v in g.inputs:
            if v.dtype == DType.FLOAT and v.const is None:
                v.type = TensorType(half, v.shape)

    casts: dict[tuple[Value, DType], Value] = {}

    def cast(v: Value, to: DType, before: Node) -> Value:
        key = (v, to)
        if key not in casts:
            out = Value(f"{v.name}/to_{to.name.lower()}", TensorType(to, v.shape))
            g.insert_before(before, [Node("Cast", [v], [out], {"to": int(to)},
                                          name=f"{v.name}/cast_{to.name.lower()}")])
            casts[key] = out
        return casts[key]

    # Every read that now crosses between float32 and half gets a Cast. Nodes are visited in
    # order, so a Cast lands after its value's producer and before the first reader.
    for n in list(g.nodes):
        for i, v in enumerate(n.inputs):
            if v is None or v.dtype not in (DType.FLOAT, half):
                continue
            want = half if n in convert else DType.FLOAT
            if want != v.dtype:
                n.set_input(i, cast(v, want, n))

    for v in list(g.outputs):
        if v.dtype == half and keep_io_types:
            inner = Value(f"{v.name}/{half.name.lower()}", v.type)
            prod = v.producer
            prod.outputs = [inner if o is v else o for o in prod.outputs]
            v.replace_all_uses_with(inner, keep_outputs_of=g)
            v.type = TensorType(DType.FLOAT, v.shape)
            g.append(Node("Cast", [inner], [v], {"to": int(DType.FLOAT)},
                          name=f"{v.name}/cast_float"))
    return m


def standard_ops(m: Model) -> tuple[Model, list[str]]:
    """``m`` with Kiln's fused ops (``kiln.optimize``'s FusedConv, LayerNorm, ...) expanded
    into the standard-ONNX bodies they are saved with, and the names of those that have
    none (they stay as they are)."""
    if not any(n.domain == KILN_DOMAIN for _, n in m.graph.walk()):
        return m, []
    out = load(onnx.inliner.inline_local_functions(to_proto(m)))
    _drop_body_identities(out)
    return out, [_label(n) for _, n in out.graph.walk() if n.domain == KILN_DOMAIN]


def _drop_body_identities(m: Model) -> None:
    """Each inlined body ends in Identity nodes (formal -> actual output); its last
    computing node writes the actual output instead, under the fused node's name, so a
    quantizer sees Relu -> MaxPool, not Relu -> Identity -> MaxPool."""
    g = m.graph
    for n in list(g.nodes):
        if n.op_type != "Identity" or n.domain not in ("", "ai.onnx"):
            continue
        v, out = n.inputs[0], n.outputs[0]
        p = v.producer if v is not None else None
        if p is None or v.num_reads != 1 or v.is_output_of(g) or out is None:
            continue
        g.remove_node(n)
        p.outputs = [out if o is v else o for o in p.outputs]


def at_opset(m: Model, opset: int) -> Model:
    """``m`` at default-domain opset >= ``opset`` (ONNX's version converter rewrites the
    ops whose signature changed on the way, such as Reduce*'s axes becoming an input)."""
    if m.opset >= opset:
        return as_model(m)
    return load(onnx.version_converter.convert_version(to_proto(m), opset))


def _label(n: Node) -> str:
    return n.name or f"{n.op_type}({n.outputs[0].name})"


def _names(items: list[str], limit: int = 8) -> str:
    return ", ".join(items[:limit]) + (f" and {len(items) - limit} more"
                                       if len(items) > limit else "")


def _range_sensitive(m: Model, convert: set[Node], half: DType, feeds: list[dict] | None
                     ) -> dict[Node, str]:
    """Nodes of ``convert`` that would overflow or cancel in ``half``, with the reason."""
    # Both half types: float16 overflows, and bfloat16's 8-bit mantissa cancels worse
    # (magika's classifier: 83% agreement in bfloat16 with its statistics converted).
    out: dict[Node, str] = {}
    stats: set[Value] = set()
    for n in m.graph.nodes:
        computed = [v for v in n.inputs if v is not None and v.const is None]
        if n.op_type in RANGE_SENSITIVE:
            why = "a reduction or normalization"
        elif n.op_type in _STAT_OPS and computed and all(v in stats for v in computed):
            why = "arithmetic on a normalization's statistics"
        else:
            continue
        stats.update(o for o in n.outputs if o is not None)
        if n in convert:
            out[n] = why
    for n in convert:
        if n.op_type == "BatchNormalization" and any(
                v is not None and v.const is not None and v.const.dtype == np.float32 and
                v.const.size and float(np.abs(v.const).max()) > _limit(half)
                for v in n.inputs[1:]):
            out[n] = "its constants exceed the half range (not foldable into a Conv)"
    if feeds is not None:
        out.update({n: why for n, why in _overflowing(m, convert, feeds, half).items()
                    if n not in out})
    # bfloat16's loss there is precision, not range, so calibration's range check cannot
    # clear it; float16's is range, which calibration can
    if half == DType.BFLOAT16:
        why = (": bfloat16's 8-bit mantissa rounds the small magnitudes the logarithm "
               "spreads out again")
    elif feeds is None:
        why = (", whose magnitude follows the input's scale: give calibration data to "
               "convert what stays in range")
    else:
        return out
    for n, (log, power) in log_of_power(m, convert).items():
        out.setdefault(n, f"feeds the logarithm {log} of a power ({power}){why}")
    return out


def log_of_power(m: Model, nodes: set[Node]) -> dict[Node, tuple[str, str]]:
    """The nodes of ``nodes`` a Log of a power (a Pow with exponent >= 2, or x * x,
    upstream) depends on, each with the labels of that Log and power. A log-power front
    end (a spectrogram in dB, a log-mel) squares magnitudes that follow its input's scale
    (an STFT of int16-scale audio reaches 5e5; squared, 2.6e11): float16 turns them into
    Inf and the logs into NaN, unless calibration shows them in range; an 8-bit grid,
    uniform over many decades, zeroes the small ones, which the logarithm spreads out
    again (:func:`kiln.quantize`)."""
    out: dict[Node, tuple[str, str]] = {}
    for log in m.graph.nodes:
        if log.op_type != "Log":
            continue
        seen: set[Node] = set()
        todo = [log]
        power = None
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if power is None and _is_square(n):
                power = n
            todo += [v.producer for v in n.inputs
                     if v is not None and v.const is None and v.producer is not None]
        if power is None:
            continue
        out.update({n: (_label(log), _label(power)) for n in seen
                    if n in nodes and n not in out})
    return out


def _is_square(n: Node) -> bool:
    if n.op_type == "Mul":
        return len(n.inputs) == 2 and n.inputs[0] is n.inputs[1] and n.inputs[0] is not None
    if n.op_type != "Pow" or len(n.inputs) < 2 or n.inputs[1] is None:
        return False
    e = n.inputs[1].const
    return e is not None and e.size == 1 and float(np.asarray(e).reshape(-1)[0]) >= 2


def _limit(half: DType) -> float:
    return FP16_MAX if half == DType.FLOAT16 else float(np.finfo(np.float32).max)


def _overflowing(m: Model, convert: set[Node], feeds: list[dict], half: DType) -> dict[Node, str]:
    """Converted nodes that read or write a value whose calibrated magnitude exceeds
    :data:`OVERFLOW_AT` (float16 only: bfloat16 has float32's range)."""
    if half != DType.FLOAT16:
        return {}
    from kiln.quantize.calibrate import calibrate

    values = sorted({v.name for n in convert for v in list(n.inputs) + list(n.outputs)
                     if v is not None and v.const is None and v.dtype == DType.FLOAT})
    ranges = calibrate(m, values, feeds)
    big = {t: max(abs(r.lo), abs(r.hi)) for t, r in ranges.items()
           if max(abs(r.lo), abs(r.hi)) > OVERFLOW_AT}
    out = {}
    for n in convert:
        for v in list(n.inputs) + list(n.outputs):
            if v is not None and v.name in big:
                out[n] = f"{v.name} reaches {big[v.name]:.3g} on the calibration data"
                break
    return out


def _onnxruntime_refuses(m: Model) -> str | None:
    """onnxruntime's first complaint about loading ``m``, None when it loads it (or is not
    installed)."""
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        ort.InferenceSession(to_proto(m).SerializeToString(), options,
                             providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own exception types
        return str(e).splitlines()[0][:300]
    return None


def as_model(model) -> Model:
    """A private copy of ``model`` (a path, bytes, ModelProto or Kiln Model) to edit."""
    return clone_model(model) if isinstance(model, Model) else load(model)


def _convertible(n: Node, m: Model, half: DType) -> bool:
    """Whether ``n`` computes on float32 data and ONNX defines it for ``half``."""
    if n.domain not in ("", "ai.onnx") or n.op_type in ALWAYS_FLOAT32 or any(n.subgraphs()):
        return False
    floats = [v for v in list(n.inputs) + list(n.outputs)
              if v is not None and v.dtype == DType.FLOAT]
    if not floats and not (n.op_type in _DTYPE_ATTRS and _makes_float(n)):
        return False
    try:
        schema = onnx.defs.get_schema(n.op_type, m.opset)
    except onnx.defs.SchemaError:
        return False
    name = f"tensor({half.onnx_name})"
    allowed = {c.type_param_str: set(c.allowed_type_strs) for c in schema.type_constraints}
    params = [(p.type_str, v) for p, v in zip(_formal(schema.inputs, len(n.inputs)), n.inputs)]
    params += [(p.type_str, v) for p, v in zip(_formal(schema.outputs, len(n.outputs)),
                                               n.outputs)]
    for type_str, v in params:
        if v is None or v.dtype != DType.FLOAT:
            continue
        if name not in allowed.get(type_str, {type_str}):
            return False
    return True


def _formal(params, count: int) -> list:
    """Formal parameters for ``count`` actual ones (the last repeats when variadic)."""
    out = list(params[:count])
    while len(out) < count and params:
        out.append(params[-1])
    return out


def _makes_float(n: Node) -> bool:
    out = n.outputs[0] if n.outputs else None
    return out is not None and out.dtype == DType.FLOAT


def _retype_attrs(n: Node, half: DType, clamped: list[str]) -> None:
    """Attributes that fix a float32 output dtype or hold float32 data, made half."""
    if n.op_type in ("Cast", "EyeLike"):
        key = _DTYPE_ATTRS[n.op_type]
        if n.attrs.get(key) == int(DType.FLOAT):
            n.attrs[key] = int(half)
    elif n.op_type in ("Constant", "ConstantOfShape"):
        val = n.attrs.get("value")
        if isinstance(val, np.ndarray) and val.dtype == np.float32:
            n.attrs["value"] = _to_half(val, half, n.name or n.outputs[0].name, clamped)


def _to_half(a: np.ndarray, half: DType, name: str, clamped: list[str]) -> np.ndarray:
    if half == DType.FLOAT16:
        finite = a[np.isfinite(a)]
        if finite.size and float(np.abs(finite).max()) > FP16_MAX:
            clamped.append(name)
            a = np.where(np.isfinite(a), np.clip(a, -FP16_MAX, FP16_MAX), a)
    return np.asarray(a, order="C").astype(half.numpy)


def _shape_path(m: Model) -> set[Node]:
    """Nodes that compute what another node reads on the host (shapes, sizes, scales)."""
    stack = host_read_inputs(m, m.graph)
    seen: set[Value] = set()
    path: set[Node] = set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        p = v.producer
        if p is None or p.op_type in SHAPE_ONLY or (v.shape is not None and len(v.shape) > 1):
            continue
        path.add(p)
        stack += [x for x in p.inputs if x is not None]
    return path


def _subgraph_feeders(m: Model) -> set[Node]:
    """Producers of values a subgraph reads from the enclosing graph: the body keeps its
    float32 types, so what it captures must too."""
    out: set[Node] = set()
    for n in m.graph.nodes:
        for sub in n.subgraphs():
            for v in sub.captures():
                if v.producer is not None:
                    out.add(v.producer)
    return out

