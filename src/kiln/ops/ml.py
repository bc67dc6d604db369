"""Classic-ML ops of the ``ai.onnx.ml`` domain: ArrayFeatureExtractor, Binarizer,
LabelEncoder and TreeEnsemble (v5, evaluated for all rows and trees at once, one tree
level per step)."""

from __future__ import annotations

import numpy as np

from kiln.ops.registry import op

DOMAIN = "ai.onnx.ml"


@op("ArrayFeatureExtractor", 1, domain=DOMAIN)
def array_feature_extractor(x, indices):
    x = np.asarray(x)
    y = np.take(x, np.asarray(indices, dtype=np.int64).reshape(-1), axis=-1)
    return y.reshape(1, -1) if x.ndim == 1 else y


@op("Binarizer", 1, domain=DOMAIN)
def binarizer(x, *, threshold=0.0):
    x = np.asarray(x)
    return (x > threshold).astype(x.dtype)


# -- LabelEncoder ----------------------------------------------------------------------


def _lookup(x: np.ndarray, keys: np.ndarray, values: np.ndarray, default) -> np.ndarray:
    """Map each element of ``x`` through keys -> values (the last of repeated keys wins;
    a NaN key matches NaN inputs); elements without a key get ``default``."""
    out_dtype = values.dtype
    if x.dtype == object or keys.dtype == object:
        table = dict(zip(keys.tolist(), values.tolist()))
        flat = [table.get(k, default) for k in x.reshape(-1).tolist()]
        y = np.empty(len(flat), dtype=out_dtype)
        y[:] = flat
        return y.reshape(x.shape)
    y = np.full(x.shape, default, dtype=out_dtype)
    is_float = keys.dtype.kind == "f"
    key_nan = np.isnan(keys) if is_float else np.zeros(len(keys), bool)
    if key_nan.any():
        y[np.isnan(x)] = values[np.nonzero(key_nan)[0][-1]]
    keys, values = keys[~key_nan], values[~key_nan]
    if len(keys):
        # Keep each key's last occurrence, then binary-search the sorted keys.
        rev_keys, first = np.unique(keys[::-1], return_index=True)
        vals = values[::-1][first]
        pos = np.clip(np.searchsorted(rev_keys, x), 0, len(rev_keys) - 1)
        hit = rev_keys[pos] == x
        y[hit] = vals[pos[hit]]
    return y


def _first_set(*pairs):
    for value, dtype in pairs:
        if value is not None:
            return np.asarray(value, dtype=dtype)
    return None


@op("LabelEncoder", 2, domain=DOMAIN)
def label_encoder(x, *, keys_floats=None, keys_int64s=None, keys_strings=None,
                  keys_tensor=None, values_floats=None, values_int64s=None,
                  values_strings=None, values_tensor=None, default_float=-0.0,
                  default_int64=-1, default_string="_Unused", default_tensor=None):
    x = np.asarray(x)
    keys = _first_set((keys_tensor, None), (keys_strings, object), (keys_int64s, np.int64),
                      (keys_floats, np.float32))
    values = _first_set((values_tensor, None), (values_strings, object),
                        (values_int64s, np.int64), (values_floats, np.float32))
    if keys is None or values is None:
        raise ValueError("LabelEncoder needs one keys_* and one values_* attribute")
    if default_tensor is not None:
        default = np.asarray(default_tensor).reshape(-1)[0]
    elif values.dtype == object:
        default = default_string
    elif values.dtype.kind in "iu":
        default = default_int64
    else:
        default = default_float
    return _lookup(x, keys.reshape(-1), values.reshape(-1), default)


@op("LabelEncoder", 1, domain=DOMAIN)
def label_encoder_v1(x, *, classes_strings=None, default_int64=-1, default_string="_Unused"):
    """Strings -> their index in classes_strings, or integers -> the class at that index."""
    x = np.asarray(x)
    classes = np.empty(len(classes_strings or []), dtype=object)
    classes[:] = classes_strings or []
    index = np.arange(len(classes), dtype=np.int64)
    if x.dtype == object:
        return _lookup(x, classes, index, default_int64)
    return _lookup(x.astype(np.int64), index, classes, default_string)


# -- TreeEnsemble ----------------------------------------------------------------------

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)


def _member_sets(modes: np.ndarray, membership_values) -> dict[int, np.ndarray]:
    """BRANCH_MEMBER node -> its set; sets are listed in node order, NaN-delimited."""
    if membership_values is None:
        return {}
    vals = np.asarray(membership_values, dtype=np.float64).reshape(-1)
    cuts = np.nonzero(np.isnan(vals))[0]
    sets = np.split(vals, cuts)
    sets = [s[~np.isnan(s)] for s in sets]
    return dict(zip(np.nonzero(modes == _MEMBER)[0].tolist(), sets))


