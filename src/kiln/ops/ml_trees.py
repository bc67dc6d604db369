"""Tree ensembles of the ``ai.onnx.ml`` domain: TreeEnsembleClassifier/Regressor (v1, v3)
and TreeEnsemble (v5).

Every version is first turned into one flat forest (:class:`Forest`: per node its test,
feature, threshold and both successors; leaves are nodes whose successors are
themselves), then evaluated for all trees and a block of rows at once: each step moves every
(tree, row) pair one level down, so the work is array operations per tree level (blocks
of rows bound the memory), never a Python loop per row or per tree.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.errors import ModelLoadError
from kiln.ops.registry import op

DOMAIN = "ai.onnx.ml"

LEQ, LT, GTE, GT, EQ, NEQ, MEMBER, LEAF = range(8)
_MODE_NAMES = {"BRANCH_LEQ": LEQ, "BRANCH_LT": LT, "BRANCH_GTE": GTE, "BRANCH_GT": GT,
               "BRANCH_EQ": EQ, "BRANCH_NEQ": NEQ, "BRANCH_MEMBER": MEMBER, "LEAF": LEAF}
_TRANSFORMS = {"NONE": 0, "SOFTMAX": 1, "LOGISTIC": 2, "SOFTMAX_ZERO": 3, "PROBIT": 4}
_AGGREGATES = {"AVERAGE": 0, "SUM": 1, "MIN": 2, "MAX": 3}


@dataclass
class Forest:
    """A tree ensemble as flat per-node arrays (leaves point to themselves)."""

    mode: np.ndarray        # int8 per node, LEAF for leaves
    feature: np.ndarray     # int32
    split: np.ndarray       # float32 or float64 thresholds
    true_id: np.ndarray     # int32, global node index
    false_id: np.ndarray    # int32
    nan_true: np.ndarray    # bool: a missing value takes the true branch
    roots: np.ndarray       # int32, one per tree
    members: dict[int, np.ndarray]  # BRANCH_MEMBER node -> its set
    leaf_start: np.ndarray  # int64 per node: where its (target, weight) entries start
    targets: np.ndarray     # int64, leaf entries sorted by node
    weights: np.ndarray     # float64


def transform_code(name) -> int:
    """post_transform as the int TreeEnsemble v5 uses, from v1/v3's string or an int."""
    return name if isinstance(name, int) else _TRANSFORMS[str(name)]


def _leaf_table(n_nodes: int, nodes: np.ndarray, targets, weights):
    order = np.argsort(nodes, kind="stable")
    start = np.searchsorted(nodes[order], np.arange(n_nodes + 1))
    return (start, np.asarray(targets, np.int64)[order],
            np.asarray(weights, np.float64)[order])


def forest_v3(attrs: dict, leaf_prefix: str) -> Forest:
    """The flat forest of a TreeEnsembleClassifier (``leaf_prefix="class"``) or
    TreeEnsembleRegressor (``"target"``) node of version 1 or 3: nodes are named by
    (tree id, node id) there, successors by node id within the tree."""
    tree = np.asarray(attrs["nodes_treeids"], np.int64)
    node = np.asarray(attrs["nodes_nodeids"], np.int64)
    span = int(node.max(initial=0)) + 1
    keys = tree * span + node
    order = np.argsort(keys, kind="stable")

    def index(trees, ids):
        k = np.asarray(trees, np.int64) * span + np.asarray(ids, np.int64)
        pos = np.clip(np.searchsorted(keys[order], k), 0, len(keys) - 1)
        if np.any(keys[order][pos] != k):
            raise ModelLoadError("tree ensemble: a successor or leaf weight names a node id "
                                 "its tree lacks; the model is inconsistent, re-export it")
        return order[pos].astype(np.int32)

    mode = np.array([_MODE_NAMES[m] for m in attrs["nodes_modes"]], np.int8)
    leaf = mode == LEAF
    own = np.arange(len(mode), dtype=np.int32)
    true_id = np.where(leaf, own, index(tree, np.where(leaf, node,
                                                       attrs["nodes_truenodeids"])))
    false_id = np.where(leaf, own, index(tree, np.where(leaf, node,
                                                        attrs["nodes_falsenodeids"])))
    values = attrs.get("nodes_values_as_tensor")
    split = (np.asarray(values).reshape(-1) if values is not None else
             np.asarray(attrs.get("nodes_values") or np.zeros(len(mode)), np.float32))
    nan_true = attrs.get("nodes_missing_value_tracks_true")
    # A tree's root is its first node that no node points to.
    pointed = np.zeros(len(mode), bool)
    pointed[true_id[~leaf]] = True
    pointed[false_id[~leaf]] = True
    unpointed = np.nonzero(~pointed)[0]
    root_trees, first = np.unique(tree[unpointed], return_index=True)
    if len(root_trees) != len(np.unique(tree)):
        raise ModelLoadError("tree ensemble: a tree has no root (every node is pointed to); "
                             "the model is inconsistent, re-export it")
    roots = unpointed[first].astype(np.int32)
    weights = attrs.get(f"{leaf_prefix}_weights_as_tensor")
    if weights is None:
        weights = attrs.get(f"{leaf_prefix}_weights") or []
    start, targets, weights = _leaf_table(
        len(mode), index(attrs.get(f"{leaf_prefix}_treeids") or [],
                         attrs.get(f"{leaf_prefix}_nodeids") or []),
        attrs.get(f"{leaf_prefix}_ids") or [], np.asarray(weights).reshape(-1))
    feature = np.where(leaf, 0, np.asarray(attrs["nodes_featureids"], np.int32))
    return Forest(mode, feature.astype(np.int32), split, true_id,
                  false_id, np.zeros(len(mode), bool) if nan_true is None else
                  np.asarray(nan_true, bool), roots, {}, start, targets, weights)


