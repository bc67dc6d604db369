"""Feature transforms and encoders of the ``ai.onnx.ml`` domain: ArrayFeatureExtractor,
Binarizer, LabelEncoder, CategoryMapper, OneHotEncoder, Imputer, Normalizer, Scaler,
FeatureVectorizer, DictVectorizer, CastMap and ZipMap. Models live beside it
(:mod:`kiln.ops.ml_linear`, :mod:`kiln.ops.ml_trees`)."""

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
    if x.dtype.kind in "OUS":  # strings, as object or as NumPy's fixed-width str/bytes
        if x.dtype.kind == "S":
            x = np.char.decode(x, "utf-8")
        # astype(object), never astype(str): str drops trailing NULs ML.NET's keys carry
        return _lookup(x.astype(object), classes, index, default_int64)
    return _lookup(x.astype(np.int64), index, classes, default_string)


@op("CategoryMapper", 1, domain=DOMAIN)
def category_mapper(x, *, cats_int64s=None, cats_strings=None, default_int64=-1,
                    default_string="_Unused"):
    """Strings -> int64 through the (cats_strings[i], cats_int64s[i]) pairs, or back."""
    x = np.asarray(x)
    strings = np.empty(len(cats_strings or []), dtype=object)
    strings[:] = cats_strings or []
    ints = np.asarray(cats_int64s or [], np.int64)
    if x.dtype == object or x.dtype.kind == "U":
        return _lookup(x.astype(object), strings, ints, default_int64)
    return _lookup(x.astype(np.int64), ints, strings, default_string)


@op("OneHotEncoder", 1, domain=DOMAIN)
def one_hot_encoder(x, *, cats_int64s=None, cats_strings=None, zeros=1):
    """x's shape plus one axis of categories, 1.0 where the value is that category;
    a value of no category is all zeros (or an error with zeros=0)."""
    x = np.asarray(x)
    if cats_strings:
        cats = np.empty(len(cats_strings), dtype=object)
        cats[:] = cats_strings
        x = x.astype(object)
    else:
        cats = np.asarray(cats_int64s or [], np.int64)
        x = x.astype(np.int64)
    index = _lookup(x, cats, np.arange(len(cats), dtype=np.int64), -1)
    if not zeros and (index < 0).any():
        raise ValueError("OneHotEncoder: a value is no category and zeros=0 forbids that")
    return (index[..., None] == np.arange(len(cats))).astype(np.float32)


@op("Imputer", 1, domain=DOMAIN)
def imputer(x, *, imputed_value_floats=None, imputed_value_int64s=None,
            replaced_value_float=0.0, replaced_value_int64=0):
    """Entries equal to the replaced value (NaN matches NaN) take the imputed value of
    their column (or the one imputed value)."""
    x = np.asarray(x)
    if x.dtype.kind == "f":
        fill = np.asarray(imputed_value_floats, x.dtype)
        hit = np.isnan(x) if np.isnan(replaced_value_float) else x == replaced_value_float
    else:
        fill = np.asarray(imputed_value_int64s, x.dtype)
        hit = x == replaced_value_int64
    return np.where(hit, np.broadcast_to(fill, x.shape[-1:]) if fill.size > 1 else fill, x)


@op("Normalizer", 1, domain=DOMAIN)
def normalizer(x, *, norm="MAX"):
    """Each row divided by its MAX, L1 or L2 norm (float32); all-zero rows stay zero."""
    x = np.asarray(x, np.float32)
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    if norm == "MAX":
        n = rows.max(axis=1, keepdims=True)
    elif norm == "L1":
        n = np.abs(rows).sum(axis=1, keepdims=True)
    else:
        n = np.sqrt((rows * rows).sum(axis=1, keepdims=True))
    return (rows / np.where(n == 0, 1, n)).reshape(x.shape)


