"""Torch kernels for reductions."""

from __future__ import annotations

import torch

from kiln.ops._array import axis as norm_axis
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    REAL,
    axis,
    decided,
    gated,
    ints,
    nonempty,
)

# -- reductions ---------------------------------------------------------------------------


def _reduce_kernel(fn, floats_only: bool, empty_ok: bool):
    allowed = FLOATS if floats_only else REAL

    def build(site):
        axes_attr = site.opset < (13 if site.node.op_type == "ReduceSum" else 18)
        keep = bool(int(site.attr("keepdims", 1)))
        noop = bool(int(site.attr("noop_with_empty_axes", 0)))
        def run(x, axes=None):
            ax = site.attr("axes") if axes_attr else (None if axes is None else ints(axes))
            if not ax:
                if noop and not axes_attr:
                    return x
                ax = list(range(x.dim()))
            dims = tuple(sorted({axis(a, x.dim()) for a in ax}))
            if not dims:
                return x
            return fn(x, dims, keep)

        if not empty_ok:  # an empty input: the NumPy kernel's identity or error
            run = decided(site, [nonempty(site)], run, lambda x, axes=None: x.numel() > 0)
        return run and gated(site, allowed, run)

    return build


def _sum(x, d, k):
    return torch.sum(x, dim=d, keepdim=k, dtype=x.dtype)


def _prod(x, d, k):
    for a in sorted(d, reverse=True):
        x = torch.prod(x, dim=a, keepdim=k, dtype=x.dtype)
    return x


def _mean(x, d, k):
    return torch.mean(x, dim=d, keepdim=k)


def _max(x, d, k):
    return torch.amax(x, dim=d, keepdim=k)


def _min(x, d, k):
    return torch.amin(x, dim=d, keepdim=k)


def _l1(x, d, k):
    return torch.sum(x.abs(), dim=d, keepdim=k)


def _l2(x, d, k):
    return torch.sqrt(torch.sum(x * x, dim=d, keepdim=k))


def _sum_square(x, d, k):
    return torch.sum(x * x, dim=d, keepdim=k)


def _log_sum(x, d, k):
    return torch.log(torch.sum(x, dim=d, keepdim=k))


def _log_sum_exp(x, d, k):
    return torch.logsumexp(x, dim=d, keepdim=k)


# faster than the generic kernels (one torch reduction each, axes resolved once per node);
# (fn, floats only, defined on empty tensors)
kernel("ReduceSum", 1, prepare=True)(_reduce_kernel(_sum, False, True))
kernel("ReduceMean", 1, prepare=True)(_reduce_kernel(_mean, True, False))
kernel("ReduceMax", 1, prepare=True)(_reduce_kernel(_max, False, False))
kernel("ReduceMin", 1, prepare=True)(_reduce_kernel(_min, False, False))
kernel("ReduceProd", 1, prepare=True)(_reduce_kernel(_prod, False, True))
kernel("ReduceL1", 1, prepare=True)(_reduce_kernel(_l1, True, True))
kernel("ReduceL2", 1, prepare=True)(_reduce_kernel(_l2, True, True))
kernel("ReduceSumSquare", 1, prepare=True)(_reduce_kernel(_sum_square, True, True))
kernel("ReduceLogSum", 1, prepare=True)(_reduce_kernel(_log_sum, True, False))
kernel("ReduceLogSumExp", 1, prepare=True)(_reduce_kernel(_log_sum_exp, True, False))


def _arg_kernel(fn):
    def prepare(site):
        axis_, keep = int(site.attr("axis", 0)), bool(int(site.attr("keepdims", 1)))
        last = bool(int(site.attr("select_last_index", 0)))

        def run(x):
            a = norm_axis(axis_, x.dim())
            if last:
                return x.shape[a] - 1 - fn(torch.flip(x, (a,)), dim=a, keepdim=keep)
            return fn(x, dim=a, keepdim=keep)

        # an empty input: the NumPy kernel's error
        run = decided(site, [nonempty(site)], run, lambda x: x.numel() > 0)
        return run and gated(site, REAL, run)

    return prepare


# faster than the generic kernel (no int64 cast)
kernel("ArgMax", 11, prepare=True)(_arg_kernel(torch.argmax))
kernel("ArgMin", 11, prepare=True)(_arg_kernel(torch.argmin))