def _member_sets(modes: np.ndarray, membership_values) -> dict[int, np.ndarray]:
    """BRANCH_MEMBER node -> its set; sets are listed in node order, NaN-delimited."""
    if membership_values is None:
        return {}
    vals = np.asarray(membership_values, dtype=np.float64).reshape(-1)
    sets = [s[~np.isnan(s)] for s in np.split(vals, np.nonzero(np.isnan(vals))[0])]
    return dict(zip(np.nonzero(modes == MEMBER)[0].tolist(), sets))


def forest_v5(attrs: dict) -> Forest:
    """The flat forest of a TreeEnsemble v5 node: its leaves follow its nodes."""
    mode = np.asarray(attrs["nodes_modes"]).reshape(-1).astype(np.int8)
    n, n_leaves = len(mode), len(attrs["leaf_weights"].reshape(-1))
    true_leaf = np.asarray(attrs["nodes_trueleafs"], bool)
    false_leaf = np.asarray(attrs["nodes_falseleafs"], bool)
    true_id = np.asarray(attrs["nodes_truenodeids"], np.int32) + np.where(true_leaf, n, 0)
    false_id = np.asarray(attrs["nodes_falsenodeids"], np.int32) + np.where(false_leaf, n, 0)
    leaves = np.arange(n, n + n_leaves, dtype=np.int32)
    nan_true = attrs.get("nodes_missing_value_tracks_true")
    nan_true = np.zeros(n, bool) if nan_true is None else np.asarray(nan_true, bool)
    start, targets, weights = _leaf_table(n + n_leaves, leaves, attrs["leaf_targetids"],
                                          attrs["leaf_weights"].reshape(-1))
    return Forest(np.concatenate([mode, np.full(n_leaves, LEAF, np.int8)]),
                  np.concatenate([np.asarray(attrs["nodes_featureids"], np.int32),
                                  np.zeros(n_leaves, np.int32)]),
                  np.concatenate([np.asarray(attrs["nodes_splits"]).reshape(-1),
                                  np.zeros(n_leaves)]).astype(attrs["nodes_splits"].dtype),
                  np.concatenate([true_id, leaves]), np.concatenate([false_id, leaves]),
                  np.concatenate([nan_true, np.zeros(n_leaves, bool)]),
                  np.asarray(attrs["tree_roots"], np.int32),
                  _member_sets(mode, attrs.get("membership_values")), start, targets, weights)


def _branch(mode: np.ndarray, v: np.ndarray, split: np.ndarray) -> np.ndarray:
    return np.select(
        [mode == LEQ, mode == LT, mode == GTE, mode == GT, mode == EQ, mode == NEQ],
        [v <= split, v < split, v >= split, v > split, v == split, v != split], False)


