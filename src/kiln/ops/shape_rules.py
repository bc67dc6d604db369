"""Symbolic shape rules of the standard ops, registered as their ``OpDef.infer``.

Each rule takes an :class:`~kiln.ops.symdim.InferContext` and returns the output types
whose dims are arithmetic on symbols (Reshape, Concat, Flatten, Expand, ConstantOfShape,
Tile, Range, Slice, the broadcasting ops), and records with ``ctx.set_sym`` the symbolic
values of small integer outputs (what ``Shape -> Gather -> Mul -> Concat`` computes), so
that a Reshape target built from a Shape gives ``batch*12`` and not an unknown dim.
A rule returns None for what ONNX's own inference already types; a rule that types every
output completely (the elementwise ops) spares the node ONNX's slower inference.

Importing this module registers the rules; :mod:`kiln.ops` does, after every op module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from kiln.ir import Dim, DType, SymDim, TensorType
from kiln.ops import registry
from kiln.ops.symdim import (
    MAX_SYM_LEN,
    SYM_TYPES,
    InferContext,
    add,
    broadcast,
    const_sym,
    div_exact,
    known_ints,
    nonnegative,
    product,
    same,
    sub,
    total,
)

_INT_MAX = 2**62  # Slice ends at or beyond this mean "to the end"
_INT_TYPES = frozenset({DType.INT64, DType.INT32, DType.INT16, DType.INT8, DType.UINT8,
                        DType.UINT16, DType.UINT32, DType.UINT64})
Syms = tuple[Dim, ...]


def _rule(*op_types: str) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the inference of every version of the standard ``op_types``."""

    def register(fn: Callable) -> Callable:
        for op_type in op_types:
            registry.infer(op_type)(fn)
        return fn

    return register


# ---------------------------------------------------------------- elementwise on values

def _elementwise(f: Callable[..., Dim], *syms: Syms | None) -> Syms | None:
    if any(s is None for s in syms):
        return None
    n = max(len(s) for s in syms)  # type: ignore[arg-type]
    if any(len(s) not in (1, n) for s in syms):  # type: ignore[arg-type]
        return None
    return tuple(f(*[s[0] if len(s) == 1 else s[i] for s in syms])  # type: ignore[index]
                 for i in range(n))


def _both(f: Callable[[Dim, Dim], Dim]) -> Callable[[Dim, Dim], Dim]:
    return lambda a, b: None if a is None or b is None else f(a, b)


