"""Symbolic dimensions: ``batch``, ``seq*2``, ``batch*seq*12`` as typed values.

A :class:`SymDim` is an immutable polynomial over named symbols with integer coefficients.
Arithmetic with ints and other SymDims gives a new polynomial, or a plain ``int`` when the
symbols cancel, so a constant dim is always an int. ``str()`` is a canonical form (the
longest monomials first, each with its symbols sorted and its coefficient last), so equal
expressions print equally and a printed expression parses back to the same value.

Text is parsed only where it enters Kiln (ONNX ``dim_param``, user-given shapes), with
:func:`parse_dim`; everything after that works on the typed value.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

Monomial = tuple[str, ...]
"""Sorted symbol names of one term, a name repeated for its powers; ``()`` is the constant."""


class Undecidable(TypeError):
    """A comparison or division of symbolic dims whose answer depends on the symbols."""


class SymDim:
    """A dim that is a polynomial over symbols, e.g. ``SymDim("batch") * 12``.

    ``SymDim(name)`` is one plain symbol; use :func:`parse_dim` for expression text. Equal to
    another SymDim with the same polynomial, and to a ``str`` that is its canonical form
    (``SymDim("batch") == "batch"``), with the hash of that string, so names as users write
    them still look dims up. Never equal to an int: constants are ints.
    """

    __slots__ = ("_terms", "_str", "_hash")
    __array_ufunc__ = None  # NumPy scalars defer to our reflected operators

    _terms: tuple[tuple[Monomial, int], ...]

    def __init__(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a symbol needs a non-empty name, got {name!r}")
        if _parse_terms(name) != {(name,): 1}:
            raise ValueError(f"{name!r} is an expression, not one symbol: use parse_dim")
        _init(self, (((name,), 1),))

    # ------------------------------------------------------------ reading

    @property
    def terms(self) -> tuple[tuple[Monomial, int], ...]:
        """(monomial, coefficient) pairs in canonical order, none with coefficient 0."""
        return self._terms

    @property
    def symbols(self) -> frozenset[str]:
        """Every symbol name the expression mentions."""
        return frozenset(s for m, _ in self._terms for s in m)

    @property
    def symbol(self) -> str | None:
        """The name when this is one plain symbol (``batch``), else None."""
        (mono, c), *rest = self._terms
        return mono[0] if not rest and c == 1 and len(mono) == 1 else None

    @property
    def constant(self) -> int:
        """The constant term (``seq+1`` -> 1)."""
        return dict(self._terms).get((), 0)

    def bounds(self) -> tuple[int | None, int | None]:
        """(lowest, highest) value over non-negative symbol values; None where unbounded
        or unknown (terms of both signs)."""
        signs = {c > 0 for m, c in self._terms if m}
        c0 = self.constant
        if signs == {True}:
            return c0, None
        if signs == {False}:
            return None, c0
        return None, None

    @property
    def nonnegative(self) -> bool:
        """True when no values of the symbols (dims are >= 0) make this negative."""
        low, _ = self.bounds()
        return low is not None and low >= 0

    def substitute(self, bindings: Mapping[str, int | SymDim]) -> int | SymDim:
        """This expression with the bound symbols replaced by their values."""
        if not bindings or not (self.symbols & bindings.keys()):
            return self
        total: int | SymDim = 0
        for mono, c in self._terms:
            term: int | SymDim = c
            for s in mono:
                term = term * (bindings[s] if s in bindings else _symbol(s))
            total = total + term
        return total

    def evaluate(self, sizes: Mapping[str, int], default: int | None = None) -> int:
        """The value for the given symbol sizes; a missing symbol takes ``default`` (a
        KeyError when that is None)."""
        total = 0
        for mono, c in self._terms:
            for s in mono:
                size = sizes.get(s, default)
                if size is None:
                    raise KeyError(f"no size for symbol {s!r} of {self}")
                c *= int(size)
            total += c
        return total

    # ------------------------------------------------------------ arithmetic

    def __add__(self, other: object) -> int | SymDim:
        o = _terms_of(other)
        if o is None:
            return NotImplemented
        out = dict(self._terms)
        for m, c in o:
            out[m] = out.get(m, 0) + c
        return _make(out)

    __radd__ = __add__

    def __neg__(self) -> SymDim:
        return _make({m: -c for m, c in self._terms})  # type: ignore[return-value]

    def __pos__(self) -> SymDim:
        return self

    def __sub__(self, other: object) -> int | SymDim:
        o = _terms_of(other)
        return NotImplemented if o is None else self + _make({m: -c for m, c in o})

    def __rsub__(self, other: object) -> int | SymDim:
        o = _terms_of(other)
        return NotImplemented if o is None else _make(dict(o)) + (-self)

    def __mul__(self, other: object) -> int | SymDim:
        o = _terms_of(other)
        if o is None:
            return NotImplemented
        out: dict[Monomial, int] = {}
        for ma, ca in self._terms:
            for mb, cb in o:
                m = tuple(sorted(ma + mb)) if mb else ma
                out[m] = out.get(m, 0) + ca * cb
        return _make(out)

    __rmul__ = __mul__

    def __floordiv__(self, other: object) -> int | SymDim:
        return _divmod(self, other, "//")[0]

    def __rfloordiv__(self, other: object) -> int | SymDim:
        return _divmod(other, self, "//")[0]

    def __mod__(self, other: object) -> int | SymDim:
        return _divmod(self, other, "%")[1]

    def __rmod__(self, other: object) -> int | SymDim:
        return _divmod(other, self, "%")[1]

    def div_exact(self, other: int | SymDim) -> int | SymDim | None:
        """``self / other`` when it divides without remainder for every value of the
        symbols, else None."""
        return div_exact(self, other)

    # ------------------------------------------------------------ comparison

    def __eq__(self, other: object) -> bool:
        if type(other) is int:  # shapes compare dims with ints most of the time
            return False
        if isinstance(other, SymDim):
            return self._terms == other._terms
        if isinstance(other, str):
            return str(self) == other
        if isinstance(other, (int, np.integer)):
            return False
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        h = self._hash
        if h is None:
            h = hash(str(self))
            object.__setattr__(self, "_hash", h)
        return h

    def __lt__(self, other: object) -> bool:
        return _compare(self, other, "<")

    def __le__(self, other: object) -> bool:
        return _compare(self, other, "<=")

    def __gt__(self, other: object) -> bool:
        return _compare(self, other, ">")

    def __ge__(self, other: object) -> bool:
        return _compare(self, other, ">=")

    # ------------------------------------------------------------ the rest of the protocol

    def __str__(self) -> str:
        s = self._str
        if s is None:
            s = _render(self._terms)
            object.__setattr__(self, "_str", s)
        return s

    def __repr__(self) -> str:
        return f"SymDim({str(self)!r})"

    def __setattr__(self, key: str, value: object) -> None:
        raise AttributeError("SymDim is immutable")

    def __reduce__(self):
        return _from_terms, (self._terms,)

    def __copy__(self) -> SymDim:
        return self

    def __deepcopy__(self, memo: dict) -> SymDim:
        return self


Dim = int | SymDim | None
"""One dimension: a fixed size, a symbolic expression such as ``batch*12``, or unknown."""


# ---------------------------------------------------------------- construction

def _init(obj: SymDim, terms: tuple[tuple[Monomial, int], ...]) -> None:
    object.__setattr__(obj, "_terms", terms)
    object.__setattr__(obj, "_str", None)
    object.__setattr__(obj, "_hash", None)


def _order(item: tuple[Monomial, int]) -> tuple[int, Monomial]:
    return -len(item[0]), item[0]


def _make(terms: dict[Monomial, int]) -> int | SymDim:
    """The canonical value of a polynomial: an int when it is constant."""
    items = [(m, c) for m, c in terms.items() if c]
    if not items:
        return 0
    if len(items) == 1 and not items[0][0]:
        return items[0][1]
    items.sort(key=_order)
    obj = SymDim.__new__(SymDim)
    _init(obj, tuple(items))
    return obj


def _from_terms(terms: tuple[tuple[Monomial, int], ...]) -> int | SymDim:
    return _make(dict(terms))


def _symbol(name: str) -> SymDim:
    obj = SymDim.__new__(SymDim)
    _init(obj, (((name,), 1),))
    return obj


def _terms_of(x: object) -> tuple[tuple[Monomial, int], ...] | None:
    if isinstance(x, SymDim):
        return x._terms
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return (((), int(x)),) if x else ()
    return None


def _render(terms: tuple[tuple[Monomial, int], ...]) -> str:
    parts = []
    for mono, c in terms:
        body = "*".join(mono)
        if not body:
            term = str(abs(c))
        else:
            term = body if abs(c) == 1 else f"{body}*{abs(c)}"
        parts.append(("-" if c < 0 else "+") + term)
    s = "".join(parts)
    return s[1:] if s[0] == "+" else s


# ---------------------------------------------------------------- parsing text

_TOKEN = re.compile(r"\s*(?:(\d+)|([A-Za-z_][A-Za-z0-9_]*)|(\S))")


def _parse_terms(text: str) -> dict[Monomial, int]:
    """Terms of ``text`` read as ``[+-] factor (* factor)* ([+-] ...)*``, each factor a
    number or an identifier; text that is not such an expression is one opaque symbol."""
    terms: dict[Monomial, int] = {}
    sign, coeff, syms = 1, 1, []
    expect_factor, leading = True, True
    tokens = [m.groups() for m in _TOKEN.finditer(text)]
    if not tokens:
        return {(text,): 1}
    for num, name, other in tokens:
        if num is not None or name is not None:
            if not expect_factor:
                return {(text,): 1}
            if num is not None:
                coeff *= int(num)
            else:
                syms.append(name)
            expect_factor = leading = False
        elif other in "+-" and leading:
            sign, leading = (1 if other == "+" else -1), False
        elif other in "+-" and not expect_factor:
            m = tuple(sorted(syms))
            terms[m] = terms.get(m, 0) + sign * coeff
            sign, coeff, syms, expect_factor = (1 if other == "+" else -1), 1, [], True
        elif other == "*" and not expect_factor:
            expect_factor = True
        else:
            return {(text,): 1}
    if expect_factor:
        return {(text,): 1}
    m = tuple(sorted(syms))
    terms[m] = terms.get(m, 0) + sign * coeff
    return {m: c for m, c in terms.items() if c}


@functools.lru_cache(maxsize=4096)  # ONNX's inference hands back the same names per node
def parse_dim(text: str) -> int | SymDim:
    """A dim from text: ``"batch"``, ``"batch*seq*12"``, ``"seq+1"`` or ``"12"``. Text that
    is not such an expression (``"weird-name.0"``) is one symbol of that name."""
    return _make(_parse_terms(text.strip()) if text.strip() else {(text,): 1})


def as_dim(d: object) -> Dim:
    """A dim from what users and files give: an int, a str (parsed), a SymDim or None."""
    if d is None or isinstance(d, SymDim):
        return d
    if isinstance(d, str):
        return parse_dim(d)
    if isinstance(d, (int, np.integer)) and not isinstance(d, bool):
        return int(d)
    raise TypeError(f"a dim is an int, a str, a SymDim or None, not {type(d).__name__}")


def plain_dim(d: Dim) -> int | str | None:
    """A dim as onnxruntime and reports show it: an int, a string (``"batch*12"``) or None."""
    return str(d) if isinstance(d, SymDim) else d


def plain_shape(shape: Iterable[Dim] | None) -> list[int | str | None] | None:
    """A shape with its symbolic dims as strings (None stays None)."""
    return None if shape is None else [plain_dim(d) for d in shape]


# ---------------------------------------------------------------- division and order

def div_exact(a: int | SymDim, b: int | SymDim) -> int | SymDim | None:
    """``a / b`` when the division leaves no remainder whatever the symbols' values: every
    term of ``a`` divisible by a one-term ``b``, or ``a`` an integer multiple of ``b``."""
    ta, tb = _terms_of(a), _terms_of(b)
    if ta is None or tb is None or not tb:
        return None
    if not ta:
        return 0
    if len(tb) == 1:
        (mb, cb), = tb
        out: dict[Monomial, int] = {}
        for ma, ca in ta:
            rest = list(ma)
            for s in mb:
                if s not in rest:
                    return None
                rest.remove(s)
            if ca % cb:
                return None
            out[tuple(rest)] = ca // cb
        return _make(out)
    da, db = dict(ta), dict(tb)
    if da.keys() != db.keys():
        return None
    (m0, c0), = tb[:1]
    if da[m0] % c0:
        return None
    k = da[m0] // c0
    return k if all(da[m] == k * c for m, c in tb) else None


def _divmod(a: object, b: object, op: str) -> tuple[int | SymDim, int | SymDim]:
    ta, tb = _terms_of(a), _terms_of(b)
    if ta is None or tb is None:
        raise TypeError(f"unsupported operand types for {op}: {type(a).__name__} and "
                        f"{type(b).__name__}")
    if not tb:
        raise ZeroDivisionError(f"symbolic dim {op} 0")
    if len(tb) == 1 and not tb[0][0]:
        d = tb[0][1]
        da = dict(ta)
        c0 = da.pop((), 0)
        if all(c % d == 0 for c in da.values()):
            q = _make({m: c // d for m, c in da.items()}) + c0 // d
            return q, c0 % d
    q = div_exact(a, b)  # type: ignore[arg-type]
    if q is not None:
        return q, 0
    raise Undecidable(f"{a} {op} {b} depends on the symbols' values")


def _compare(a: SymDim, b: object, op: str) -> bool:
    if _terms_of(b) is None:
        return NotImplemented  # type: ignore[return-value]
    diff = a - b  # type: ignore[operator]
    if isinstance(diff, int):
        return _INT_OPS[op](diff, 0)
    low, high = diff.bounds()
    # Each answer needs a bound that holds for every value of the symbols.
    if op in ("<", "<="):
        if high is not None and _INT_OPS[op](high, 0):
            return True
        if low is not None and not _INT_OPS[op](low, 0):
            return False
    else:
        if low is not None and _INT_OPS[op](low, 0):
            return True
        if high is not None and not _INT_OPS[op](high, 0):
            return False
    raise Undecidable(f"{a} {op} {b} depends on the symbols' values")


_INT_OPS: dict[str, Callable[[int, int], bool]] = {
    "<": int.__lt__, "<=": int.__le__, ">": int.__gt__, ">=": int.__ge__,
}


# ---------------------------------------------------------------- shapes

def broadcast(a: Sequence[Dim], b: Sequence[Dim]) -> tuple[Dim, ...]:
    """Multidirectional (NumPy) broadcast of two shapes with symbolic dims. The model is
    assumed valid: a dim that is not 1 against an unknown or symbolic one is the result."""
    a, b = tuple(a), tuple(b)
    if a == b:  # the common case; equal elements compare by identity first
        return a
    n = max(len(a), len(b))
    a = (1,) * (n - len(a)) + a
    b = (1,) * (n - len(b)) + b
    out: list[Dim] = []
    for x, y in zip(a, b):
        if x is y or y == 1:
            out.append(x)
        elif x == 1:
            out.append(y)
        elif x is not None and x == y:
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
