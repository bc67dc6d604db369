"""scikit-learn models converted by skl2onnx run in Kiln (ai.onnx.ml ops) on both
backends: labels equal sklearn's ``predict``, probabilities are within 1e-5 of
``predict_proba``, and every output equals onnxruntime's on the same file."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest

pytest.importorskip("skl2onnx")
ort = pytest.importorskip("onnxruntime")

from skl2onnx import to_onnx  # noqa: E402
from sklearn import (  # noqa: E402
    compose,
    ensemble,
    impute,
    linear_model,
    naive_bayes,
    neighbors,
    neural_network,
    pipeline,
    preprocessing,
    svm,
    tree,
)

import kiln  # noqa: E402

BACKENDS = ["numpy", "torch"]


def _data(n_classes: int = 3, rows: int = 120, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    score = x[:, 0] + 0.5 * x[:, 1] - x[:, 2] * x[:, 3]
    edges = np.quantile(score, np.linspace(0, 1, n_classes + 1)[1:-1])
    return x, np.digitize(score, edges), (score + 0.1 * x[:, 4]).astype(np.float32)


def _as_array(out):
    """A ZipMap output (list of {label: prob}) as a (rows, classes) array."""
    if isinstance(out, list):
        return np.array([list(d.values()) for d in out], dtype=np.float64)
    return np.asarray(out)


def _run_everywhere(onx: bytes, feed: dict) -> list:
    """Kiln's outputs on each backend, each checked against onnxruntime's; returns the
    NumPy backend's."""
    want = ort.InferenceSession(onx, providers=["CPUExecutionProvider"]).run(None, feed)
    first = None
    for backend in BACKENDS:
        got = kiln.InferenceSession(onx, backend=backend).run(None, feed)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if isinstance(w, list):  # ZipMap: same labels in the same order
                assert [list(d) for d in g] == [list(d) for d in w]
            g, w = _as_array(g), _as_array(w)
            assert g.shape == w.shape, backend
            if w.dtype.kind in "fc":
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=backend)
            else:
                np.testing.assert_array_equal(g, w, err_msg=backend)
        first = first if first is not None else got
    return first


def _convert(model, x, **options) -> bytes:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opts = {id(model): options} if options else None
        return to_onnx(model, x[:1], options=opts, target_opset={"": 17, "ai.onnx.ml": 3}
                       ).SerializeToString()


CLASSIFIERS = {
    "logistic_binary": (lambda: linear_model.LogisticRegression(max_iter=500), 2),
    "logistic_multi": (lambda: linear_model.LogisticRegression(max_iter=500), 3),
    "decision_tree": (lambda: tree.DecisionTreeClassifier(max_depth=5, random_state=0), 3),
    "random_forest": (lambda: ensemble.RandomForestClassifier(8, max_depth=6,
                                                              random_state=0), 3),
    "random_forest_binary": (lambda: ensemble.RandomForestClassifier(8, max_depth=6,
                                                                     random_state=0), 2),
    "extra_trees": (lambda: ensemble.ExtraTreesClassifier(8, max_depth=6,
                                                          random_state=0), 3),
    "gradient_boosting_binary": (lambda: ensemble.GradientBoostingClassifier(
        n_estimators=10, max_depth=3, random_state=0), 2),
    "gradient_boosting_multi": (lambda: ensemble.GradientBoostingClassifier(
        n_estimators=10, max_depth=3, random_state=0), 3),
    "knn": (lambda: neighbors.KNeighborsClassifier(5), 3),
    "gaussian_nb": (lambda: naive_bayes.GaussianNB(), 3),
    "mlp": (lambda: neural_network.MLPClassifier(hidden_layer_sizes=(16,), max_iter=300,
                                                 random_state=0), 3),
    "svc_rbf_proba": (lambda: svm.SVC(probability=True, random_state=0), 3),
    "svc_binary_proba": (lambda: svm.SVC(kernel="poly", degree=2, probability=True,
                                         random_state=0), 2),
}

