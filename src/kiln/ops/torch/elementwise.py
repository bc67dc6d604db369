"""Torch kernels for elementwise math (arithmetic, unary functions, Clip).

They cover the dtypes where torch matches ONNX exactly and decline the rest (integer Div,
say) when the session is made, which then run on the generic or NumPy kernel; a type the
plan does not know before the run is checked each call.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import FLOATS, SIGNED, decided, gated

_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


# -- arithmetic ---------------------------------------------------------------------------

@kernel("Mod", 10, prepare=True)  # faster than the generic kernel on floats (one torch.fmod)
def mod(site):
    fmod = int(site.attr("fmod", 0))

    def run(a, b):
        return torch.fmod(a, b) if fmod else torch.remainder(a, b)

    # an integer zero divisor: the NumPy kernel's result (torch raises); a constant one is
    # settled now, a fed one read each call
    bc = site.const(1)
    if bc is None:
        run = decided(site, [None], run,
                      lambda a, b: a.dtype.is_floating_point or not bool((b == 0).any()))
    elif bc.dtype.kind in "iub" and not bc.all():
        return None
    # floats without fmod: Python's sign rule, which torch.remainder rounds differently
    return gated(site, SIGNED + (torch.uint8,) if fmod else _INTS, run, same=True)


def _variadic(fn):
    def run(*xs):
        r = xs[0]
        for x in xs[1:]:
            r = fn(r, x)
        return r
    return run


# the Tensor op, not array_api_compat's wrapper (gain: benchmarks/results/torch_overrides.md)
kernel("Max", 8, same=True)(_variadic(torch.maximum))
kernel("Min", 8, same=True)(_variadic(torch.minimum))


# -- unary --------------------------------------------------------------------------------

# The plain unary ops (Exp, Log, Sqrt, trigonometry, IsNaN/IsInf...) run the generic kernel:
# since the namespace lookup is cached per array type, their torch kernels gained little.
# Those kept gain more (benchmarks/results/torch_overrides.md).
kernel("Erf", 1, dtypes=FLOATS)(torch.erf)  # the reference is NumPy-only: else a CPU fallback
kernel("Reciprocal", 6, dtypes=FLOATS)(torch.reciprocal)  # no 1.0 / x, no cast
kernel("Floor", 6, dtypes=FLOATS)(torch.floor)  # Tensor op, not array_api_compat's wrapper
kernel("Ceil", 6, dtypes=FLOATS)(torch.ceil)  # Tensor op, not array_api_compat's wrapper
kernel("Round", 1, dtypes=FLOATS)(torch.round)  # Tensor op, not array_api_compat's wrapper




@kernel("Neg", 6, dtypes=SIGNED)  # Tensor op, not array_api_compat's wrapper
def neg(x):
    return torch.neg(x)


@kernel("Abs", 6, dtypes=SIGNED + (torch.uint8,))  # Tensor op, not array_api_compat's wrapper
def abs_(x):
    return torch.abs(x)


@kernel("Sign", 9, dtypes=SIGNED)  # faster than the generic kernel (the namespace's is slow)
def sign(x):
    return torch.sign(x)


def _bounds(lo, hi) -> tuple[float, float] | None:
    """Float bounds hardtanh takes (None: no bound), or None when it is not Clip's function
    (min > max clips everything to max)."""
    lo = -math.inf if lo is None or lo <= -3.4e38 else lo
    hi = math.inf if hi is None or hi >= 3.4e38 else hi
    return (lo, hi) if lo <= hi else None


_FED = object()
"""A Clip bound read each call (a feed, or not a scalar)."""


def _bound(site, i: int):
    """Input ``i`` of a Clip as a float, None when absent, ``_FED`` when a feed or a
    non-scalar (read when the session is made: no run-time hand-off)."""
    if not site.has_input(i):
        return None
    c = site.const(i)
    return float(c) if c is not None and np.ndim(c) == 0 else _FED


@kernel("Clip", 11, prepare=True)  # faster than the generic kernel (one clamp, no casts)
def clip(site):
    """Constant bounds: F.hardtanh, what torch.nn.ReLU6/Hardtanh run, so the gradient is
    theirs (one kernel; zero at the bounds); bounds fed at run time (a training module's
    0-d literals among them): torch.clamp, the same function with one backward kernel
    (its gradient is 1 at the bounds themselves)."""
    lo, hi = _bound(site, 1), _bound(site, 2)
    fixed = _bounds(lo, hi) if _FED not in (lo, hi) else None

    def run(x, lo=None, hi=None):
        if fixed is not None and x.dtype in FLOATS:
            return F.hardtanh(x, *fixed)
        # clamp sets everything to max when min > max, as Clip does
        return x if lo is None and hi is None else torch.clamp(x, lo, hi)
    return gated(site, SIGNED, run, same=True)


@kernel("Clip", 6, until=11, dtypes=FLOATS)  # faster than the generic kernel (one clamp)
def clip6(x, *, min=-3.4028234663852886e38, max=3.4028234663852886e38):  # noqa: A002
    fixed = _bounds(min, max)  # hardtanh as torch.nn.ReLU6 (see Clip-11)
    return F.hardtanh(x, *fixed) if fixed is not None else torch.clamp(x, min, max)