# The test that sends a value the *false* way, per mode, so that the successor is
# children[2 * node + test] with the true child first.
_FALSE_TEST = {LEQ: np.greater, LT: np.greater_equal, GTE: np.less, GT: np.less_equal,
               EQ: np.not_equal, NEQ: np.equal}
_PAIRS_PER_BLOCK = 1 << 18  # (tree, row) pairs per block: bounds the temporaries (~10 MB)


def _depth(f: Forest) -> int:
    """Levels until every tree's every path has reached a leaf."""
    frontier, depth = np.unique(f.roots), 0
    is_leaf = f.mode == LEAF
    while not is_leaf[frontier].all():
        inner = frontier[~is_leaf[frontier]]
        frontier = np.unique(np.concatenate([f.true_id[inner], f.false_id[inner]]))
        depth += 1
        if depth > len(f.mode):
            raise ModelLoadError("tree ensemble: a tree has a cycle (a path never reaches a "
                                 "leaf); the model is inconsistent, re-export it")
    return depth


class Scorer:
    """Scores rows with a forest: every (tree, row) pair moves down one level per step
    (leaves lead to themselves, so a pair that arrived stays), a block of rows at a time;
    then the leaves' weights are aggregated per target."""

    def __init__(self, f: Forest, n_out: int, how: int):
        self.f, self.n_out, self.how = f, n_out, how
        self.depth = _depth(f)
        self.children = np.stack([f.true_id, f.false_id], axis=1).reshape(-1).astype(np.int64)
        self.feature = f.feature.astype(np.int64)
        self.roots = f.roots.astype(np.int64)
        modes = np.unique(f.mode[f.mode != LEAF])
        self.false_test = _FALSE_TEST.get(int(modes[0])) if len(modes) == 1 else None
        self.track_nan = bool(f.nan_true.any())
        count = f.leaf_start[1:] - f.leaf_start[:-1]
        # Sums and averages read a dense (node, target) weight table when it is small.
        self.table = None
        if how in (0, 1) and len(f.mode) * n_out <= 1 << 24:
            table = np.zeros((len(f.mode), n_out))
            node = np.repeat(np.arange(len(f.mode)), count)
            np.add.at(table, (node, f.targets), f.weights)
            self.table = np.ascontiguousarray(table.T)  # (target, node)
        self.groups = self._group_by_target(count) if self.table is not None else None

    def _group_by_target(self, count: np.ndarray) -> np.ndarray | None:
        """When every tree scores one target only (boosted multi-class models), reorder
        the trees by target and return each target's tree range: then each (tree, row)
        pair costs one weight gather, not one per target."""
        f, n_trees = self.f, len(self.roots)
        if self.n_out == 1 or not n_trees:
            return None
        owner = np.full(len(f.mode), -1)
        frontier, ids = self.roots, np.arange(n_trees)
        for _ in range(self.depth + 1):
            owner[frontier] = ids
            inner = f.mode[frontier] != LEAF
            frontier = np.concatenate([f.true_id[frontier[inner]], f.false_id[frontier[inner]]])
            ids = np.concatenate([ids[inner], ids[inner]])
        tree = owner[np.repeat(np.arange(len(f.mode)), count)]
        if (tree < 0).any():
            return None
        low = np.full(n_trees, self.n_out)
        high = np.full(n_trees, -1)
        np.minimum.at(low, tree, f.targets)
        np.maximum.at(high, tree, f.targets)
        if (low != high).any():
            return None
        order = np.argsort(low, kind="stable")
        self.roots = self.roots[order]
        self.weight = self.table.sum(axis=0)
        return np.searchsorted(low[order], np.arange(self.n_out + 1))

    def __call__(self, x: np.ndarray) -> np.ndarray:
        n_rows = x.shape[0]
        xf = np.ascontiguousarray(x.reshape(n_rows, -1), dtype=self.f.split.dtype)
        n_trees = len(self.f.roots)
        step = max(1, _PAIRS_PER_BLOCK // max(n_trees, 1))
        out = np.empty((n_rows, self.n_out))
        for lo in range(0, n_rows, step):
            block = xf[lo:lo + step]
            reached = self._leaves(block).reshape(n_trees, block.shape[0])
            out[lo:lo + step] = self._aggregate(reached)
        return out

    def _leaves(self, xb: np.ndarray) -> np.ndarray:
        # np.take with int64 indices: faster than a[int32 index] per gather.
        f, rows, width = self.f, xb.shape[0], xb.shape[1]
        flat = xb.reshape(-1)
        # Tree-major pairs: neighbours walk the same tree, so its nodes stay in cache.
        cur = np.repeat(self.roots, rows)
        base = np.tile(np.arange(rows, dtype=np.int64) * width, len(self.roots))
        nan_rows = self.track_nan and bool(np.isnan(flat).any())
        take = np.take
        for _ in range(self.depth):
            v = take(flat, base + take(self.feature, cur))
            if self.false_test is not None and not nan_rows:
                go_false = self.false_test(v, take(f.split, cur))
            else:
                go_false = ~self._go_true(cur, v, nan_rows)
            cur = take(self.children, 2 * cur + go_false)
        return cur

    def _go_true(self, cur: np.ndarray, v: np.ndarray, nan_rows: bool) -> np.ndarray:
        f = self.f
        go = _branch(f.mode[cur], v, f.split[cur])
        for node, members in f.members.items():
            at = cur == node
            go[at] = np.isin(v[at], members)
        if nan_rows:  # NaN fails every test but !=; nodes may send it the true way
            go |= np.isnan(v) & f.nan_true[cur]
        return go

    def _aggregate(self, reached: np.ndarray) -> np.ndarray:
        """Aggregate the leaves ``reached`` (trees, rows) per row and target."""
        n_trees, n_rows = reached.shape
        if self.groups is not None:
            y = np.zeros((n_rows, self.n_out))
            for k in range(self.n_out):
                lo, hi = self.groups[k], self.groups[k + 1]
                if hi > lo:
                    y[:, k] = np.take(self.weight, reached[lo:hi]).sum(axis=0)
            return y / n_trees if self.how == 0 else y
        if self.table is not None:
            # Per target, one gather and a sum over trees.
            y = np.stack([np.take(t, reached).sum(axis=0) for t in self.table], axis=1)
            return y / n_trees if self.how == 0 else y
        # MIN/MAX, or a table too large: expand each pair into its leaf's entries.
        f, n_out = self.f, self.n_out
        reached = reached.T  # (rows, trees): entries come out row by row
        count = (f.leaf_start[1:] - f.leaf_start[:-1])[reached].reshape(-1)
        rows = np.repeat(np.repeat(np.arange(n_rows), n_trees), count)
        first = np.repeat(f.leaf_start[reached].reshape(-1), count)
        entry = first + np.arange(len(first)) - np.repeat(np.cumsum(count) - count, count)
        flat = rows * n_out + f.targets[entry]
        if self.how in (0, 1):
            y = np.bincount(flat, f.weights[entry], minlength=n_rows * n_out)
            y = y.reshape(n_rows, n_out)
            return y / n_trees if self.how == 0 else y
        fill = np.inf if self.how == 2 else -np.inf
        y = np.full(n_rows * n_out, fill)
        (np.minimum if self.how == 2 else np.maximum).at(y, flat, f.weights[entry])
        return np.where(y == fill, 0.0, y).reshape(n_rows, n_out)


# -- post transforms -------------------------------------------------------------------


def probit(p: np.ndarray) -> np.ndarray:
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


def post_transform(y: np.ndarray, kind: int) -> np.ndarray:
    """Apply an ai.onnx.ml post_transform (0 NONE, 1 SOFTMAX, 2 LOGISTIC, 3 SOFTMAX_ZERO,
    4 PROBIT) to scores of shape (rows, classes)."""
    if kind == 1:
        e = np.exp(y - y.max(axis=1, keepdims=True))
        return e / e.sum(axis=1, keepdims=True)
    if kind == 2:
        return 1.0 / (1.0 + np.exp(-y))
    if kind == 3:  # SOFTMAX_ZERO: zeros stay zero and take no share
        nz = y != 0
        m = np.where(nz, y, -np.inf).max(axis=1, keepdims=True)
        e = np.where(nz, np.exp(y - np.where(np.isfinite(m), m, 0)), 0.0)
        s = e.sum(axis=1, keepdims=True)
        return np.where(s > 0, e / np.where(s > 0, s, 1), 0.0)
    if kind == 4:
        return probit(y)
    return y


def _float_input(x) -> np.ndarray:
    x = np.asarray(x)
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)


