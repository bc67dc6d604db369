"""onnxmltools' own test helper (``dump_data_and_model``) checks LightGBM and XGBoost
models converted to ONNX against the original library, running them with whatever
``import onnxruntime`` gives; prints the runtime's outputs as JSON."""

import json
import sys
import tempfile

import numpy as np
import onnxruntime
from lightgbm import LGBMClassifier
from onnxmltools import convert_lightgbm, convert_xgboost
from onnxmltools.convert.common.data_types import FloatTensorType
from onnxmltools.utils import dump_data_and_model
from sklearn.datasets import load_iris
from xgboost import XGBClassifier

x, y = load_iris(return_X_y=True)
x = x.astype(np.float32)
out = {"ort": onnxruntime.__name__}
with tempfile.TemporaryDirectory() as folder:
    for name, model, convert in [
            ("lgbm", LGBMClassifier(n_estimators=12, num_leaves=7, verbose=-1), convert_lightgbm),
            ("xgb", XGBClassifier(n_estimators=12, max_depth=3), convert_xgboost)]:
        model.fit(x, y)
        onx = convert(model, initial_types=[("input", FloatTensorType([None, 4]))],
                      target_opset=15)
        dump_data_and_model(x[:20], model, onx, basename=f"Mcl{name}", folder=folder)
        sess = onnxruntime.InferenceSession(onx.SerializeToString())
        got = sess.run(None, {"input": x[::7]})
        out[name] = [np.asarray(got[0]).tolist(),
                     np.asarray([[row[k] for k in sorted(row)] for row in got[1]]
                                if isinstance(got[1], list) else got[1]).tolist()]
json.dump(out, sys.stdout)