def _probit(p: np.ndarray) -> np.ndarray:
    """Inverse standard-normal CDF (Acklam's rational approximation, |rel err| < 1.2e-9)."""
    a = [-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
         1.383577518672690e+02, -3.066479806614716e+01, 2.506628277459239e+00]
    b = [-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
         6.680131188771972e+01, -1.328068155288572e+01]
    c = [-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
         -2.549732539343734e+00, 4.374664141464968e+00, 2.938163982698783e+00]
    d = [7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
         3.754408661907416e+00]
    p = np.asarray(p, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.sqrt(-2 * np.log(np.minimum(p, 1 - p)))
        tail = (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
        r = (p - 0.5) ** 2
        mid = (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * \
            (p - 0.5) / (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)
    low = p < 0.02425
    return np.where(low, tail, np.where(p > 1 - 0.02425, -tail, mid))


def _post_transform(y: np.ndarray, kind: int) -> np.ndarray:
    if kind == 1:  # SOFTMAX
        e = np.exp(y - y.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if kind == 2:  # LOGISTIC
        return 1.0 / (1.0 + np.exp(-y))
    if kind == 3:  # SOFTMAX_ZERO: zeros stay zero and take no share
        nz = y != 0
        m = np.where(nz, y, -np.inf).max(axis=1, keepdims=True)
        e = np.where(nz, np.exp(y - np.where(np.isfinite(m), m, 0)), 0.0)
        s = e.sum(axis=1, keepdims=True)
        return np.where(s > 0, e / np.where(s > 0, s, 1), 0.0)
    if kind == 4:  # PROBIT
        return _probit(y)
    return y


def _branch(mode: np.ndarray, v: np.ndarray, split: np.ndarray) -> np.ndarray:
    return np.select(
        [mode == _LEQ, mode == _LT, mode == _GTE, mode == _GT, mode == _EQ, mode == _NEQ],
        [v <= split, v < split, v >= split, v > split, v == split, v != split], False)


@op("TreeEnsemble", 5, domain=DOMAIN)
def tree_ensemble(x, *, aggregate_function=1, leaf_targetids=None, leaf_weights=None,
                  membership_values=None, n_targets=None, nodes_falseleafs=None,
                  nodes_falsenodeids=None, nodes_featureids=None, nodes_hitrates=None,
                  nodes_missing_value_tracks_true=None, nodes_modes=None, nodes_splits=None,
                  nodes_trueleafs=None, nodes_truenodeids=None, post_transform=0,
                  tree_roots=None):
    x = np.asarray(x)
    xf = x.astype(np.float64).reshape(x.shape[0], -1)
    rows = np.arange(xf.shape[0])[:, None]
    modes = np.asarray(nodes_modes).reshape(-1).astype(np.int64)
    splits = np.asarray(nodes_splits, dtype=np.float64).reshape(-1)
    feature = np.asarray(nodes_featureids, dtype=np.int64)
    true_id = np.asarray(nodes_truenodeids, dtype=np.int64)
    false_id = np.asarray(nodes_falsenodeids, dtype=np.int64)
    true_leaf = np.asarray(nodes_trueleafs, dtype=bool)
    false_leaf = np.asarray(nodes_falseleafs, dtype=bool)
    nan_true = (np.zeros(len(modes), bool) if nodes_missing_value_tracks_true is None
                else np.asarray(nodes_missing_value_tracks_true, dtype=bool))
    members = _member_sets(modes, membership_values)
    # State per (row, tree): the node it sits at, or once it reached a leaf, the leaf.
    roots = np.asarray(tree_roots, dtype=np.int64)
    cur = np.broadcast_to(roots, (xf.shape[0], len(roots))).copy()
    done = np.zeros(cur.shape, dtype=bool)
    for _ in range(len(modes) + 1):  # no path is longer than the node count
        if done.all():
            break
        node = np.where(done, 0, cur)
        v = xf[rows, feature[node]]
        go = _branch(modes[node], v, splits[node])
        for m, s in members.items():
            at = node == m
            go = np.where(at, np.isin(v, s), go)
        # NaN fails every comparison but !=; nodes may send it to the true branch anyway.
        go = go | (np.isnan(v) & nan_true[node])
        nxt = np.where(go, true_id[node], false_id[node])
        leaf = np.where(go, true_leaf[node], false_leaf[node])
        cur = np.where(done, cur, nxt)
        done = done | leaf
    else:
        raise ValueError("TreeEnsemble: a tree has a cycle (a path never reaches a leaf)")
    targets = np.asarray(leaf_targetids, dtype=np.int64)[cur]
    weights = np.asarray(leaf_weights, dtype=np.float64).reshape(-1)[cur]
    n_out = int(n_targets) if n_targets is not None else int(targets.max(initial=-1)) + 1
    y = _aggregate(targets, weights, xf.shape[0], n_out, aggregate_function, len(roots))
    return _post_transform(y, post_transform).astype(x.dtype)


def _aggregate(targets, weights, n_rows, n_out, how, n_trees):
    r = np.broadcast_to(np.arange(n_rows)[:, None], targets.shape)
    if how in (2, 3):  # MIN, MAX; a target no leaf reaches scores 0
        fill = np.inf if how == 2 else -np.inf
        y = np.full((n_rows, n_out), fill)
        (np.minimum if how == 2 else np.maximum).at(y, (r, targets), weights)
        return np.where(np.isinf(y) & (y == fill), 0.0, y)
    y = np.zeros((n_rows, n_out))
    np.add.at(y, (r, targets), weights)
    return y / n_trees if how == 0 else y
