"""Linear models and support-vector machines of the ``ai.onnx.ml`` domain:
LinearClassifier, LinearRegressor, SVMClassifier, SVMRegressor. Every row is scored at
once with matrix products; labels follow onnxruntime's rules for two-class models."""

from __future__ import annotations

import numpy as np

from kiln.errors import ShapeError
from kiln.ops.ml_trees import post_transform, transform_code
from kiln.ops.registry import op

DOMAIN = "ai.onnx.ml"


def _rows(x) -> np.ndarray:
    x = np.asarray(x)
    x = x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
    return x.reshape(1, -1) if x.ndim == 1 else x.reshape(x.shape[0], -1)


def _class_labels(attrs: dict) -> np.ndarray:
    if attrs.get("classlabels_strings"):
        return np.array(attrs["classlabels_strings"], dtype=object)
    return np.array(attrs.get("classlabels_ints") or attrs.get("classlabels_int64s") or [],
                    dtype=np.int64)


def _two_scores(s: np.ndarray, kind: int) -> np.ndarray:
    """One decision value per row -> two class scores, as onnxruntime writes them."""
    if kind == 2:  # LOGISTIC
        return np.stack([post_transform(-s, 2), post_transform(s, 2)], axis=1)
    if kind == 4:
        return post_transform(np.stack([-s, s], axis=1), 4)
    return post_transform(np.stack([-s, s], axis=1), kind)


@op("LinearRegressor", 1, domain=DOMAIN)
def linear_regressor(x, *, coefficients=None, intercepts=None, post_transform="NONE",
                     targets=1):
    """x @ coefficients^T + intercepts, one column per target (float32)."""
    x = _rows(x)
    w = np.asarray(coefficients, np.float64).reshape(int(targets), -1)
    y = x.astype(np.float64) @ w.T
    if intercepts is not None:
        y += np.asarray(intercepts, np.float64)
    return _post(y, post_transform).astype(np.float32)


def _post(y: np.ndarray, name) -> np.ndarray:
    return post_transform(y, transform_code(name))


@op("LinearClassifier", 1, domain=DOMAIN, prepare=True)
def linear_classifier(site):
    """(labels, scores): scores x @ W^T + b post-transformed; a single row of W with two
    labels is a binary model (label 1 where the score is positive, scores (-s, s))."""
    attrs = site.attrs
    labels = _class_labels(attrs)
    w = np.asarray(attrs["coefficients"], np.float64)
    b = np.asarray(attrs.get("intercepts") or [0.0], np.float64)
    kind = transform_code(attrs.get("post_transform", "NONE"))

    classes = len(attrs["intercepts"]) if attrs.get("intercepts") else 0

    def run(x):
        x = _rows(x)
        wm = _weights(w, classes, x.shape[1])
        y = x.astype(np.float64) @ wm.T + b
        if wm.shape[0] == 1 and len(labels) == 2:
            s = y[:, 0]
            return labels[(s > 0).astype(np.int64)], _two_scores(s, kind).astype(np.float32)
        if wm.shape[0] == 1:
            s = _post(y, kind)
            win = (s[:, 0] > (0.5 if kind in (2, 4) else 0.0))
            chosen = labels[0] if len(labels) else 1
            if labels.dtype == object:
                return np.where(win, chosen, "").astype(object), s.astype(np.float32)
            return np.where(win, chosen, 0).astype(np.int64), s.astype(np.float32)
        return labels[np.argmax(y, axis=1)], post_transform(y, kind).astype(np.float32)
    return run


