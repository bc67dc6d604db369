"""Shape and type rules of the ``ai.onnx.ml`` ops (ONNX's own inference gives most of
them a dtype but no shape): outputs keep the input's row dim, symbolic or not, and take
their width from the node's attributes."""

from __future__ import annotations

from kiln.ir import DType, TensorType
from kiln.ops import ml, ml_linear, ml_trees  # noqa: F401 - the ops must exist first
from kiln.ops.registry import infer

DOMAIN = "ai.onnx.ml"


def _rows(x) -> object:
    """The row dim of input type ``x`` (a 1-D input is one row); None when unknown."""
    if not isinstance(x, TensorType) or x.shape is None:
        return None
    return x.shape[0] if len(x.shape) > 1 else 1


def _label_type(x, attrs: dict, strings: str) -> TensorType:
    dtype = DType.STRING if attrs.get(strings) else DType.INT64
    return TensorType(dtype, (_rows(x),))


def _same_shape(dtype: DType | None):
    def rule(x, **_):
        if not isinstance(x, TensorType):
            return None
        return TensorType(dtype if dtype is not None else x.dtype, x.shape)
    return rule


for _name, _dtype in (("Scaler", DType.FLOAT), ("Normalizer", DType.FLOAT),
                      ("Imputer", None), ("Binarizer", None)):
    infer(_name, domain=DOMAIN)(_same_shape(_dtype))


@infer("LinearRegressor", domain=DOMAIN)
def _linear_regressor(x, *, targets=1, **_):
    return TensorType(DType.FLOAT, (_rows(x), int(targets)))


@infer("LinearClassifier", domain=DOMAIN)
def _linear_classifier(x, **attrs):
    labels = attrs.get("classlabels_strings") or attrs.get("classlabels_ints") or []
    width = None
    if isinstance(x, TensorType) and x.shape and isinstance(x.shape[-1], int):
        width = len(attrs.get("coefficients") or []) // max(x.shape[-1], 1)
        width = 2 if width == 1 and len(labels) == 2 else width
    return [_label_type(x, attrs, "classlabels_strings"),
            TensorType(DType.FLOAT, (_rows(x), width))]


@infer("SVMRegressor", domain=DOMAIN)
def _svm_regressor(x, **_):
    return TensorType(DType.FLOAT, (_rows(x), 1))


@infer("SVMClassifier", domain=DOMAIN)
def _svm_classifier(x, **attrs):
    labels = attrs.get("classlabels_strings") or attrs.get("classlabels_ints") or []
    k = len(labels)
    width = k if attrs.get("prob_a") or not attrs.get("vectors_per_class") else \
        (2 if k == 2 else k * (k - 1) // 2)
    return [_label_type(x, attrs, "classlabels_strings"),
            TensorType(DType.FLOAT, (_rows(x), width))]


@infer("TreeEnsembleRegressor", domain=DOMAIN)
def _tree_regressor(x, *, n_targets=None, **_):
    return TensorType(DType.FLOAT, (_rows(x), None if n_targets is None else int(n_targets)))


@infer("TreeEnsembleClassifier", domain=DOMAIN)
def _tree_classifier(x, **attrs):
    labels = attrs.get("classlabels_strings") or attrs.get("classlabels_int64s") or []
    return [_label_type(x, attrs, "classlabels_strings"),
            TensorType(DType.FLOAT, (_rows(x), len(labels)))]


@infer("TreeEnsemble", 5, domain=DOMAIN)
def _tree_ensemble(x, *, n_targets=None, **_):
    if not isinstance(x, TensorType):
        return None
    return TensorType(x.dtype, (_rows(x), None if n_targets is None else int(n_targets)))


@infer("OneHotEncoder", domain=DOMAIN)
def _one_hot(x, *, cats_int64s=None, cats_strings=None, **_):
    if not isinstance(x, TensorType) or x.shape is None:
        return TensorType(DType.FLOAT, None)
    return TensorType(DType.FLOAT, tuple(x.shape) + (len(cats_strings or cats_int64s or []),))


@infer("CategoryMapper", domain=DOMAIN)
def _category_mapper(x, **_):
    if not isinstance(x, TensorType):
        return None
    return TensorType(DType.INT64 if x.dtype == DType.STRING else DType.STRING, x.shape)


@infer("FeatureVectorizer", domain=DOMAIN)
def _feature_vectorizer(*xs, inputdimensions=None, **_):
    width = int(sum(inputdimensions)) if inputdimensions else None
    return TensorType(DType.FLOAT, (_rows(xs[0]) if xs else None, width))


@infer("ArrayFeatureExtractor", domain=DOMAIN)
def _array_feature_extractor(ctx):
    x, indices = ctx.tensor_type(0), ctx.const(1)
    if x is None or x.shape is None:
        return None
    width = None if indices is None else int(indices.size)
    lead = (1,) if len(x.shape) == 1 else tuple(x.shape[:-1])
    return TensorType(x.dtype, lead + (width,))
