"""Random generators. A node with a ``seed`` owns a generator seeded once, so a session
replays the same sequence of draws run after run (like ONNX Runtime, successive runs of
one session differ); nodes without a seed draw from a process-wide generator."""

from __future__ import annotations

import weakref

import numpy as np

from kiln.ir import DType
from kiln.ops.registry import op

_SHARED = np.random.default_rng()
_SEEDED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def set_seed(seed: int) -> None:
    """Reseed the process-wide generator that nodes without a ``seed`` draw from
    (onnxruntime's ``set_seed``)."""
    global _SHARED
    _SHARED = np.random.default_rng(int(seed))


def _rng(ctx, seed) -> np.random.Generator:
    if seed is None:
        return _SHARED
    # Generators live as long as the plan that holds the node (nodes take no weakrefs).
    per_plan = _SEEDED.setdefault(ctx.runner, {})
    gen = per_plan.get(id(ctx.node))
    if gen is None:
        # hash() of a float is stable across processes (only str hashing is salted).
        gen = per_plan[id(ctx.node)] = np.random.default_rng(abs(hash(float(seed))))
    return gen


def _dtype(dtype, like=None) -> np.dtype:
    if dtype is None:
        return np.asarray(like).dtype
    return DType(dtype).numpy


@op("RandomNormal", 1, deterministic=False, differentiable=False)
def random_normal(ctx, *, shape=None, dtype=1, mean=0.0, scale=1.0, seed=None):
    return _rng(ctx, seed).normal(mean, scale, tuple(shape)).astype(_dtype(dtype))


@op("RandomUniform", 1, deterministic=False, differentiable=False)
def random_uniform(ctx, *, shape=None, dtype=1, low=0.0, high=1.0, seed=None):
    return _rng(ctx, seed).uniform(low, high, tuple(shape)).astype(_dtype(dtype))


@op("RandomNormalLike", 1, deterministic=False, differentiable=False)
def random_normal_like(ctx, x, *, dtype=None, mean=0.0, scale=1.0, seed=None):
    x = np.asarray(x)
    return _rng(ctx, seed).normal(mean, scale, x.shape).astype(_dtype(dtype, x))


@op("RandomUniformLike", 1, deterministic=False, differentiable=False)
def random_uniform_like(ctx, x, *, dtype=None, low=0.0, high=1.0, seed=None):
    x = np.asarray(x)
    return _rng(ctx, seed).uniform(low, high, x.shape).astype(_dtype(dtype, x))


@op("Bernoulli", 15, deterministic=False, differentiable=False)
def bernoulli(ctx, x, *, dtype=None, seed=None):
    x = np.asarray(x)
    return (_rng(ctx, seed).random(x.shape) < x).astype(_dtype(dtype, x))


@op("Multinomial", 7, deterministic=False, differentiable=False)
def multinomial(ctx, x, *, dtype=6, sample_size=1, seed=None):
    """Draws ``sample_size`` class indices per row of unnormalized log-probabilities."""
    logits = np.asarray(x, dtype=np.float64)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    cdf = np.cumsum(p, axis=1)
    u = _rng(ctx, seed).random((logits.shape[0], sample_size)) * cdf[:, -1:]
    idx = (u[:, :, None] >= cdf[:, None, :]).sum(axis=-1)
    return np.minimum(idx, logits.shape[1] - 1).astype(_dtype(dtype))