# -- the ops ---------------------------------------------------------------------------


@op("TreeEnsemble", 5, domain=DOMAIN, prepare=True)
def tree_ensemble(site):
    """Scores of a TreeEnsemble v5 node: per target, the aggregate over trees of the leaf
    weights each row reaches, post-transformed."""
    attrs = dict(site.attrs)
    forest = forest_v5(attrs)
    n_targets = attrs.get("n_targets")
    n_out = (int(n_targets) if n_targets is not None
             else int(forest.targets.max(initial=-1)) + 1)
    how, kind = int(attrs.get("aggregate_function", 1)), int(attrs.get("post_transform", 0))
    scorer = Scorer(forest, n_out, how)

    def run(x):
        x = np.asarray(x)
        return post_transform(scorer(x), kind).astype(x.dtype)
    return run


@op("TreeEnsembleRegressor", 1, domain=DOMAIN, prepare=True)
def tree_ensemble_regressor(site):
    """v1 and v3: per target, SUM/AVERAGE/MIN/MAX over trees of the leaf weights, plus
    base_values, post-transformed; float32 output as onnxruntime gives."""
    attrs = dict(site.attrs)
    forest = forest_v3(attrs, "target")
    n_out = int(attrs.get("n_targets") or int(forest.targets.max(initial=-1)) + 1)
    how = _AGGREGATES[attrs.get("aggregate_function", "SUM")]
    kind = transform_code(attrs.get("post_transform", "NONE"))
    base = attrs.get("base_values_as_tensor")
    base = np.asarray(attrs.get("base_values") or 0.0 if base is None else base).reshape(-1)
    scorer = Scorer(forest, n_out, how)

    def run(x):
        y = scorer(_float_input(x)) + base
        return post_transform(y, kind).astype(np.float32)
    return run


