"""Small helpers shared by the torch kernels."""

from __future__ import annotations

import math
import types
import warnings

import numpy as np
import torch

from kiln.errors import KernelError
from kiln.ir import DType, TensorType
from kiln.ops._array import axis  # noqa: F401 - the shared range-checking one
from kiln.ops.registry import Kernel

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
SIGNED = FLOATS + (torch.int8, torch.int16, torch.int32, torch.int64)
"""The dtypes with a sign: negation, absolute value and ReLU keep them exact."""

TORCH_OF: dict[DType, torch.dtype] = {
    DType.BOOL: torch.bool, DType.UINT8: torch.uint8, DType.INT8: torch.int8,
    DType.INT16: torch.int16, DType.INT32: torch.int32, DType.INT64: torch.int64,
    DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16, DType.FLOAT: torch.float32,
    DType.DOUBLE: torch.float64, DType.COMPLEX64: torch.complex64,
    DType.COMPLEX128: torch.complex128,
}
"""The element types torch has, by IR type: the one dtype map of the torch backend."""
REAL = tuple(t for t in TORCH_OF.values() if t is not torch.bool and not t.is_complex)
"""The numeric types without complex ones: what orderings and sums cover."""
DTYPE_OF: dict[torch.dtype, DType] = {t: d for d, t in TORCH_OF.items()}
_NP_TO_TORCH = {d.numpy: t for d, t in TORCH_OF.items() if d != DType.BFLOAT16}
_BF16_NP = DType.BFLOAT16.numpy


def to_torch(x: np.ndarray) -> torch.Tensor | None:
    """A CPU tensor sharing ``x``'s memory where possible; None for dtypes torch lacks."""
    dt = x.dtype
    td = _NP_TO_TORCH.get(dt)
    if td is None:
        if dt == _BF16_NP:
            return to_torch(x.view(np.int16)).view(torch.bfloat16)
        return None
    if not dt.isnative:
        x = x.astype(dt.newbyteorder("="))
    try:
        return torch.from_numpy(x)
    except ValueError:  # negative strides
        return torch.from_numpy(np.ascontiguousarray(x))


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as NumPy (zero-copy for CPU tensors where possible)."""
    if t.requires_grad:
        t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj():
        t = t.resolve_conj()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(_BF16_NP)
    if t.is_neg():
        t = t.resolve_neg()
    if t.dim() > 64:  # torch holds up to 64 dims... and more; NumPy at most 64
        raise KernelError(f"a result has {t.dim()} dims, but NumPy arrays hold at most 64; "
                          "the model builds a tensor no NumPy caller can receive")
    return t.numpy()


def _numbers(x, cast) -> list:
    if isinstance(x, torch.Tensor):
        return [cast(v) for v in x.reshape(-1).tolist()]
    if isinstance(x, (list, tuple)):
        return [cast(v) for v in x]
    return [cast(v) for v in np.asarray(x).reshape(-1)]


def ints(x) -> list[int]:
    """A 1-D (or scalar) integer tensor/array/list as Python ints (reads it on the host)."""
    return _numbers(x, int)


def floats(x) -> list[float]:
    """A 1-D float tensor/array/list (scales...) as Python floats."""
    return _numbers(x, float)


def scalar(x):
    """A one-element tensor as a Python number."""
    if isinstance(x, torch.Tensor):
        # one call for a tensor of any shape holding one element
        return x.item() if x.numel() == 1 else x.reshape(-1)[0].item()
    if isinstance(x, (int, float)):
        return x
    return np.asarray(x).reshape(-1)[0].item()


def const_tensor(site, i: int, dtype: torch.dtype | None = None):
    """Constant input ``i`` of the node as a tensor on the backend's device, or None."""
    c = site.const(i)
    if c is None:
        return None
    t = site.target.put(c)
    if not isinstance(t, torch.Tensor):
        return None
    return t.to(dtype) if dtype is not None else t


# -- 8-bit activations: uint8, with int8 ones shifted by their sign bit (x ^ 0x80 is x + 128,
# so x - zero_point is unchanged when the zero point moves by 128 too) ----------------------

def as_uint8(x: torch.Tensor) -> torch.Tensor | None:
    """An 8-bit activation as uint8 (int8 shifted by its sign bit), or None."""
    if x.dtype == torch.int8:
        return x.view(torch.uint8).bitwise_xor(0x80)
    return x if x.dtype == torch.uint8 else None


def from_uint8(y: torch.Tensor, signed: bool) -> torch.Tensor:
    """A uint8 result back as int8 when ``signed`` (in place), else as it is."""
    return y.bitwise_xor_(0x80).view(torch.int8) if signed else y


