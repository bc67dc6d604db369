"""ai.onnx.ml ops on hand-built nodes, against onnxruntime: what converters rarely write
(every post_transform, every aggregate function, base values, every branch mode, missing
values, maps in and out), on both Kiln backends."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln

ort = pytest.importorskip("onnxruntime")

ML = "ai.onnx.ml"
MODES = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ"]


def _model(node, inputs, outputs, ml_opset: int = 3) -> bytes:
    graph = helper.make_graph([node], "ml", inputs, outputs)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                helper.make_opsetid(ML, ml_opset)])
    m.ir_version = 8
    return m.SerializeToString()


def _check(onx: bytes, feed: dict, rtol=1e-5, atol=1e-6):
    want = ort.InferenceSession(onx, providers=["CPUExecutionProvider"]).run(None, feed)
    for backend in ("numpy", "torch"):
        got = kiln.InferenceSession(onx, backend=backend).run(None, feed)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if isinstance(w, list):
                assert g == pytest.approx(w) if not isinstance(w[0], dict) else \
                    [dict(d) for d in g] == [pytest.approx(d) for d in w]
                continue
            assert np.asarray(g).shape == w.shape, backend
            if w.dtype.kind == "f":
                np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=backend)
            else:
                np.testing.assert_array_equal(g, w, err_msg=backend)


def _forest(n_trees=4, depth=3, n_features=4, n_targets=2, seed=0, modes=("BRANCH_LEQ",),
            missing=False):
    """Complete random trees as TreeEnsemble{Classifier,Regressor} node attributes."""
    rng = np.random.default_rng(seed)
    a = {k: [] for k in ("nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_modes",
                         "nodes_values", "nodes_truenodeids", "nodes_falsenodeids",
                         "nodes_missing_value_tracks_true")}
    leaves = {k: [] for k in ("treeids", "nodeids", "ids", "weights")}
    n_inner = 2 ** depth - 1
    for t in range(n_trees):
        for i in range(2 ** (depth + 1) - 1):
            inner = i < n_inner
            a["nodes_treeids"].append(t)
            a["nodes_nodeids"].append(i)
            a["nodes_featureids"].append(int(rng.integers(n_features)) if inner else 0)
            a["nodes_modes"].append(str(rng.choice(modes)) if inner else "LEAF")
            a["nodes_values"].append(float(np.round(rng.normal(), 1)) if inner else 0.0)
            a["nodes_truenodeids"].append(2 * i + 1 if inner else 0)
            a["nodes_falsenodeids"].append(2 * i + 2 if inner else 0)
            a["nodes_missing_value_tracks_true"].append(int(missing and rng.random() < .5))
            if not inner:
                for k in range(n_targets):
                    leaves["treeids"].append(t)
                    leaves["nodeids"].append(i)
                    leaves["ids"].append(k)
                    leaves["weights"].append(float(rng.normal()))
    return a, leaves


def _x(rows=64, n_features=4, seed=1, nan=False):
    x = np.round(np.random.default_rng(seed).normal(size=(rows, n_features)), 1)
    if nan:
        x[::3, 1] = np.nan
    return x.astype(np.float32)


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
def test_tree_regressor_aggregates_and_base_values(aggregate):
    a, leaves = _forest()
    node = helper.make_node("TreeEnsembleRegressor", ["X"], ["Y"], domain=ML, n_targets=2,
                            aggregate_function=aggregate, base_values=[0.5, -1.0],
                            **a, **{f"target_{k}": v for k, v in leaves.items()})
    onx = _model(node, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 4])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 2])])
    _check(onx, {"X": _x()})


@pytest.mark.parametrize("opset", [1, 3])
def test_tree_regressor_branch_modes_and_missing_values(opset):
    a, leaves = _forest(n_trees=3, depth=4, modes=MODES, missing=True)
    node = helper.make_node("TreeEnsembleRegressor", ["X"], ["Y"], domain=ML, n_targets=2,
                            **a, **{f"target_{k}": v for k, v in leaves.items()})
    onx = _model(node, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 4])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 2])], opset)
    _check(onx, {"X": _x(nan=True)})


@pytest.mark.parametrize("transform", ["NONE", "SOFTMAX", "LOGISTIC", "SOFTMAX_ZERO"])
def test_tree_classifier_post_transforms(transform):
    a, leaves = _forest(n_targets=3, seed=2)
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["label", "scores"], domain=ML,
                            classlabels_strings=["a", "b", "c"], post_transform=transform,
                            base_values=[0.1, 0.0, -0.2],
                            **a, **{f"class_{k}": v for k, v in leaves.items()})
    onx = _model(node, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 4])],
                 [helper.make_tensor_value_info("label", TensorProto.STRING, [None]),
                  helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 3])])
    _check(onx, {"X": _x()})


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC"])
def test_tree_classifier_binary_one_score(transform):
    a, leaves = _forest(n_targets=1, seed=3)
    node = helper.make_node("TreeEnsembleClassifier", ["X"], ["label", "scores"], domain=ML,
                            classlabels_int64s=[0, 1], post_transform=transform,
                            base_values=[0.2],
                            **a, **{f"class_{k}": v for k, v in leaves.items()})
    onx = _model(node, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 4])],
                 [helper.make_tensor_value_info("label", TensorProto.INT64, [None]),
                  helper.make_tensor_value_info("scores", TensorProto.FLOAT, [None, 2])])
    _check(onx, {"X": _x()})


def _one_input(op, x, out_type, attrs, in_type=TensorProto.FLOAT, shape=None, n_out=1):
    node = helper.make_node(op, ["X"], [f"Y{i}" for i in range(n_out)], domain=ML, **attrs)
    outs = [helper.make_tensor_value_info(f"Y{i}", t, None) if isinstance(t, int) else
            helper.make_value_info(f"Y{i}", t)
            for i, t in enumerate(out_type if n_out > 1 else [out_type])]
    onx = _model(node, [helper.make_tensor_value_info("X", in_type, shape or list(x.shape))],
                 outs)
    _check(onx, {"X": x})


@pytest.mark.parametrize("transform", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_linear_classifier(transform):
    w = np.random.default_rng(4).normal(size=(3, 4)).round(2)
    _one_input("LinearClassifier", _x(), [TensorProto.INT64, TensorProto.FLOAT],
               dict(coefficients=w.reshape(-1).tolist(), intercepts=[0.1, -0.2, 0.0],
                    classlabels_ints=[5, 6, 7], post_transform=transform), n_out=2)


def test_linear_regressor_two_targets():
    w = np.random.default_rng(5).normal(size=(2, 4)).round(2)
    _one_input("LinearRegressor", _x(), TensorProto.FLOAT,
               dict(coefficients=w.reshape(-1).tolist(), intercepts=[1.0, -1.0], targets=2))


@pytest.mark.parametrize("kernel", ["LINEAR", "POLY", "RBF", "SIGMOID"])
def test_svm_regressor_kernels(kernel):
    rng = np.random.default_rng(6)
    sv = rng.normal(size=(5, 4)).round(2)
    _one_input("SVMRegressor", _x(), TensorProto.FLOAT,
               dict(support_vectors=sv.reshape(-1).tolist(), n_supports=5,
                    coefficients=rng.normal(size=5).round(2).tolist(), rho=[0.3],
                    kernel_type=kernel, kernel_params=[0.2, 0.5, 3.0]))


def test_svm_regressor_one_class():
    rng = np.random.default_rng(7)
    _one_input("SVMRegressor", _x(), TensorProto.FLOAT,
               dict(support_vectors=rng.normal(size=12).round(2).tolist(), n_supports=3,
                    coefficients=[0.5, -0.2, 0.4], rho=[-0.1], one_class=1,
                    kernel_type="RBF", kernel_params=[0.3, 0.0, 0.0]))


def test_transforms():
    x = _x()
    _one_input("Scaler", x, TensorProto.FLOAT, dict(offset=[0.1, 0.2, 0.3, 0.4],
                                                    scale=[2.0, 1.0, 0.5, 3.0]))
    for norm in ("MAX", "L1", "L2"):
        _one_input("Normalizer", x, TensorProto.FLOAT, dict(norm=norm))
    _one_input("Binarizer", x, TensorProto.FLOAT, dict(threshold=0.3))
    xn = _x(nan=True)
    _one_input("Imputer", xn, TensorProto.FLOAT,
               dict(imputed_value_floats=[1.0, 2.0, 3.0, 4.0],
                    replaced_value_float=float("nan")))
    xi = np.array([[1, 0, 3], [0, 2, 0]], np.int64)
    _one_input("Imputer", xi, TensorProto.INT64,
               dict(imputed_value_int64s=[7], replaced_value_int64=0), in_type=TensorProto.INT64)


def test_encoders():
    s = np.array([["a", "b"], ["c", "zz"]], dtype=object)
    _one_input("OneHotEncoder", s, TensorProto.FLOAT, dict(cats_strings=["a", "b", "c"]),
               in_type=TensorProto.STRING)
    i = np.array([[1, 5], [3, 1]], np.int64)
    _one_input("OneHotEncoder", i, TensorProto.FLOAT, dict(cats_int64s=[1, 3, 5]),
               in_type=TensorProto.INT64)
    _one_input("CategoryMapper", s, TensorProto.INT64,
               dict(cats_strings=["a", "b", "c"], cats_int64s=[10, 20, 30]),
               in_type=TensorProto.STRING)
    _one_input("CategoryMapper", np.array([10, 30, 99], np.int64), TensorProto.STRING,
               dict(cats_strings=["a", "b", "c"], cats_int64s=[10, 20, 30]),
               in_type=TensorProto.INT64)
    _one_input("ZipMap", _x(rows=3, n_features=3),
               helper.make_sequence_type_proto(helper.make_map_type_proto(
                   TensorProto.STRING, helper.make_tensor_type_proto(TensorProto.FLOAT, []))),
               dict(classlabels_strings=["x", "y", "z"]))


def test_feature_vectorizer():
    node = helper.make_node("FeatureVectorizer", ["A", "B"], ["Y"], domain=ML,
                            inputdimensions=[2, 3])
    onx = _model(node, [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, 2]),
                        helper.make_tensor_value_info("B", TensorProto.FLOAT, [None, 3])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    _check(onx, {"A": _x(rows=5, n_features=2), "B": _x(rows=5, n_features=3, seed=2)})


def test_dict_vectorizer():
    node = helper.make_node("DictVectorizer", ["X"], ["Y"], domain=ML,
                            string_vocabulary=["a", "b", "c"])
    map_type = helper.make_map_type_proto(TensorProto.STRING,
                                          helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    onx = _model(node, [helper.make_value_info("X", map_type)],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    _check(onx, {"X": {"a": 1.5, "c": -2.0, "q": 9.0}})


def test_tree_regressor_probit():
    """PROBIT is the inverse normal CDF: Kiln's equals SciPy's ndtri applied to
    onnxruntime's untransformed scores; onnxruntime's own PROBIT uses a coarser erfinv
    approximation (relative error ~1e-3), so it is matched only to 1e-4."""
    ndtri = pytest.importorskip("scipy.special").ndtri
    a, leaves = _forest(n_targets=1, seed=8)
    # Leaf weights in (0, 0.25) so that the sum over 4 trees is a probability.
    leaves["weights"] = [abs(w) % 0.25 for w in leaves["weights"]]
    x = _x()

    def model(transform):
        node = helper.make_node("TreeEnsembleRegressor", ["X"], ["Y"], domain=ML,
                                n_targets=1, post_transform=transform,
                                **a, **{f"target_{k}": v for k, v in leaves.items()})
        return _model(node, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 4])],
                      [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 1])])

    _check(model("PROBIT"), {"X": x}, rtol=0, atol=1e-4)
    (raw,) = ort.InferenceSession(model("NONE"), providers=["CPUExecutionProvider"]).run(
        None, {"X": x})
    (got,) = kiln.InferenceSession(model("PROBIT")).run(None, {"X": x})
    np.testing.assert_allclose(got, ndtri(raw.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form, cast", [("DENSE", "TO_FLOAT"), ("SPARSE", "TO_FLOAT"),
                                        ("DENSE", "TO_INT64")])
def test_cast_map(form, cast):
    node = helper.make_node("CastMap", ["X"], ["Y"], domain=ML, map_form=form, cast_to=cast,
                            max_map=6)
    map_type = helper.make_map_type_proto(TensorProto.INT64,
                                          helper.make_tensor_type_proto(TensorProto.FLOAT, []))
    out = TensorProto.FLOAT if cast == "TO_FLOAT" else TensorProto.INT64
    onx = _model(node, [helper.make_value_info("X", map_type)],
                 [helper.make_tensor_value_info("Y", out, None)])
    _check(onx, {"X": {4: 2.5, 0: -1.0, 2: 7.0}})


def test_every_ai_onnx_ml_schema_has_a_kernel():
    from kiln.ops import lookup

    schemas = {(s.name, s.since_version) for s in onnx.defs.get_all_schemas_with_history()
               if s.domain == ML and not s.deprecated}
    missing = sorted(k for k in schemas if lookup(ML, k[0], k[1]) is None)
    assert not missing


def test_tree_with_a_cycle_is_a_model_error():
    node = helper.make_node(
        "TreeEnsembleRegressor", ["X"], ["Y"], domain=ML, n_targets=1,
        nodes_treeids=[0, 0, 0], nodes_nodeids=[0, 1, 2], nodes_featureids=[0, 0, 0],
        nodes_modes=["BRANCH_LEQ", "BRANCH_LEQ", "LEAF"], nodes_values=[0.0, 1.0, 0.0],
        nodes_truenodeids=[1, 1, 0], nodes_falsenodeids=[2, 2, 0],
        target_treeids=[0], target_nodeids=[2], target_ids=[0], target_weights=[1.0])
    onx = _model(node, [helper.make_tensor_value_info("X", TensorProto.FLOAT, [None, 1])],
                 [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, 1])])
    with pytest.raises(kiln.ModelLoadError, match="cycle"):
        kiln.InferenceSession(onx).run(None, {"X": np.zeros((2, 1), np.float32)})