LABEL_ONLY = {
    "linear_svc": (lambda: svm.LinearSVC(), 3),
    "linear_svc_binary": (lambda: svm.LinearSVC(), 2),
    "svc_rbf": (lambda: svm.SVC(), 3),
    "svc_linear_binary": (lambda: svm.SVC(kernel="linear"), 2),
    "ridge_classifier": (lambda: linear_model.RidgeClassifier(), 3),
}


@pytest.mark.parametrize("name", sorted(CLASSIFIERS))
def test_classifier(name):
    make, n_classes = CLASSIFIERS[name]
    x, y, _ = _data(n_classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make().fit(x, y)
    label, proba = _run_everywhere(_convert(model, x), {"X": x})
    np.testing.assert_array_equal(label, model.predict(x))
    np.testing.assert_allclose(_as_array(proba), model.predict_proba(x), atol=1e-5)


@pytest.mark.parametrize("name", sorted(LABEL_ONLY))
def test_classifier_labels(name):
    make, n_classes = LABEL_ONLY[name]
    x, y, _ = _data(n_classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make().fit(x, y)
    label = _run_everywhere(_convert(model, x), {"X": x})[0]
    np.testing.assert_array_equal(label, model.predict(x))


def test_string_labels_without_zipmap():
    x, y, _ = _data(3)
    names = np.array(["low", "mid", "high"])[y]
    model = ensemble.RandomForestClassifier(5, max_depth=4, random_state=0).fit(x, names)
    label, proba = _run_everywhere(_convert(model, x, zipmap=False), {"X": x})
    np.testing.assert_array_equal(label, model.predict(x))
    np.testing.assert_allclose(proba, model.predict_proba(x), atol=1e-5)


REGRESSORS = {
    "linear": lambda: linear_model.LinearRegression(),
    "ridge": lambda: linear_model.Ridge(),
    "svr_rbf": lambda: svm.SVR(),
    "linear_svr": lambda: svm.LinearSVR(max_iter=5000),
    "decision_tree": lambda: tree.DecisionTreeRegressor(max_depth=5, random_state=0),
    "random_forest": lambda: ensemble.RandomForestRegressor(8, max_depth=6, random_state=0),
    "extra_trees": lambda: ensemble.ExtraTreesRegressor(8, max_depth=6, random_state=0),
    "gradient_boosting": lambda: ensemble.GradientBoostingRegressor(n_estimators=10,
                                                                    random_state=0),
    "knn": lambda: neighbors.KNeighborsRegressor(4),
    "mlp": lambda: neural_network.MLPRegressor(hidden_layer_sizes=(16,), max_iter=300,
                                               random_state=0),
}


@pytest.mark.parametrize("name", sorted(REGRESSORS))
def test_regressor(name):
    x, _, target = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = REGRESSORS[name]().fit(x, target)
    (pred,) = _run_everywhere(_convert(model, x), {"X": x})
    np.testing.assert_allclose(pred.reshape(-1), model.predict(x), rtol=1e-4, atol=1e-4)


TRANSFORMERS = {
    "standard_scaler": lambda: preprocessing.StandardScaler(),
    "min_max_scaler": lambda: preprocessing.MinMaxScaler(),
    "normalizer_l1": lambda: preprocessing.Normalizer("l1"),
    "normalizer_l2": lambda: preprocessing.Normalizer("l2"),
    "normalizer_max": lambda: preprocessing.Normalizer("max"),
    "binarizer": lambda: preprocessing.Binarizer(threshold=0.2),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMERS))
def test_transformer(name):
    x, _, _ = _data()
    if name == "normalizer_max":
        x = np.abs(x)  # sklearn's "max" divides by max |x|, ONNX's by max x
    model = TRANSFORMERS[name]().fit(x)
    (out,) = _run_everywhere(_convert(model, x), {"X": x})
    np.testing.assert_allclose(out, model.transform(x), rtol=1e-5, atol=1e-6)


def test_simple_imputer():
    x, _, _ = _data()
    x[::7, 1] = np.nan
    x[::5, 3] = np.nan
    model = impute.SimpleImputer(strategy="median").fit(x)
    (out,) = _run_everywhere(_convert(model, x), {"X": x})
    np.testing.assert_allclose(out, model.transform(x), rtol=1e-6)


def test_one_hot_encoder_ints():
    x = np.random.default_rng(1).integers(0, 4, size=(50, 3)).astype(np.int64)
    model = preprocessing.OneHotEncoder(handle_unknown="ignore").fit(x[:40])
    x[-1, 0] = 9  # an unseen category encodes as zeros
    (out,) = _run_everywhere(_convert(model, x), {"X": x})
    np.testing.assert_allclose(out, model.transform(x).toarray())


def test_pipeline_scaler_logistic():
    x, y, _ = _data(3)
    model = pipeline.make_pipeline(preprocessing.StandardScaler(),
                                   linear_model.LogisticRegression(max_iter=500)).fit(x, y)
    label, proba = _run_everywhere(_convert(model, x), {"X": x})
    np.testing.assert_array_equal(label, model.predict(x))
    np.testing.assert_allclose(_as_array(proba), model.predict_proba(x), atol=1e-5)


def test_column_transformer_strings_and_numbers():
    from skl2onnx.common.data_types import FloatTensorType, StringTensorType

    rng = np.random.default_rng(2)
    n = 80
    nums = rng.normal(size=(n, 2)).astype(np.float32)
    colors = rng.choice(["red", "green", "blue"], size=(n, 1)).astype(object)
    y = ((nums[:, 0] > 0) ^ (colors[:, 0] == "red")).astype(np.int64)
    import pandas as pd

    frame = pd.DataFrame({"a": nums[:, 0], "b": nums[:, 1], "color": colors[:, 0]})
    model = pipeline.Pipeline([
        ("prep", compose.ColumnTransformer([
            ("num", preprocessing.StandardScaler(), ["a", "b"]),
            ("cat", preprocessing.OneHotEncoder(handle_unknown="ignore"), ["color"]),
        ])),
        ("clf", ensemble.RandomForestClassifier(6, max_depth=5, random_state=0)),
    ]).fit(frame, y)
    types = [("a", FloatTensorType([None, 1])), ("b", FloatTensorType([None, 1])),
             ("color", StringTensorType([None, 1]))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        onx = to_onnx(model, initial_types=types,
                      target_opset={"": 17, "ai.onnx.ml": 3}).SerializeToString()
    feed = {"a": nums[:, :1], "b": nums[:, 1:], "color": colors}
    label, proba = _run_everywhere(onx, feed)
    np.testing.assert_array_equal(label, model.predict(frame))
    np.testing.assert_allclose(_as_array(proba), model.predict_proba(frame), atol=1e-5)


@pytest.mark.parametrize("name", ["logistic_multi", "random_forest", "svc_rbf_proba",
                                  "linear_svc_binary", "svc_rbf"])
def test_inferred_types_match_onnxruntime_outputs(name):
    from kiln.ir import TensorType
    from kiln.passes.infer_shapes import infer_model

    make, n_classes = {**CLASSIFIERS, **LABEL_ONLY}[name]
    x, y, _ = _data(n_classes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = make().fit(x, y)
    proto = onnx.load_from_string(_convert(model, x))
    for o in proto.graph.output:  # what the converter declared must not be what we check
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    onx = proto.SerializeToString()
    outs = ort.InferenceSession(onx, providers=["CPUExecutionProvider"]).run(None, {"X": x})
    m = kiln.load(onx)
    infer_model(m)
    checked = 0
    for v, arr in zip(m.graph.outputs, outs):
        if isinstance(arr, list):  # ZipMap's sequence of maps
            continue
        assert isinstance(v.type, TensorType) and v.type.shape is not None, v.name
        assert v.type.dtype.numpy == arr.dtype, v.name
        assert len(v.type.shape) == arr.ndim, v.name
        # The row dim is dynamic; every other dim is known and is what onnxruntime returns.
        assert list(v.type.shape[1:]) == list(arr.shape[1:]), (v.name, v.type.shape)
        checked += 1
    assert checked >= 1
