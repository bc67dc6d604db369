"""Symbolic dimensions: arithmetic on dims such as ``batch``, ``seq*2`` or ``batch*12``, the
symbolic *values* of small shape tensors (what ``Shape -> Gather -> Mul`` computes), and the
shape-inference rules for the standard ops whose output dims are computed from those
(Reshape, Concat, Flatten, Expand, ConstantOfShape, Tile, Range, Slice).

A dim is an int, a str or None (unknown). A str is read as a polynomial over symbols with
integer coefficients (``"batch*seq*12"``, ``"seq+1"``); a string that is not such an
expression is one opaque symbol. Results are rendered back into the same form, symbols
first and the coefficient last, so equal expressions give equal strings.

Shape inference (:mod:`kiln.passes.infer_shapes`) keeps, for every small integer tensor
of rank 0 or 1, the tuple of its elements as dims in ``Value.meta["sym"]`` when it can
tell them (``Shape(x)`` of a ``[batch, seq, 768]`` tensor is ``("batch", "seq", 768)``).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kiln.ir import Dim, DType, TensorType, Value

Poly = dict[tuple[str, ...], int]
"""Monomial (sorted symbol names, repeated for powers) -> integer coefficient."""

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(.))")
_INT_MAX = 2**62  # Slice ends at or beyond this mean "to the end"
MAX_SYM_LEN = 64  # longest 1-D tensor whose elements are tracked


# ---------------------------------------------------------------- polynomials over symbols

def parse(d: Dim) -> Poly | None:
    """The polynomial of a dim (None when unknown)."""
    if d is None:
        return None
    if isinstance(d, (int, np.integer)):
        return {(): int(d)} if d else {}
    return _parse_str(d)


def _parse_str(s: str) -> Poly:
    tokens = [m.groups() for m in _TOKEN.finditer(s)]
    poly: Poly = {}
    sign, coeff, syms, expect_factor = 1, 1, [], True
    ok = bool(tokens)
    for num, name, other in tokens:
        if num is not None or name is not None:
            if not expect_factor:
                ok = False
                break
            if num is not None:
                coeff *= int(num)
            else:
                syms.append(name)
            expect_factor = False
        elif other in "+-" and expect_factor and not poly and not syms and coeff == 1 \
                and sign == 1:
            sign = 1 if other == "+" else -1  # a leading sign
        elif other in "+-" and not expect_factor:
            _add_term(poly, tuple(sorted(syms)), sign * coeff)
            sign, coeff, syms, expect_factor = (1 if other == "+" else -1), 1, [], True
        elif other == "*" and not expect_factor:
            expect_factor = True
        else:
            ok = False
            break
    if not ok or expect_factor:
        return {(s,): 1}  # not an expression: one opaque symbol
    _add_term(poly, tuple(sorted(syms)), sign * coeff)
    return poly


def _add_term(poly: Poly, mono: tuple[str, ...], c: int) -> None:
    c += poly.get(mono, 0)
    if c:
        poly[mono] = c
    else:
        poly.pop(mono, None)


def render(p: Poly | None) -> Dim:
    """A polynomial as a dim: an int when constant, else a canonical expression string."""
    if p is None:
        return None
    if not p:
        return 0
    if set(p) == {()}:
        return p[()]
    parts = []
    for mono in sorted(p, key=lambda m: (-len(m), m)):
        c = p[mono]
        body = "*".join(mono)
        if not body:
            term = str(abs(c))
        else:
            term = body if abs(c) == 1 else f"{body}*{abs(c)}"
        parts.append(("-" if c < 0 else "+") + term)
    s = "".join(parts)
    return s[1:] if s[0] == "+" else s


def add(a: Dim, b: Dim) -> Dim:
    pa, pb = parse(a), parse(b)
    if pa is None or pb is None:
        return None
    out = dict(pa)
    for m, c in pb.items():
        _add_term(out, m, c)
    return render(out)


def neg(a: Dim) -> Dim:
    pa = parse(a)
    return None if pa is None else render({m: -c for m, c in pa.items()})


def sub(a: Dim, b: Dim) -> Dim:
    return add(a, neg(b))


def mul(a: Dim, b: Dim) -> Dim:
    pa, pb = parse(a), parse(b)
    if pa is None or pb is None:
        return None
    out: Poly = {}
    for ma, ca in pa.items():
        for mb, cb in pb.items():
            _add_term(out, tuple(sorted(ma + mb)), ca * cb)
    return render(out)


def div_exact(a: Dim, b: Dim) -> Dim:
    """``a / b`` when the division is exact (every term of ``a`` divisible by the single
    term ``b``); None otherwise. Integer dims use floor division only when exact."""
    pa, pb = parse(a), parse(b)
    if pa is None or pb is None or len(pb) != 1:
        return None
    (mb, cb), = pb.items()
    if cb == 0:
        return None
    out: Poly = {}
    for ma, ca in pa.items():
        rest = list(ma)
        for s in mb:
            if s not in rest:
                return None
            rest.remove(s)
        if ca % cb:
            return None
        _add_term(out, tuple(rest), ca // cb)
    return render(out)


def product(dims: Sequence[Dim]) -> Dim:
    out: Dim = 1
    for d in dims:
        out = mul(out, d)
    return out


def same(a: Dim, b: Dim) -> bool:
    """True when two dims are known to be equal."""
    if a is None or b is None:
        return False
    return parse(a) == parse(b)


def substitute(d: Dim, bindings: dict[str, int]) -> Dim:
    """``d`` with the symbols in ``bindings`` replaced by their values."""
    if not isinstance(d, str) or not bindings:
        return d
    out: Poly = {}
    for mono, c in _parse_str(d).items():
        rest = []
        for s in mono:
            if s in bindings:
                c *= bindings[s]
            else:
                rest.append(s)
        _add_term(out, tuple(rest), c)
    return render(out)


def is_generated(d: Dim) -> bool:
    """Dims that name nothing a user wrote (ONNX's ``unk__N``): any other name is better."""
    return isinstance(d, str) and d.startswith("unk__")


def merge_dim(old: Dim, new: Dim) -> Dim:
    """The better of two facts about one dim: an int, then a user's name, then anything."""
    if isinstance(old, int):
        return old
    if isinstance(new, int):
        return new
    if old is None:
        return new
    if new is None or not is_generated(old):
        return old
    return new


def broadcast(a: Sequence[Dim], b: Sequence[Dim]) -> tuple[Dim, ...]:
    """Multidirectional broadcast of two shapes with symbolic dims. The model is assumed
    valid: an unknown dim against a dim that is not 1 must be 1 or equal to it."""
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + tuple(a)
    b = (1,) * (n - len(b)) + tuple(b)
    out = []
    for x, y in zip(a, b):
        if x == 1:
            out.append(y)
        elif y == 1 or same(x, y):
            out.append(x)
        elif x is None or y is None:
            out.append(y if x is None else x)
        elif isinstance(x, int) and not isinstance(y, int):
            out.append(x)  # y must be 1 or x
        elif isinstance(y, int) and not isinstance(x, int):
            out.append(y)
        else:
            out.append(None)
    return tuple(out)


# ---------------------------------------------------------------- symbolic values

def const_sym(x: np.ndarray | None) -> tuple[Dim, ...] | None:
    """The elements of a small integer constant of rank 0 or 1."""
    if x is None or x.ndim > 1 or x.size > MAX_SYM_LEN or x.dtype.kind not in "iub":
        return None
    return tuple(int(v) for v in x.reshape(-1))


def sym_of(v: Value | None) -> tuple[Dim, ...] | None:
    """What is known of the elements of a small integer tensor (None: nothing)."""
    if v is None:
        return None
    if v.const is not None and not v.meta.get("overridable"):
        return const_sym(v.const)
    return v.meta.get("sym")


def known_ints(s: Sequence[Dim] | None) -> list[int] | None:
    """``s`` as ints when every element is a known int."""
    if s is None or not all(isinstance(d, int) for d in s):
        return None
    return [int(d) for d in s]


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


def nonnegative(d: Dim) -> bool:
    """True when ``d`` cannot be negative (dims and their sums/products are not)."""
    p = parse(d)
    return p is not None and all(c > 0 for c in p.values())


def _equal(a: Dim, b: Dim) -> Dim:
    if isinstance(a, int) and isinstance(b, int):
        return int(a == b)
    if same(a, b):
        return 1
    for x, y in ((a, b), (b, a)):  # a symbolic dim is never a negative number
        if isinstance(y, int) and y < 0 and nonnegative(x):
            return 0
    return None


_BINARY: dict[str, Callable[[Dim, Dim], Dim]] = {
    "Add": add, "Sub": sub, "Mul": mul, "Div": _trunc_div, "Min": _min, "Max": _max,
    "Equal": _equal,
}


def _elementwise(f, *syms):
    if any(s is None for s in syms):
        return None
    n = max(len(s) for s in syms)
    if any(len(s) not in (1, n) for s in syms):
        return None
    return tuple(f(*[s[0] if len(s) == 1 else s[i] for s in syms]) for i in range(n))


def _slice_params(ctx: InferContext, rank: int):
    """(starts, ends, axes, steps) of a Slice node as lists of dims, or None."""
    n = ctx.node
    if ctx.opset < 10:
        starts, ends = n.attrs.get("starts"), n.attrs.get("ends")
        axes = n.attrs.get("axes") or list(range(len(starts or [])))
        steps = [1] * len(axes)
    else:
        starts, ends = ctx.sym(1), ctx.sym(2)
        axes = ctx.sym(3) if ctx.has_input(3) else tuple(range(len(starts or ())))
        steps = ctx.sym(4) if ctx.has_input(4) else (1,) * len(axes or ())
    if starts is None or ends is None or axes is None or steps is None:
        return None
    if known_ints(axes) is None or known_ints(steps) is None:
        return None
    axes = [a + rank if a < 0 else a for a in axes]
    return list(starts), list(ends), axes, list(steps)


def _slice_1d(elems, starts, ends, axes, steps):
    if axes != [0] or known_ints(starts) is None or known_ints(ends) is None:
        return None
    return tuple(elems[slice(starts[0], ends[0], steps[0])])


def eval_sym(ctx: InferContext) -> list[tuple[Dim, ...] | None] | None:
    """Symbolic values of a node's outputs, for the small integer ops shape code uses."""
    n, op = ctx.node, ctx.node.op_type
    if n.domain:
        return None
    if op == "Shape":
        shape = ctx.shape(0)
        if shape is None:
            return None
        r = len(shape)
        start, end = n.attrs.get("start", 0), n.attrs.get("end", r)
        start = min(max(start + r if start < 0 else start, 0), r)
        end = min(max(end + r if end < 0 else end, 0), r)
        return [tuple(shape[start:end])]
    if op == "Size":
        shape = ctx.shape(0)
        return None if shape is None else [(product(shape),)]
    if op == "Constant":
        v = n.attrs.get("value")
        if isinstance(v, np.ndarray):
            return [const_sym(v)]
        if "value_int" in n.attrs:
            return [(int(n.attrs["value_int"]),)]
        if "value_ints" in n.attrs and len(n.attrs["value_ints"]) <= MAX_SYM_LEN:
            return [tuple(int(x) for x in n.attrs["value_ints"])]
        return None
    if op in ("Identity", "Cast", "Squeeze", "Unsqueeze", "Reshape", "Flatten", "Floor",
              "Ceil"):
        s = ctx.sym(0)
        t = ctx.out_type(0)
        if op == "Cast" and (t is None or t.dtype not in _INT_TYPES):
            return None
        return [s]
    if op == "Neg":
        s = ctx.sym(0)
        return None if s is None else [tuple(neg(d) for d in s)]
    if op in _BINARY:
        return [_elementwise(_BINARY[op], ctx.sym(0), ctx.sym(1))]
    if op == "Where":
        return [_elementwise(lambda c, x, y: None if c is None or not isinstance(c, int)
                             else (x if c else y), ctx.sym(0), ctx.sym(1), ctx.sym(2))]
    if op == "Gather":
        data, idx = ctx.sym(0), known_ints(ctx.sym(1))
        if data is None or idx is None or n.attrs.get("axis", 0) != 0:
            return None
        if any(not -len(data) <= i < len(data) for i in idx):
            return None
        return [tuple(data[i] for i in idx)]
    if op == "Concat":
        syms = [ctx.sym(i) for i in range(len(n.inputs))]
        if any(s is None for s in syms):
            return None
        return [tuple(d for s in syms for d in s)]
    if op == "Slice":
        data = ctx.sym(0)
        p = _slice_params(ctx, 1)
        return None if data is None or p is None else [_slice_1d(data, *p)]
    if op in ("ReduceProd", "ReduceSum") and ctx.rank(0) == 1:
        s = ctx.sym(0)
        if s is None or ctx.has_input(1) or n.attrs.get("axes") not in (None, [0], [-1]):
            return None
        f = product if op == "ReduceProd" else _sum
        return [(f(s),)]
    if op == "ConstantOfShape":
        shape, v = known_ints(ctx.sym(0)), n.attrs.get("value")
        fill = const_sym(v) if isinstance(v, np.ndarray) else None
        if shape is None or len(shape) > 1 or (fill is None and v is not None):
            return None
        count = shape[0] if shape else 1
        return [(fill[0] if fill else 0,) * count] if count <= MAX_SYM_LEN else None
    if op == "Range":
        start, limit, delta = (known_ints(ctx.sym(i)) for i in range(3))
        if start and limit and delta and delta[0]:
            r = range(start[0], limit[0], delta[0])
            return [tuple(r)] if len(r) <= MAX_SYM_LEN else None
    return None


def _sum(dims):
    out: Dim = 0
    for d in dims:
        out = add(out, d)
    return out


_INT_TYPES = {DType.INT64, DType.INT32, DType.INT16, DType.INT8, DType.UINT8, DType.UINT16,
              DType.UINT32, DType.UINT64}
SYM_TYPES = _INT_TYPES | {DType.BOOL}
"""Element types whose small tensors get symbolic values (bools as 0/1)."""


# ---------------------------------------------------------------- shape-inference rules

class InferContext:
    """What an inference rule sees of one node: its inputs' types, constants and symbolic
    values, and the opset. Rules with a first parameter named ``ctx`` get one."""

    def __init__(self, node, opset: int, out_types: list | None = None):
        self.node = node
        self.opset = opset
        self.out_types = out_types or []

    def has_input(self, i: int) -> bool:
        return i < len(self.node.inputs) and self.node.inputs[i] is not None

    def type(self, i: int):
        return self.node.inputs[i].type if self.has_input(i) else None

    def tensor_type(self, i: int) -> TensorType | None:
        t = self.type(i)
        return t if isinstance(t, TensorType) else None

    def shape(self, i: int):
        t = self.tensor_type(i)
        return None if t is None else t.shape

    def rank(self, i: int) -> int | None:
        s = self.shape(i)
        return None if s is None else len(s)

    def dtype(self, i: int) -> DType | None:
        t = self.tensor_type(i)
        return None if t is None else t.dtype

    def const(self, i: int) -> np.ndarray | None:
        v = self.node.inputs[i] if self.has_input(i) else None
        if v is None or v.const is None or v.meta.get("overridable"):
            return None
        return v.const

    def sym(self, i: int) -> tuple[Dim, ...] | None:
        return sym_of(self.node.inputs[i]) if self.has_input(i) else None

    def out_type(self, i: int):
        return self.out_types[i] if i < len(self.out_types) else None


RULES: dict[str, Callable[[InferContext], Any]] = {}


def rule(*op_types: str):
    """Register a shape rule (``fn(ctx) -> TensorType | list | None``) for standard ops."""

    def register(fn):
        for t in op_types:
            RULES[t] = fn
        return fn

    return register


@rule("Reshape")
def _reshape(ctx: InferContext):
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
    return TensorType(ctx.dtype(0), tuple(out))


@rule("Flatten")
def _flatten(ctx: InferContext):
    shape = ctx.shape(0)
    if shape is None or ctx.dtype(0) is None:
        return None
    axis = ctx.node.attrs.get("axis", 1)
    axis = axis + len(shape) if axis < 0 else axis
    return TensorType(ctx.dtype(0), (product(shape[:axis]), product(shape[axis:])))


@rule("Concat")
def _concat(ctx: InferContext):
    shapes = [ctx.shape(i) for i in range(len(ctx.node.inputs))]
    if not shapes or any(s is None for s in shapes) or ctx.dtype(0) is None:
        return None
    rank = len(shapes[0])
    if any(len(s) != rank for s in shapes) or rank == 0:
        return None
    axis = ctx.node.attrs.get("axis", 0)
    axis = axis + rank if axis < 0 else axis
    out = []
    for k in range(rank):
        col = [s[k] for s in shapes]
        if k == axis:
            out.append(_sum(col))
        else:
            known = [d for d in col if d is not None]
            out.append(next((d for d in known if isinstance(d, int)), known[0] if known
                            else None))
    return TensorType(ctx.dtype(0), tuple(out))


@rule("Expand")
def _expand(ctx: InferContext):
    shape, target = ctx.shape(0), ctx.sym(1)
    if shape is None or target is None or ctx.dtype(0) is None:
        return None
    return TensorType(ctx.dtype(0), broadcast(shape, target))


@rule("ConstantOfShape")
def _constant_of_shape(ctx: InferContext):
    target = ctx.sym(0)
    if target is None:
        return None
    v = ctx.node.attrs.get("value")
    dtype = DType.from_numpy(v.dtype) if isinstance(v, np.ndarray) else DType.FLOAT
    return TensorType(dtype, tuple(target))


@rule("Tile")
def _tile(ctx: InferContext):
    shape, reps = ctx.shape(0), ctx.sym(1)
    if shape is None or reps is None or len(reps) != len(shape) or ctx.dtype(0) is None:
        return None
    return TensorType(ctx.dtype(0), tuple(mul(d, r) for d, r in zip(shape, reps)))


@rule("Range")
def _range(ctx: InferContext):
    start, limit, delta = ctx.sym(0), ctx.sym(1), ctx.sym(2)
    dtype = ctx.dtype(0) or ctx.dtype(1)
    if dtype is None:
        return None
    n: Dim = None
    if start and limit and delta and len(start) == len(limit) == len(delta) == 1:
        s, lim, d = start[0], limit[0], delta[0]
        if all(isinstance(x, int) for x in (s, lim, d)) and d:
            n = max(0, -(-(lim - s) // d))
        elif d == 1 and s is not None and lim is not None:
            n = sub(lim, s)
    return TensorType(dtype, (n,))


@rule("Slice")
def _slice(ctx: InferContext):
    shape = ctx.shape(0)
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
    return TensorType(ctx.dtype(0), tuple(out))


def _slice_dim(dim: Dim, s: Dim, e: Dim, step: int) -> Dim:
    if isinstance(dim, int) and isinstance(s, int) and isinstance(e, int):
        return len(range(dim)[slice(s, e, step)])
    if step != 1 or not isinstance(s, int) or s < 0:
        return None
    if isinstance(e, int):
        if e >= _INT_MAX:
            return sub(dim, s) if dim is not None else None
        return None if e < 0 else max(e - s, 0) if isinstance(dim, int) else None
    # A symbolic end: a valid model slices within bounds (x[:, :seq] of a 512 buffer).
    return None if e is None else sub(e, s)


_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "Mod", "And", "Or", "Xor", "Equal",
                 "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Where", "Max", "Min",
                 "Sum", "Mean", "PRelu", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor")


@rule(*_BROADCASTING)
def _broadcasting(ctx: InferContext):
    known = ctx.out_type(0)
    shapes = [ctx.shape(i) for i in range(len(ctx.node.inputs))]
    if known is None or any(s is None for s in shapes) or not shapes:
        return None
    out = tuple(shapes[0])
    for s in shapes[1:]:
        out = broadcast(out, s)
    return TensorType(known.dtype, out)


def infer_rule(op_type: str) -> Callable | None:
    """This module's rule for a standard op, if it has one."""
    return RULES.get(op_type)


def _register_with_registry() -> None:
    """Attach the rules to the registered standard ops, as their ``OpDef.infer``."""
    from kiln.ops import registry

    for op_type, fn in RULES.items():
        versions = [d for d in registry.registered() if d.domain == "" and d.op_type == op_type]
        if versions and all(d.infer is None for d in versions):
            registry.infer(op_type)(fn)
        else:  # an op module has its own rule for some version: complete, do not replace
            for d in versions:
                if d.infer is None:
                    d.infer = fn


_register_with_registry()


def static_shape(shape) -> tuple[int, ...] | None:
    """``shape`` when every dim is a known int."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)

