"""LightGBM and XGBoost models converted by onnxmltools run in Kiln (TreeEnsemble*
ops) on both backends: labels equal the library's ``predict``, probabilities and
regression values are within float32 rounding of the library's, and every output equals
onnxruntime's on the same file."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

pytest.importorskip("onnxmltools")
ort = pytest.importorskip("onnxruntime")

from onnxmltools.convert.common.data_types import FloatTensorType  # noqa: E402

import kiln  # noqa: E402

TYPES = [("input", FloatTensorType([None, 6]))]


def _data(n_classes: int, rows: int = 200):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(rows, 6)).astype(np.float32)
    score = x[:, 0] - x[:, 1] * x[:, 2] + 0.3 * x[:, 3]
    edges = np.quantile(score, np.linspace(0, 1, n_classes + 1)[1:-1])
    return x, np.digitize(score, edges), score.astype(np.float32)


def _as_array(out):
    if isinstance(out, list):  # ZipMap: one {label: probability} per row
        return np.array([list(d.values()) for d in out])
    return np.asarray(out)


def _run_everywhere(onx: bytes, x: np.ndarray) -> list:
    feed = {"input": x}
    want = ort.InferenceSession(onx, providers=["CPUExecutionProvider"]).run(None, feed)
    first = None
    for backend in ("numpy", "torch"):
        got = kiln.InferenceSession(onx, backend=backend).run(None, feed)
        for g, w in zip(got, want):
            g, w = _as_array(g), _as_array(w)
            assert g.shape == w.shape, backend
            if w.dtype.kind == "f":
                np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, err_msg=backend)
            else:
                np.testing.assert_array_equal(g, w, err_msg=backend)
        first = first if first is not None else got
    return first


def _lightgbm(model) -> bytes:
    from onnxmltools import convert_lightgbm

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_lightgbm(model, initial_types=TYPES, target_opset=15,
                                zipmap=True).SerializeToString()


def _xgboost(model) -> bytes:
    from onnxmltools import convert_xgboost

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return convert_xgboost(model, initial_types=TYPES, target_opset=15
                               ).SerializeToString()


@pytest.mark.parametrize("n_classes", [2, 3])
def test_lightgbm_classifier(n_classes):
    lgb = pytest.importorskip("lightgbm")
    x, y, _ = _data(n_classes)
    model = lgb.LGBMClassifier(n_estimators=15, num_leaves=8, verbose=-1).fit(x, y)
    label, proba = _run_everywhere(_lightgbm(model), x)
    np.testing.assert_array_equal(label, model.predict(x))
    np.testing.assert_allclose(_as_array(proba), model.predict_proba(x), atol=1e-5)


def test_lightgbm_regressor():
    lgb = pytest.importorskip("lightgbm")
    x, _, target = _data(2)
    model = lgb.LGBMRegressor(n_estimators=15, num_leaves=8, verbose=-1).fit(x, target)
    (pred,) = _run_everywhere(_lightgbm(model), x)
    np.testing.assert_allclose(pred.reshape(-1), model.predict(x), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("n_classes", [2, 3])
def test_xgboost_classifier(n_classes):
    xgb = pytest.importorskip("xgboost")
    x, y, _ = _data(n_classes)
    model = xgb.XGBClassifier(n_estimators=15, max_depth=3).fit(x, y)
    label, proba = _run_everywhere(_xgboost(model), x)
    np.testing.assert_array_equal(label, model.predict(x))
    np.testing.assert_allclose(_as_array(proba), model.predict_proba(x), atol=1e-5)


def test_xgboost_regressor():
    xgb = pytest.importorskip("xgboost")
    x, _, target = _data(2)
    model = xgb.XGBRegressor(n_estimators=15, max_depth=3).fit(x, target)
    (pred,) = _run_everywhere(_xgboost(model), x)
    np.testing.assert_allclose(pred.reshape(-1), model.predict(x), rtol=1e-4, atol=1e-4)


def test_xgboost_missing_values():
    """XGBoost sends missing values down a learned branch (missing_value_tracks_true)."""
    xgb = pytest.importorskip("xgboost")
    x, y, _ = _data(3)
    x[::4, 1] = np.nan
    x[::5, 2] = np.nan
    model = xgb.XGBClassifier(n_estimators=15, max_depth=3).fit(x, y)
    label, proba = _run_everywhere(_xgboost(model), x)
    np.testing.assert_array_equal(label, model.predict(x))
    np.testing.assert_allclose(_as_array(proba), model.predict_proba(x), atol=1e-5)