@op("Scaler", 1, domain=DOMAIN)
def scaler(x, *, offset=None, scale=None):
    """(x - offset) * scale per column (float32)."""
    x = np.asarray(x, np.float32)
    off = np.asarray(offset if offset is not None else [0.0], np.float32)
    sc = np.asarray(scale if scale is not None else [1.0], np.float32)
    return (x - off) * sc


@op("FeatureVectorizer", 1, domain=DOMAIN)
def feature_vectorizer(*xs, inputdimensions=None):
    """The inputs' last axes side by side, each cut or zero-padded to its declared width."""
    arrays = [np.asarray(x, np.float32) for x in xs]
    rows = arrays[0].shape[0] if arrays[0].ndim > 1 else 1
    widths = inputdimensions or [a.reshape(rows, -1).shape[1] for a in arrays]
    out = np.zeros((rows, int(sum(widths))), np.float32)
    at = 0
    for a, w in zip(arrays, widths):
        a = a.reshape(rows, -1)[:, :w]
        out[:, at:at + a.shape[1]] = a
        at += int(w)
    return out


def _map_value_dtype(site, default=np.float32):
    t = site.node.inputs[0].type if site.node.inputs else None
    t = getattr(t, "elem", t)  # a sequence of maps: its element
    value = getattr(t, "value", None)
    dtype = getattr(value, "dtype", None)
    return object if dtype is not None and dtype.name == "STRING" else \
        (dtype.numpy if dtype is not None else default)


@op("DictVectorizer", 1, domain=DOMAIN, prepare=True)
def dict_vectorizer(site):
    """A map (or a list of maps) -> one row per map of the values at the vocabulary's
    keys (0 where a key is missing)."""
    vocab = site.attr("string_vocabulary") or site.attr("int64_vocabulary") or []
    where = {k: i for i, k in enumerate(vocab)}
    dtype = _map_value_dtype(site)

    def run(m):
        maps = m if isinstance(m, (list, tuple)) else [m]
        out = np.zeros((len(maps), len(vocab)), dtype=dtype)
        if dtype is object:
            out[:] = ""
        for r, one in enumerate(maps):
            for key, value in one.items():
                col = where.get(key)
                if col is not None:
                    out[r, col] = value
        return out
    return run


@op("CastMap", 1, domain=DOMAIN)
def cast_map(m, *, cast_to="TO_FLOAT", map_form="DENSE", max_map=1):
    """An int64-keyed map -> a (1, n) tensor of its values in key order (DENSE), or at
    their keys' positions in a row of max_map (SPARSE, missing ones 0)."""
    dtype = {"TO_FLOAT": np.float32, "TO_INT64": np.int64, "TO_STRING": object}[cast_to]
    keys = sorted(m)
    if map_form == "SPARSE":
        out = np.zeros((1, int(max_map)), dtype=dtype)
        if dtype is object:
            out[:] = "0"
        for k in keys:
            if 0 <= k < max_map:
                out[0, k] = _cast_one(m[k], dtype)
        return out
    out = np.empty((1, len(keys)), dtype=dtype)
    for i, k in enumerate(keys):
        out[0, i] = _cast_one(m[k], dtype)
    return out


def _cast_one(v, dtype):
    if dtype is object:
        return v if isinstance(v, str) else str(v)
    return dtype(float(v)) if dtype is np.float32 else dtype(int(float(v)))


@op("ZipMap", 1, domain=DOMAIN)
def zip_map(x, *, classlabels_int64s=None, classlabels_strings=None):
    """Scores (rows, classes) -> a list with one {label: score} dict per row, as
    onnxruntime returns it."""
    x = np.asarray(x, np.float32)
    rows = x.reshape(1, -1) if x.ndim == 1 else x
    labels = classlabels_strings or [int(c) for c in classlabels_int64s or []]
    if rows.shape[1] != len(labels):
        raise ValueError(f"ZipMap: {rows.shape[1]} scores per row but {len(labels)} labels")
    return [dict(zip(labels, r)) for r in rows.tolist()]