def _trunc_div(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        if b == 0:
            return None
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q
    return div_exact(a, b)


def _min(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return min(a, b)
    return a if same(a, b) else None


def _max(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return max(a, b)
    return a if same(a, b) else None


def _equal(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return int(a == b)
    if same(a, b):
        return 1
    for x, y in ((a, b), (b, a)):  # a symbolic dim is never a negative number
        if isinstance(y, int) and y < 0 and isinstance(x, SymDim) and nonnegative(x):
            return 0
    return None


_BINARY_VALUES: dict[str, Callable[[Dim, Dim], Dim]] = {
    "Add": _both(lambda a, b: a + b), "Sub": _both(lambda a, b: a - b),
    "Mul": _both(lambda a, b: a * b), "Div": _trunc_div, "Min": _min, "Max": _max,
    "Equal": _equal,
}

_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "Mod", "And", "Or", "Xor", "Equal",
                 "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Where", "Max", "Min",
                 "Sum", "Mean", "PRelu", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor")


@_rule(*_BROADCASTING)
def broadcasting(ctx: InferContext) -> TensorType | None:
    """Multidirectional broadcast of the inputs' shapes; small integer results of the
    arithmetic ops (and Where) get their symbolic values."""
    n = ctx.node
    value_dtype = ctx.dtype(1 if n.op_type == "Where" else 0)
    f = _BINARY_VALUES.get(n.op_type)
    if value_dtype is not None and value_dtype not in SYM_TYPES:
        pass  # only small integer tensors carry symbolic values: no need to look
    elif f is not None and len(n.inputs) == 2:
        ctx.set_sym(0, _elementwise(f, ctx.sym(0), ctx.sym(1)))
    elif n.op_type == "Where":
        ctx.set_sym(0, _elementwise(lambda c, x, y: (x if c else y) if isinstance(c, int)
                                    else None, ctx.sym(0), ctx.sym(1), ctx.sym(2)))
    shapes = [ctx.shape(i) for i in range(len(n.inputs))]
    dtype = DType.BOOL if n.op_type in _COMPARISONS else value_dtype
    if dtype is None or not shapes or any(s is None for s in shapes):
        return None
    out = tuple(shapes[0])  # type: ignore[arg-type]
    for s in shapes[1:]:
        out = broadcast(out, s)  # type: ignore[arg-type]
    return TensorType(dtype, out)


_COMPARISONS = frozenset({"Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual"})

# Ops whose single output has their first input's dtype and shape.
_SAME_TYPE = ("Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
              "Elu", "Selu", "Celu", "Softplus", "Softsign", "Gelu", "Mish", "ThresholdedRelu",
              "Abs", "Exp", "Log", "Sqrt", "Reciprocal", "Round", "Sign", "Erf", "Sin", "Cos",
              "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh", "Asinh", "Acosh", "Atanh", "Not",
              "BitwiseNot", "Clip", "Softmax", "LogSoftmax", "Hardmax", "Shrink")


def _like_input(ctx: InferContext) -> TensorType | None:
    t = ctx.tensor_type(0)
    return t if t is not None and t.shape is not None else None


@_rule(*_SAME_TYPE)
def same_type(ctx: InferContext) -> TensorType | None:
    """The output is typed like the first input."""
    return _like_input(ctx)


# ---------------------------------------------------------------- ops that only carry values

@_rule("Shape")
def shape_of(ctx: InferContext) -> None:
    """``Shape(x)``'s value is x's dims (within ``start``/``end``)."""
    shape = ctx.shape(0)
    if shape is None:
        return None
    r = len(shape)
    start, end = ctx.node.attrs.get("start", 0), ctx.node.attrs.get("end", r)
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(end + r if end < 0 else end, 0), r)
    ctx.set_sym(0, shape[start:end])
    return TensorType(DType.INT64, (max(end - start, 0),))


@_rule("Size")
def size_of(ctx: InferContext) -> None:
    """``Size(x)`` is the product of x's dims."""
    shape = ctx.shape(0)
    if shape is not None:
        ctx.set_sym(0, (product(shape),))
    return None


@_rule("Constant")
def constant(ctx: InferContext) -> None:
    """A small integer constant's value."""
    attrs = ctx.node.attrs
    v = attrs.get("value")
    if isinstance(v, np.ndarray):
        ctx.set_sym(0, const_sym(v))
    elif "value_int" in attrs:
        ctx.set_sym(0, (int(attrs["value_int"]),))
    elif "value_ints" in attrs:
        ctx.set_sym(0, tuple(int(x) for x in attrs["value_ints"]))
    return None


def same_value(ctx: InferContext) -> None:
    """Ops that keep the elements (of an integer tensor) as they are."""
    ctx.set_sym(0, ctx.sym(0))


def _axes(ctx: InferContext) -> list[int] | None:
    """Squeeze's or Unsqueeze's axes: an attribute before opset 13, then input 1
    (None: not known; [] when not given)."""
    if ctx.opset < 13:
        return list(ctx.node.attrs.get("axes", []))
    return known_ints(ctx.sym(1)) if ctx.has_input(1) else []


@_rule("Unsqueeze")
def unsqueeze(ctx: InferContext) -> TensorType | None:
    """Size-1 dims inserted at ``axes`` (counted in the output's rank)."""
    same_value(ctx)
    t, axes = ctx.tensor_type(0), _axes(ctx)
    if t is None or t.shape is None or not axes:
        return None
    rank = len(t.shape) + len(axes)
    at = {a + rank if a < 0 else a for a in axes}
    if len(at) != len(axes) or not all(0 <= a < rank for a in at):
        return None
    dims = iter(t.shape)
    return TensorType(t.dtype, tuple(1 if i in at else next(dims) for i in range(rank)))


@_rule("Squeeze")
def squeeze(ctx: InferContext) -> TensorType | None:
    """``axes`` removed (each must be 1); without axes, every dim that is 1."""
    same_value(ctx)
    t, axes = ctx.tensor_type(0), _axes(ctx)
    if t is None or t.shape is None or axes is None:
        return None
    rank = len(t.shape)
    if not axes:
        if not all(isinstance(d, int) for d in t.shape):
            return None  # a symbolic dim may or may not be 1
        return TensorType(t.dtype, tuple(d for d in t.shape if d != 1))
    at = {a + rank if a < 0 else a for a in axes}
    if not all(0 <= a < rank for a in at) or \
            any(isinstance(t.shape[a], int) and t.shape[a] != 1 for a in at):
        return None
    return TensorType(t.dtype, tuple(d for i, d in enumerate(t.shape) if i not in at))


@_rule("Identity", "Floor", "Ceil")
def same_value_and_type(ctx: InferContext) -> TensorType | None:
    """Ops that keep the elements and the type."""
    same_value(ctx)
    return _like_input(ctx)


@_rule("Cast")
def cast(ctx: InferContext) -> TensorType | None:
    """A cast to an integer type keeps the (integer) elements."""
    to = ctx.node.attrs.get("to")
    try:
        dtype = DType[to.upper()] if isinstance(to, str) else DType(to)
    except (KeyError, ValueError):
        return None
    if dtype in _INT_TYPES:
        ctx.set_sym(0, ctx.sym(0))
    shape = ctx.shape(0)
    return None if shape is None else TensorType(dtype, shape)


@_rule("Neg")
def negate(ctx: InferContext) -> TensorType | None:
    """Negated elements."""
    s = ctx.sym(0)
    if s is not None:
        ctx.set_sym(0, tuple(None if d is None else -d for d in s))
    return _like_input(ctx)


@_rule("Gather")
def gather(ctx: InferContext) -> TensorType | None:
    """The indices' dims in place of ``axis``; picking elements of a shape (axis 0) by
    constant indices."""
    axis = ctx.node.attrs.get("axis", 0)
    data, idx = ctx.sym(0), known_ints(ctx.sym(1))
    if data is not None and idx is not None and axis == 0 and \
            all(-len(data) <= i < len(data) for i in idx):
        ctx.set_sym(0, tuple(data[i] for i in idx))
    t, indices = ctx.tensor_type(0), ctx.shape(1)
    if t is None or t.shape is None or indices is None:
        return None
    rank = len(t.shape)
    axis = axis + rank if axis < 0 else axis
    if not 0 <= axis < rank:
        return None
    return TensorType(t.dtype, t.shape[:axis] + tuple(indices) + t.shape[axis + 1:])


@_rule("ReduceProd", "ReduceSum")
def reduce_all(ctx: InferContext) -> TensorType | None:
    """As the other reductions; also the product or sum of all the elements of a 1-D
    shape tensor."""
    s = ctx.sym(0)
    if s is not None and ctx.rank(0) == 1 and not ctx.has_input(1) and \
            ctx.node.attrs.get("axes") in (None, [0], [-1]):
        ctx.set_sym(0, ((product if ctx.node.op_type == "ReduceProd" else total)(s),))
    return _reduced(ctx)


# ---------------------------------------------------------------- shapes from values

@_rule("Reshape")
def reshape(ctx: InferContext) -> TensorType | None:
    """Target dims from the shape tensor's value; 0 copies, -1 is what is left over."""
    ctx.set_sym(0, ctx.sym(0))
    data, target = ctx.shape(0), ctx.sym(1)
    if data is None or target is None or ctx.dtype(0) is None:
        return None
    allowzero = ctx.node.attrs.get("allowzero", 0)
    out: list[Dim] = []
    infer_at = None
    for i, d in enumerate(target):
        if d == 0 and not allowzero:
            out.append(data[i] if i < len(data) else None)
        elif d == -1:
            infer_at = len(out)
            out.append(None)
        else:
            out.append(d if not isinstance(d, int) or d >= 0 else None)
    if infer_at is not None:
        others = out[:infer_at] + out[infer_at + 1:]
        if all(d is not None for d in others) and all(d is not None for d in data):
            out[infer_at] = div_exact(product(data), product(others))
    return TensorType(ctx.dtype(0), tuple(out))  # type: ignore[arg-type]


@_rule("Flatten")
def flatten(ctx: InferContext) -> TensorType | None:
    """Products of the dims before and from ``axis``."""
    ctx.set_sym(0, ctx.sym(0))
    shape = ctx.shape(0)
    if shape is None or ctx.dtype(0) is None:
        return None
    axis = ctx.node.attrs.get("axis", 1)
    axis = axis + len(shape) if axis < 0 else axis
    return TensorType(ctx.dtype(0),  # type: ignore[arg-type]
                      (product(shape[:axis]), product(shape[axis:])))


@_rule("Concat")
def concat(ctx: InferContext) -> TensorType | None:
    """The sum of the dims on ``axis``; the joined values of shape tensors."""
    n = len(ctx.node.inputs)
    syms = [ctx.sym(i) for i in range(n)]
    if syms and all(s is not None for s in syms):
        ctx.set_sym(0, tuple(d for s in syms for d in s))  # type: ignore[union-attr]
    shapes = [ctx.shape(i) for i in range(n)]
    if not shapes or any(s is None for s in shapes) or ctx.dtype(0) is None:
        return None
    rank = len(shapes[0])  # type: ignore[arg-type]
    if rank == 0 or any(len(s) != rank for s in shapes):  # type: ignore[arg-type]
        return None
    axis = ctx.node.attrs.get("axis", 0)
    axis = axis + rank if axis < 0 else axis
    out: list[Dim] = []
    for k in range(rank):
        col = [s[k] for s in shapes]  # type: ignore[index]
        if k == axis:
            out.append(total(col))
        else:
            known = [d for d in col if d is not None]
            out.append(next((d for d in known if isinstance(d, int)),
                            known[0] if known else None))
    return TensorType(ctx.dtype(0), tuple(out))  # type: ignore[arg-type]


@_rule("Expand")
def expand(ctx: InferContext) -> TensorType | None:
    """The input's shape broadcast with the target's value."""
    shape, target = ctx.shape(0), ctx.sym(1)
    if shape is None or target is None or ctx.dtype(0) is None:
        return None
    return TensorType(ctx.dtype(0), broadcast(shape, target))  # type: ignore[arg-type]


@_rule("ConstantOfShape")
def constant_of_shape(ctx: InferContext) -> TensorType | None:
    """The shape is the input's value; a short 1-D result's value is the fill."""
    target = ctx.sym(0)
    v = ctx.node.attrs.get("value")
    ints = known_ints(target)
    fill = const_sym(v) if isinstance(v, np.ndarray) else None
    if ints is not None and len(ints) <= 1 and (fill is not None or v is None):
        count = ints[0] if ints else 1
        if count <= MAX_SYM_LEN:
            ctx.set_sym(0, (fill[0] if fill else 0,) * count)
    if target is None:
        return None
    dtype = DType.from_numpy(v.dtype) if isinstance(v, np.ndarray) else DType.FLOAT
    return TensorType(dtype, tuple(target))


@_rule("Tile")
def tile(ctx: InferContext) -> TensorType | None:
    """Each dim times its repeat count."""
    shape, reps = ctx.shape(0), ctx.sym(1)
    if shape is None or reps is None or len(reps) != len(shape) or ctx.dtype(0) is None:
        return None
    return TensorType(ctx.dtype(0),  # type: ignore[arg-type]
                      tuple(None if d is None or r is None else d * r
                            for d, r in zip(shape, reps)))


@_rule("Range")
def range_(ctx: InferContext) -> TensorType | None:
    """``ceil((limit - start) / delta)`` elements; ``limit - start`` for a symbolic
    limit with step 1."""
    start, limit, delta = ctx.sym(0), ctx.sym(1), ctx.sym(2)
    ints = [known_ints(s) for s in (start, limit, delta)]
    if all(ints) and ints[2][0]:  # type: ignore[index]
        r = range(ints[0][0], ints[1][0], ints[2][0])  # type: ignore[index]
        if len(r) <= MAX_SYM_LEN:
            ctx.set_sym(0, tuple(r))
    dtype = ctx.dtype(0) or ctx.dtype(1)
    if dtype is None:
        return None
    n: Dim = None
    if start and limit and delta and len(start) == len(limit) == len(delta) == 1:
        s, lim, d = start[0], limit[0], delta[0]
        if isinstance(s, int) and isinstance(lim, int) and isinstance(d, int) and d:
            n = max(0, -(-(lim - s) // d))
        elif d == 1 and s is not None and lim is not None:
            n = sub(lim, s)
    return TensorType(dtype, (n,))


@_rule("Slice")
def slice_(ctx: InferContext) -> TensorType | None:
    """Sliced dims, symbolic where the bounds are (``x[:, :seq]``); a 1-D shape tensor's
    sliced value."""
    shape, data = ctx.shape(0), ctx.sym(0)
    if data is not None:
        p = _slice_params(ctx, 1)
        if p is not None and p[2] == [0] and known_ints(p[0]) is not None \
                and known_ints(p[1]) is not None:
            ctx.set_sym(0, data[slice(p[0][0], p[1][0], p[3][0])])
    if shape is None or ctx.dtype(0) is None:
        return None
    p = _slice_params(ctx, len(shape))
    if p is None:
        return None
    out = list(shape)
    for s, e, a, st in zip(*p):
        if not 0 <= a < len(shape):
            return None
        out[a] = _slice_dim(shape[a], s, e, st)
    return TensorType(ctx.dtype(0), tuple(out))  # type: ignore[arg-type]


def _slice_params(ctx: InferContext, rank: int
                  ) -> tuple[list[Dim], list[Dim], list[int], list[int]] | None:
    """(starts, ends, axes, steps) of a Slice node, or None."""
    n = ctx.node
    if ctx.opset < 10:
        starts, ends = n.attrs.get("starts"), n.attrs.get("ends")
        axes: Sequence[Dim] | None = n.attrs.get("axes") or list(range(len(starts or [])))
        steps: Sequence[Dim] | None = [1] * len(axes)  # type: ignore[arg-type]
    else:
        starts, ends = ctx.sym(1), ctx.sym(2)
        axes = ctx.sym(3) if ctx.has_input(3) else tuple(range(len(starts or ())))
        steps = ctx.sym(4) if ctx.has_input(4) else (1,) * len(axes or ())
    if starts is None or ends is None:
        return None
    int_axes, int_steps = known_ints(axes), known_ints(steps)
    if int_axes is None or int_steps is None:
        return None
    int_axes = [a + rank if a < 0 else a for a in int_axes]
    return list(starts), list(ends), int_axes, int_steps


def _slice_dim(dim: Dim, s: Dim, e: Dim, step: int) -> Dim:
    if isinstance(dim, int) and isinstance(s, int) and isinstance(e, int):
        return len(range(dim)[slice(s, e, step)])
    if step != 1 or not isinstance(s, int) or s < 0:
        return None
    if isinstance(e, int):
        if e >= _INT_MAX:
            return sub(dim, s)
        return None if e < 0 else max(e - s, 0) if isinstance(dim, int) else None
    # A symbolic end: a valid model slices within bounds (x[:, :seq] of a 512 buffer).
    return None if e is None else sub(e, s)


# ---------------------------------------------------------------- the compute ops' shapes
# Typed here rather than by ONNX's inference, which builds and parses back a proto per node
# and made up a large part of optimizing a model of a few hundred nodes.

@_rule("Transpose")
def transpose(ctx: InferContext) -> TensorType | None:
    """The dims in ``perm`` order (reversed without one)."""
    t = ctx.tensor_type(0)
    if t is None or t.shape is None:
        return None
    rank = len(t.shape)
    perm = ctx.node.attrs.get("perm")
    perm = list(range(rank))[::-1] if perm is None else list(perm)
    if sorted(perm) != list(range(rank)):
        return None
    return TensorType(t.dtype, tuple(t.shape[p] for p in perm))


def matmul_shape(a: Sequence[Dim], b: Sequence[Dim]) -> tuple[Dim, ...] | None:
    """NumPy's matmul shape: 1-D operands get a dim added and removed again, the batch
    dims broadcast; None when the ranks or contracted dims cannot match."""
    if not a or not b:
        return None
    a2 = (1, *a) if len(a) == 1 else tuple(a)
    b2 = (*b, 1) if len(b) == 1 else tuple(b)
    k1, k2 = a2[-1], b2[-2]
    if isinstance(k1, int) and isinstance(k2, int) and k1 != k2:
        return None
    out = broadcast(a2[:-2], b2[:-2])
    if len(a) > 1:
        out += (a2[-2],)
    if len(b) > 1:
        out += (b2[-1],)
    return out


@_rule("MatMul")
def matmul(ctx: InferContext) -> TensorType | None:
    """See :func:`matmul_shape`."""
    a, b = ctx.tensor_type(0), ctx.shape(1)
    if a is None or a.shape is None or b is None:
        return None
    out = matmul_shape(a.shape, b)
    return None if out is None else TensorType(a.dtype, out)


@_rule("Gemm")
def gemm(ctx: InferContext) -> TensorType | None:
    """(M, N) of the possibly transposed 2-D operands."""
    a, b = ctx.tensor_type(0), ctx.shape(1)
    if a is None or a.shape is None or b is None or len(a.shape) != 2 or len(b) != 2:
        return None
    attrs = ctx.node.attrs
    m = a.shape[1] if attrs.get("transA", 0) else a.shape[0]
    n = b[0] if attrs.get("transB", 0) else b[1]
    return TensorType(a.dtype, (m, n))


@_rule("Conv")
def conv(ctx: InferContext) -> TensorType | None:
    """(N, M, spatial...): each spatial dim from its padding, kernel extent and stride;
    a symbolic dim only at stride 1."""
    x, w = ctx.tensor_type(0), ctx.shape(1)
    if x is None or x.shape is None or w is None or len(x.shape) < 3 or \
            len(w) != len(x.shape):
        return None
    spatial = _windows(ctx, x.shape, list(ctx.node.attrs.get("kernel_shape") or w[2:]))
    return None if spatial is None else TensorType(x.dtype, (x.shape[0], w[0], *spatial))


@_rule("MaxPool", "AveragePool", "LpPool")
def pool(ctx: InferContext) -> TensorType | list | None:
    """(N, C, spatial...) as for Conv (floor mode only); MaxPool's indices alike, int64."""
    x = ctx.tensor_type(0)
    if x is None or x.shape is None or len(x.shape) < 3 or ctx.node.attrs.get("ceil_mode"):
        return None
    spatial = _windows(ctx, x.shape, list(ctx.node.attrs.get("kernel_shape") or []))
    if spatial is None:
        return None
    out = TensorType(x.dtype, (*x.shape[:2], *spatial))
    return [out, TensorType(DType.INT64, out.shape)] if len(ctx.node.outputs) > 1 else out


def _windows(ctx: InferContext, shape: tuple, kernel: list) -> list[Dim] | None:
    """The spatial output dims of a convolution or pooling window over ``shape``."""
    attrs = ctx.node.attrs
    k = len(shape) - 2
    strides = list(attrs.get("strides") or [1] * k)
    dilations = list(attrs.get("dilations") or [1] * k)
    pads = list(attrs.get("pads") or [0] * (2 * k))
    auto_pad = attrs.get("auto_pad", "NOTSET")
    auto_pad = auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad
    if not (len(kernel) == len(strides) == len(dilations) == k and len(pads) == 2 * k) or \
            not all(isinstance(d, int) for d in kernel):
        return None
    out: list[Dim] = []
    for i in range(k):
        size, s = shape[2 + i], strides[i]
        extent = dilations[i] * (kernel[i] - 1) + 1
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            padded, extent = size, 1  # ceil(size / stride)
        elif auto_pad == "VALID":
            padded = size
        else:
            padded = add(size, pads[i] + pads[i + k])
        if isinstance(padded, int):
            d = (padded - extent) // s + 1 if auto_pad in ("NOTSET", "VALID") \
                else -(-padded // s)
            out.append(d if d > 0 else None)
        else:
            out.append(sub(padded, extent - 1) if s == 1 and padded is not None else None)
    return out


_REDUCE = ("ReduceMean", "ReduceMax", "ReduceMin", "ReduceL1", "ReduceL2", "ReduceLogSum",
           "ReduceLogSumExp", "ReduceSumSquare")


@_rule(*_REDUCE)
def reduce(ctx: InferContext) -> TensorType | None:
    """The input's type with ``axes`` removed, or kept as 1 (``keepdims``)."""
    return _reduced(ctx)


def _reduced(ctx: InferContext) -> TensorType | None:
    t = ctx.tensor_type(0)
    attrs = ctx.node.attrs
    if t is None or t.shape is None:
        return None
    if "axes" in attrs:
        axes = list(attrs["axes"])
    elif ctx.has_input(1):
        axes = known_ints(ctx.sym(1))
        if axes is None:
            return None
    else:
        axes = []
    rank = len(t.shape)
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return t
        axes = list(range(rank))
    at = {a + rank if a < 0 else a for a in axes}
    if not all(0 <= a < rank for a in at):
        return None
    keep = attrs.get("keepdims", 1)
    return TensorType(t.dtype, tuple(1 if i in at else d for i, d in enumerate(t.shape)
                                     if keep or i not in at))


@_rule("LayerNormalization")
def layer_normalization(ctx: InferContext) -> TensorType | None:
    """The normalized output is typed like the input (the optional statistics are left
    to ONNX's inference)."""
    return _like_input(ctx)
