"""Loss functions: NegativeLogLikelihoodLoss and SoftmaxCrossEntropyLoss."""

from __future__ import annotations

import numpy as np

from kiln.ops.registry import op


def _nll(logp, target, weight, ignore_index, reduction):
    """Per-element loss -logp[n, target[n, ...], ...] * weight[target], zero (and
    weightless) where the target is ignore_index; 'mean' divides by the total weight."""
    t = np.asarray(target).astype(np.int64, copy=False)
    keep = None if ignore_index is None else t != ignore_index
    safe = t if keep is None else np.where(keep, t, 0)  # ignored targets may be out of range
    picked = np.take_along_axis(logp, safe[:, None], axis=1)[:, 0]
    w = np.ones_like(picked) if weight is None else weight[safe].astype(logp.dtype)
    if keep is not None:
        w = np.where(keep, w, np.zeros_like(w))
    loss = -picked * w
    if reduction == "none":
        return loss
    total = loss.sum(dtype=np.float64)
    if reduction == "sum":
        return np.asarray(total, dtype=logp.dtype)
    return np.asarray(total / w.sum(dtype=np.float64), dtype=logp.dtype)


@op("NegativeLogLikelihoodLoss", 12)
def nll_loss(input, target, weight=None, *, ignore_index=None, reduction="mean"):
    return _nll(input, target, weight, ignore_index, reduction)


@op("SoftmaxCrossEntropyLoss", 12)
def softmax_cross_entropy_loss(scores, labels, weights=None, *, ignore_index=None,
                               reduction="mean"):
    """Returns (loss, log_prob); log_prob is log_softmax of the scores over the class axis."""
    shifted = scores - scores.max(axis=1, keepdims=True)
    log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    log_prob = log_prob.astype(scores.dtype, copy=False)
    return _nll(log_prob, labels, weights, ignore_index, reduction), log_prob
