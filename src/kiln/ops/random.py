"""Random generators. A node with a ``seed`` owns a generator seeded once, so a session
replays the same sequence of draws run after run (like ONNX Runtime, successive runs of
one session differ); nodes without a seed draw from a process-wide generator."""

from __future__ import annotations

import numpy as np

from kiln.ir import DType
from kiln.ops.registry import Kernel, op

_SHARED = np.random.default_rng()


def set_seed(seed: int) -> None:
    """Reseed the process-wide generator that nodes without a ``seed`` draw from
    (onnxruntime's ``set_seed``)."""
    global _SHARED
    _SHARED = np.random.default_rng(int(seed))


def _seeded(fn):
    """The prepared kernel of ``fn(rng, *inputs, **attrs)``: a node with a ``seed`` gets its
    own generator when the plan prepares it (so it lives as long as the plan); one without
    draws from the process-wide generator at each call (``set_seed`` may replace it)."""
    plain = Kernel(fn)

    def prepare(site):
        seed = site.attr("seed")
        # hash() of a float is stable across processes (only str hashing is salted).
        own = None if seed is None else np.random.default_rng(abs(hash(float(seed))))
        attrs = plain.call_attrs(site.attrs)

        def run(*inputs):
            return fn(_SHARED if own is None else own, *inputs, **attrs)

        return run

    prepare.__name__ = prepare.__qualname__ = fn.__name__
    return prepare


def _dtype(dtype, like=None) -> np.dtype:
    if dtype is None:
        return np.asarray(like).dtype
    return DType(dtype).numpy


@op("RandomNormal", 1, deterministic=False, differentiable=False, prepare=True)
@_seeded
def random_normal(rng, *, shape=None, dtype=1, mean=0.0, scale=1.0):
    return rng.normal(mean, scale, tuple(shape)).astype(_dtype(dtype))


@op("RandomUniform", 1, deterministic=False, differentiable=False, prepare=True)
@_seeded
def random_uniform(rng, *, shape=None, dtype=1, low=0.0, high=1.0):
    return rng.uniform(low, high, tuple(shape)).astype(_dtype(dtype))


@op("RandomNormalLike", 1, deterministic=False, differentiable=False, prepare=True)
@_seeded
def random_normal_like(rng, x, *, dtype=None, mean=0.0, scale=1.0):
    x = np.asarray(x)
    return rng.normal(mean, scale, x.shape).astype(_dtype(dtype, x))


@op("RandomUniformLike", 1, deterministic=False, differentiable=False, prepare=True)
@_seeded
def random_uniform_like(rng, x, *, dtype=None, low=0.0, high=1.0):
    x = np.asarray(x)
    return rng.uniform(low, high, x.shape).astype(_dtype(dtype, x))


@op("Bernoulli", 15, deterministic=False, differentiable=False, prepare=True)
@_seeded
def bernoulli(rng, x, *, dtype=None):
    x = np.asarray(x)
    return (rng.random(x.shape) < x).astype(_dtype(dtype, x))


@op("Multinomial", 7, deterministic=False, differentiable=False, prepare=True)
@_seeded
def multinomial(rng, x, *, dtype=6, sample_size=1):
    """Draws ``sample_size`` class indices per row of unnormalized log-probabilities."""
    logits = np.asarray(x, dtype=np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(p, axis=1)
    u = rng.random((logits.shape[0], sample_size)) * cdf[:, -1:]
    idx = (u[:, :, None] >= cdf[:, None, :]).sum(axis=-1)
    return np.minimum(idx, logits.shape[1] - 1).astype(_dtype(dtype))