@op("TreeEnsembleClassifier", 1, domain=DOMAIN, prepare=True)
def tree_ensemble_classifier(site):
    """v1 and v3: (labels, scores). Class scores sum the leaf weights over trees plus
    base_values. With two classes and weights for one class only, that class's score ``s``
    decides as onnxruntime does (s > 0.5 when all weights are positive, else s > 0) and
    the scores become (1-s, s), or (-s, s); LOGISTIC always gives (sigmoid(-s),
    sigmoid(s)), as onnxruntime does since its issue 27533, SOFTMAX and SOFTMAX_ZERO
    change nothing (as in onnxruntime), PROBIT applies to both."""
    attrs = dict(site.attrs)
    forest = forest_v3(attrs, "class")
    labels = attrs.get("classlabels_strings") or attrs.get("classlabels_int64s") or []
    labels = np.array(labels, dtype=object if attrs.get("classlabels_strings") else np.int64)
    n_classes = len(labels)
    kind = transform_code(attrs.get("post_transform", "NONE"))
    base = attrs.get("base_values_as_tensor")
    base = np.asarray(attrs.get("base_values") or [] if base is None else base,
                      np.float64).reshape(-1)
    used = np.unique(forest.targets)
    one_score = n_classes == 2 and len(used) == 1
    positive = bool((forest.weights >= 0).all())
    scorer = Scorer(forest, 2 if one_score else n_classes, 1)

    def run(x):
        if one_score:
            s = scorer(_float_input(x))[:, used[0]]
            s = s + (base[0] if len(base) else 0.0)
            win = s > (0.5 if positive else 0.0)
            if kind == 2:  # sigmoid(-s), sigmoid(s) whatever the weights' signs (the
                # bug onnxruntime fixed in its issue 27533 left all-positive ones as 1-s, s)
                z = post_transform(np.stack([-s, s], axis=1), 2)
            else:  # onnxruntime leaves SOFTMAX and SOFTMAX_ZERO out with one score
                z = np.stack([1 - s, s] if positive else [-s, s], axis=1)
                z = post_transform(z, kind) if kind == 4 else z
            return labels[win.astype(np.int64)], z.astype(np.float32)
        y = scorer(_float_input(x))
        if len(base):
            y = y + base
        return labels[np.argmax(y, axis=1)], post_transform(y, kind).astype(np.float32)
    return run