def _weights(w: np.ndarray, classes: int, features: int) -> np.ndarray:
    """The (classes, features) weight matrix. With intercepts, onnxruntime takes one row per
    intercept and reads the first classes x features coefficients row by row (its own iris
    example model carries 4 features' weights and is fed 2: only that prefix counts)."""
    rows = classes or max(len(w) // max(features, 1), 1)
    if len(w) < rows * features or (not classes and len(w) != rows * features):
        raise ShapeError(f"LinearClassifier: {len(w)} coefficients do not fit {rows} classes "
                         f"x {features} features")
    return w[:rows * features].reshape(rows, features)


# -- support-vector machines -----------------------------------------------------------


def _kernel(name: str, params, x: np.ndarray, sv: np.ndarray) -> np.ndarray:
    """Kernel matrix K[row, support vector]."""
    gamma, coef0, degree = (list(params) + [0.0, 0.0, 0.0])[:3] if params else (0, 0, 0)
    name = name.upper()
    if name == "RBF":
        d = (x * x).sum(1)[:, None] + (sv * sv).sum(1)[None, :] - 2 * x @ sv.T
        return np.exp(-gamma * np.maximum(d, 0))
    dot = x @ sv.T
    if name == "POLY":
        return (gamma * dot + coef0) ** int(degree)
    if name == "SIGMOID":
        return np.tanh(gamma * dot + coef0)
    return dot


@op("SVMRegressor", 1, domain=DOMAIN)
def svm_regressor(x, *, coefficients=None, kernel_params=None, kernel_type="LINEAR",
                  n_supports=0, one_class=0, post_transform="NONE", rho=None,
                  support_vectors=None):
    """sum_j coef_j K(x, sv_j) + rho (or the linear x . coef + rho without support
    vectors); one-class models give +1 / -1. Output (rows, 1) float32."""
    x = _rows(x).astype(np.float64)
    coef = np.asarray(coefficients, np.float64)
    if n_supports:
        sv = np.asarray(support_vectors, np.float64).reshape(int(n_supports), -1)
        y = _kernel(kernel_type, kernel_params, x, sv) @ coef
    else:
        y = x @ coef
    y = y + (rho[0] if rho else 0.0)
    if one_class:
        y = np.where(y > 0, 1.0, -1.0)
    return _post(y.reshape(-1, 1), post_transform).astype(np.float32)


def _pair_probabilities(pairs: np.ndarray, k: int, iters: int = 100) -> np.ndarray:
    """Class probabilities from pairwise ones (rows, k, k) by Wu, Lin and Weng's coupling
    (libsvm's method), all rows at once."""
    n = pairs.shape[0]
    r2 = pairs ** 2
    q = -pairs.transpose(0, 2, 1) * pairs
    diag = r2.sum(axis=1) - r2[:, np.arange(k), np.arange(k)]
    q[:, np.arange(k), np.arange(k)] = diag
    p = np.full((n, k), 1.0 / k)
    eps = 0.005 / k
    for _ in range(max(iters, k)):
        qp = np.einsum("nij,nj->ni", q, p)
        pqp = (p * qp).sum(1)
        live = np.abs(qp - pqp[:, None]).max(1) >= eps
        if not live.any():
            break
        for t in range(k):
            diff = np.where(live, (-qp[:, t] + pqp) / q[:, t, t], 0.0)
            p[:, t] += diff
            pqp = (pqp + diff * (diff * q[:, t, t] + 2 * qp[:, t])) / (1 + diff) ** 2
            p /= (1 + diff)[:, None]
            qp = (qp + diff[:, None] * q[:, t, :]) / (1 + diff)[:, None]
    return p


@op("SVMClassifier", 1, domain=DOMAIN, prepare=True)
def svm_classifier(site):
    """(labels, scores) of a libsvm-style classifier: one-vs-one decision values and
    votes with support vectors (probabilities by pairwise coupling when prob_a/prob_b
    are given), or one linear score per class without them."""
    a = site.attrs
    labels = _class_labels(a)
    k = max(len(labels), 1)
    kind = transform_code(a.get("post_transform", "NONE"))
    coef = np.asarray(a.get("coefficients") or [], np.float64)
    rho = np.asarray(a.get("rho") or [0.0], np.float64)
    per_class = np.asarray(a.get("vectors_per_class") or [], np.int64)
    start = np.concatenate([[0], np.cumsum(per_class)])
    n_sv = int(per_class.sum())
    prob_a, prob_b = a.get("prob_a"), a.get("prob_b")
    positive = bool(len(coef) and coef.min() >= 0)

    def run(x):
        x = _rows(x).astype(np.float64)
        if n_sv == 0:  # linear: one score per class
            w = coef.reshape(k, -1)
            y = x @ w.T + (rho if len(rho) == k else rho[0])
            return labels[np.argmax(y, axis=1)], post_transform(y, kind).astype(np.float32)
        sv = np.asarray(a["support_vectors"], np.float64).reshape(n_sv, -1)
        kern = _kernel(a.get("kernel_type", "LINEAR"), a.get("kernel_params"), x, sv)
        c = coef.reshape(k - 1, n_sv)
        votes = np.zeros((x.shape[0], k), np.int64)
        decisions = []
        for i in range(k):
            si = slice(start[i], start[i + 1])
            for j in range(i + 1, k):
                sj = slice(start[j], start[j + 1])
                s = rho[len(decisions)] + kern[:, si] @ c[j - 1, si] + kern[:, sj] @ c[i, sj]
                decisions.append(s)
                votes[:, i] += s > 0
                votes[:, j] += s <= 0
        d = np.stack(decisions, axis=1)
        label = labels[np.argmax(votes, axis=1)]
        if k == 2 and positive and not prob_a:
            label = labels[(votes[:, 1] >= 1).astype(np.int64)]
        if prob_a:
            pa, pb = np.asarray(prob_a, np.float64), np.asarray(prob_b, np.float64)
            pij = np.clip(1.0 / (1.0 + np.exp(d * pa + pb)), 1e-7, 1 - 1e-7)
            pairs = np.zeros((x.shape[0], k, k))
            iu, ju = np.triu_indices(k, 1)
            pairs[:, iu, ju] = pij
            pairs[:, ju, iu] = 1 - pij
            return label, post_transform(_pair_probabilities(pairs, k), kind).astype(
                np.float32)
        if d.shape[1] == 1:
            return label, _two_scores(d[:, 0], kind).astype(np.float32)
        return label, post_transform(d, kind).astype(np.float32)
    return run