with warnings.catch_warnings():
    # torch says once per process that quantized tensors are deprecated: let it say so
    # here, silenced, rather than wrap every call (a tenth of a small 8-bit add)
    warnings.simplefilter("ignore", UserWarning)
    torch._empty_affine_quantized([0], scale=1.0, zero_point=0, dtype=torch.quint8)


def quantized(u: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """uint8 ``u`` as torch's quint8 tensor on that grid, sharing ``u``'s memory, for its
    quantized ops (``torch._make_per_tensor_quantized_tensor`` copies the data)."""
    q = torch._empty_affine_quantized([0], scale=scale, zero_point=zero_point,
                                      dtype=torch.quint8)
    return q.set_(u.untyped_storage(), u.storage_offset(), u.shape, u.stride())


def integers(q: torch.Tensor) -> torch.Tensor:
    """A quint8 tensor's integers as a uint8 tensor sharing its memory (``int_repr``
    copies them: over half of what an 8-bit residual add took)."""
    return torch.empty(0, dtype=torch.uint8).set_(q.untyped_storage(), q.storage_offset(),
                                                  q.shape, q.stride())


class PerShape:
    """A layer's weights packed once for each input shape it runs on, the last
    ``limit`` of them (a detector fed many image sizes would otherwise keep one copy per
    size). oneDNN lays weights out for the shape it will see: a pack made for another
    shape is reordered again on every call (nearly half of an int8 512-channel 3x3 layer's
    call at 7x7). ``pack(key)`` makes one; two threads may both make the same
    one, and one is kept."""

    def __init__(self, pack, limit: int = 3):
        self._pack, self._limit = pack, limit
        self._packs: dict = {}

    def __call__(self, key):
        got = self._packs.get(key)
        if got is None:
            if len(self._packs) >= self._limit:
                # list(): a snapshot other runs cannot change
                self._packs.pop(list(self._packs)[0], None)
            got = self._packs[key] = self._pack(key)
        return got

    def seed(self, key, packed) -> None:
        """Keep ``packed``, already made for ``key`` (at session creation)."""
        self._packs[key] = packed


def output_read(site, i: int) -> bool:
    """Whether output ``i`` exists and a node or the graph reads it (exporters leave the
    extra outputs of training-mode BatchNormalization and Dropout unread)."""
    outs = site.node.outputs
    return i < len(outs) and outs[i] is not None and outs[i].is_used()


def known_dtype(site, i: int = 0) -> DType | None:
    """Input ``i``'s element type where the plan knows it before the run, else None (no
    input, an unknown or non-tensor type, or a kiln.train module, whose autocast may hand
    a kernel another float type)."""
    ins = site.node.inputs
    if site.target.module or i >= len(ins) or ins[i] is None:
        return None
    t = ins[i].type
    return t.dtype if isinstance(t, TensorType) and t.dtype != DType.UNDEFINED else None


def known_ok(site, dtypes: tuple | None, same: bool = False) -> bool | None:
    """What the plan knows before the run about a kernel that computes only when its first
    input's dtype is one of ``dtypes`` (None: any) and, with ``same``, every other input
    has that dtype too: None when a known type rules the node out (decline it in
    ``prepare``), True when every type involved is known and allowed (no check per call),
    False when some type is known only at run time (check each call)."""
    known = known_dtype(site)
    if known is not None and dtypes is not None and TORCH_OF.get(known) not in dtypes:
        return None  # (a type torch lacks arrives as a NumPy array: declined too)
    others = [known_dtype(site, i) for i in range(1, len(site.node.inputs))
              if site.has_input(i)] if same else []
    if known is not None and any(o is not None and o != known for o in others):
        return None
    return known is not None and all(o is not None for o in others)


def known_shape(site, i: int = 0) -> tuple | None:
    """Input ``i``'s shape (ints, and names for dims known only at run time) where the plan
    knows its rank before the run, else None (no input, an unknown rank, an initializer
    a feed may replace, whose shape no one checks, or a kiln.train module, whose forward
    takes the tensors it is given)."""
    ins = site.node.inputs
    if site.target.module or i >= len(ins) or ins[i] is None or \
            ins[i].meta.get("overridable"):
        return None
    t = ins[i].type
    return tuple(t.shape) if isinstance(t, TensorType) and t.shape is not None else None


def known_rank(site, i: int = 0) -> int | None:
    """Input ``i``'s rank where the plan knows it before the run, else None."""
    shape = known_shape(site, i)
    return None if shape is None else len(shape)


def known_dim(site, i: int, d: int) -> int | None:
    """Dim ``d`` (negative: from the end) of input ``i`` where the plan knows its size."""
    shape = known_shape(site, i)
    if shape is None or not -len(shape) <= d < len(shape):
        return None
    n = shape[d]
    return n if isinstance(n, int) else None


def one_element(site, i: int) -> bool | None:
    """Whether optional input ``i`` is absent or holds one element, where the plan knows."""
    if not site.has_input(i):
        return True
    shape = known_shape(site, i)
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    return math.prod(shape) == 1


def nonempty(site, i: int = 0) -> bool | None:
    """Whether input ``i`` holds elements, where the plan knows its sizes (a known 0 says
    no; a size known only at run time leaves it open)."""
    shape = known_shape(site, i)
    if shape is None:
        return None
    if any(isinstance(d, int) and d == 0 for d in shape):
        return False
    return True if all(isinstance(d, int) for d in shape) else None


def fact(known, test) -> bool | None:
    """``test(known)`` for a fact the plan knows before the run (``known`` not None), else
    None (known only at run time)."""
    return None if known is None else bool(test(known))


def dtype_in(site, i: int, dtypes: tuple[torch.dtype, ...]) -> bool | None:
    """Whether input ``i``'s dtype is one of ``dtypes``, where the plan knows it (a type
    torch lacks is in none of them)."""
    return fact(known_dtype(site, i), lambda d: TORCH_OF.get(d) in dtypes)


def decided(site, facts, run, check):
    """``run`` for a node whose kernel computes only where each of ``facts`` holds (each
    True, False, or None where known only at run time; see :func:`fact`): None (decline the
    node when the session is made) when one is known false, ``run`` itself when all are
    known true, else ``run`` behind ``check``, which takes the same arguments (the kernel
    context left out) and says each call whether they hold (NotImplemented where not: the
    next kernel runs the call)."""
    facts = list(facts)
    if False in facts:
        return None
    if None not in facts:
        return run
    # a fact known only at run time (a type, a rank, a size) is checked each call
    if site.wants_ctx:
        return lambda ctx, *a: run(ctx, *a) if check(*a) else NotImplemented
    return lambda *a: run(*a) if check(*a) else NotImplemented


def bound(fn, site):
    """Plain kernel ``fn`` (inputs positional, attributes keyword-only) bound to the node's
    attributes as the registry binds it; sets ``site.wants_ctx`` when it takes a context."""
    run, site.wants_ctx = Kernel(fn).bind(site)
    return run


def gated(site, dtypes: tuple[torch.dtype, ...] | None, run, same: bool = False,
          rank=None):
    """``run`` for a node whose first input's dtype is one of ``dtypes`` (None: any) and,
    with ``same``, whose other inputs share it, and (``rank``, a test of an int) whose
    first input's rank passes ``rank``: None (decline the node) when what the plan knows
    rules it out, ``run`` itself when every type (and the rank) is known and allowed, else
    ``run`` behind a check each call (NotImplemented for another). A ``run`` that takes the
    kernel context first (``site.wants_ctx``) keeps it first."""
    ok = known_ok(site, dtypes, same)  # None rules the node out, False: known at run time
    typed_ok = False if ok is None else (True if ok else None)
    ranked = True if rank is None else fact(known_rank(site), rank)
    allowed = None if dtypes is None else frozenset(dtypes)

    def allows(x, *rest) -> bool:
        return (allowed is None or x.dtype in allowed) and \
            (not same or all(t is None or t.dtype == x.dtype for t in rest)) and \
            (rank is None or rank(x.dim()))

    return decided(site, (typed_ok, ranked), run, allows)


def typed(dtypes: tuple[torch.dtype, ...] | None, fn, same: bool = False, when=None,
          rank=None):
    """The prepared kernel of plain kernel ``fn``, which computes only when its first
    input's dtype is one of ``dtypes`` (None: any) and, with ``same``, its other inputs
    have that dtype too, and only for nodes ``when(site)`` accepts (attributes it
    covers; None: all), and whose first input's rank passes ``rank`` (a test of an int;
    None: any). Where the plan knows those types, a node of others is declined
    while the session is made (the plan picks the next kernel, and the placement report
    says so) and ``fn`` runs unchecked; only where a type is unknown before the run does
    each call check it and hand another type on (:func:`gated`)."""
    # a builtin (torch.sigmoid) takes no attributes and has no signature to read
    plain = Kernel(fn) if isinstance(fn, types.FunctionType) else None

    def prepare(site):
        if when is not None and not when(site):
            return None
        run, site.wants_ctx = (fn, False) if plain is None else plain.bind(site)
        return gated(site, dtypes, run, same, rank)

    prepare.__name__ = prepare.__qualname__ = fn.__name__
    prepare.__module__ = fn.__module__
    return prepare
