"""Symbolic dims for the passes: arithmetic that tolerates unknown (None) dims, and the
symbolic *values* of small shape tensors.

Dims are :class:`kiln.ir.SymDim` expressions (``batch``, ``batch*12``, ``seq+1``), ints or
None. Shape inference (:mod:`kiln.passes.infer_shapes`) keeps, for every small integer
tensor of rank 0 or 1, the tuple of its elements as dims in ``Value.meta["sym"]`` when it
can tell them (``Shape(x)`` of a ``[batch, seq, 768]`` tensor is ``(batch, seq, 768)``).
The per-op rules that compute those and the symbolic output shapes live in
:mod:`kiln.ops.shape_rules`.

The arithmetic helpers also take dims written as text (``mul("batch", 12)``), for tests
and callers holding user input; internal dims are never re-parsed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from kiln.ir import Dim, DType, SymDim, TensorType, Value, broadcast, parse_dim
from kiln.ir import symbolic as _symbolic

__all__ = ["MAX_SYM_LEN", "SYM_TYPES", "InferContext", "add", "broadcast", "const_sym",
           "div_exact", "is_generated", "known_ints", "merge_dim", "mul", "neg", "nonnegative",
           "parse", "product", "same", "static_shape", "sub", "substitute", "sym_of", "total"]

MAX_SYM_LEN = 64
"""Longest 1-D tensor whose elements are tracked."""

_INT_TYPES = frozenset({DType.INT64, DType.INT32, DType.INT16, DType.INT8, DType.UINT8,
                        DType.UINT16, DType.UINT32, DType.UINT64})
SYM_TYPES = _INT_TYPES | {DType.BOOL}
"""Element types whose small tensors get symbolic values (bools as 0/1)."""

parse = parse_dim


def _dim(d: object) -> Dim:
    # Only text is converted; typed dims pass through untouched.
    return parse_dim(d) if isinstance(d, str) else d  # type: ignore[return-value]


# ---------------------------------------------------------------- arithmetic on dims

def add(a: Dim | str, b: Dim | str) -> Dim:
    """``a + b``; None when either is unknown."""
    a, b = _dim(a), _dim(b)
    return None if a is None or b is None else a + b


def neg(a: Dim | str) -> Dim:
    """``-a``; None when unknown."""
    a = _dim(a)
    return None if a is None else -a


def sub(a: Dim | str, b: Dim | str) -> Dim:
    """``a - b``; None when either is unknown."""
    a, b = _dim(a), _dim(b)
    return None if a is None or b is None else a - b


def mul(a: Dim | str, b: Dim | str) -> Dim:
    """``a * b``; None when either is unknown."""
    a, b = _dim(a), _dim(b)
    return None if a is None or b is None else a * b


def div_exact(a: Dim | str, b: Dim | str) -> Dim:
    """``a / b`` when it leaves no remainder for any value of the symbols, else None."""
    a, b = _dim(a), _dim(b)
    if a is None or b is None:
        return None
    return _symbolic.div_exact(a, b)


def product(dims: Iterable[Dim | str]) -> Dim:
    """The product of ``dims``; None when one is unknown."""
    out: Dim = 1
    for d in dims:
        d = _dim(d)
        if d is None:
            return None
        out = out * d
    return out


def total(dims: Iterable[Dim | str]) -> Dim:
    """The sum of ``dims``; None when one is unknown."""
    out: Dim = 0
    for d in dims:
        d = _dim(d)
        if d is None:
            return None
        out = out + d
    return out


def same(a: Dim | str, b: Dim | str) -> bool:
    """True when two dims are known to be equal."""
    a, b = _dim(a), _dim(b)
    return a is not None and b is not None and a == b


def nonnegative(d: Dim) -> bool:
    """True when ``d`` cannot be negative (dims and their sums/products are not)."""
    return d.nonnegative if isinstance(d, SymDim) else d is not None and d >= 0


def substitute(d: Dim | str, bindings: Mapping[str, int]) -> Dim:
    """``d`` with the symbols in ``bindings`` replaced by their values."""
    d = _dim(d)
    return d.substitute(bindings) if isinstance(d, SymDim) and bindings else d


def is_generated(d: Dim) -> bool:
    """Dims that name nothing a user wrote (ONNX's ``unk__N``): any other name is better."""
    return isinstance(d, SymDim) and (d.symbol or "").startswith("unk__")


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


# ---------------------------------------------------------------- symbolic values

def const_sym(x: np.ndarray | None) -> tuple[int, ...] | None:
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
    if s is None or not all(isinstance(d, (int, np.integer)) for d in s):
        return None
    return [int(d) for d in s]  # type: ignore[arg-type]


def static_shape(shape: Sequence[Dim] | None) -> tuple[int, ...] | None:
    """``shape`` when every dim is a known int."""
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return tuple(shape)  # type: ignore[arg-type]


# ---------------------------------------------------------------- what a rule sees

class InferContext:
    """What an inference function with a first parameter named ``ctx`` sees of one node:
    its inputs' types, constants and symbolic values, the opset, and where to put the
    symbolic values of its outputs (:meth:`set_sym`)."""

    def __init__(self, node, opset: int):
        self.node = node
        self.opset = opset
        self.out_syms: dict[int, tuple[Dim, ...]] = {}
        self._inputs = node.inputs  # read per call of every accessor: once is enough

    def _input(self, i: int):
        ins = self._inputs
        return ins[i] if i < len(ins) else None

    def has_input(self, i: int) -> bool:
        """Whether input ``i`` is given (optional inputs may be missing)."""
        return self._input(i) is not None

    def type(self, i: int):
        """Input ``i``'s type, None when missing or unknown."""
        v = self._input(i)
        return None if v is None else v.type

    def tensor_type(self, i: int) -> TensorType | None:
        """Input ``i``'s type when it is a tensor."""
        v = self._input(i)
        t = None if v is None else v.type
        return t if isinstance(t, TensorType) else None

    def shape(self, i: int) -> tuple[Dim, ...] | None:
        """Input ``i``'s shape, None when unranked."""
        t = self.tensor_type(i)
        return None if t is None else t.shape

    def rank(self, i: int) -> int | None:
        """Input ``i``'s rank, None when unknown."""
        s = self.shape(i)
        return None if s is None else len(s)

    def dtype(self, i: int) -> DType | None:
        """Input ``i``'s element type, None when unknown."""
        t = self.tensor_type(i)
        return None if t is None else t.dtype

    def const(self, i: int) -> np.ndarray | None:
        """Input ``i``'s constant value (not an initializer users may override)."""
        v = self._input(i)
        if v is None or v.const is None or v.meta.get("overridable"):
            return None
        return v.const

    def sym(self, i: int) -> tuple[Dim, ...] | None:
        """Input ``i``'s symbolic value (see :func:`sym_of`)."""
        return sym_of(self._input(i))

    def set_sym(self, i: int, elems: Sequence[Dim] | None) -> None:
        """Record the symbolic value of output ``i`` (None: unknown)."""
        if elems is not None:
            self.out_syms[i] = tuple(elems)
