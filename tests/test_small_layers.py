"""Small layers on their fast paths (issue 42, item 2) give onnxruntime's results: 1-D
convolutions with wide kernels or long strides (STFT written as a Conv), tiny convolutions
run single-threaded, and the trained models those paths serve, on both backends."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
import trained_models as tm

BACKENDS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch not installed"))]


def _conv_model(x_shape, w, b, **attrs) -> bytes:
    inits = [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel())]
    ins = ["x", "w"]
    if b is not None:
        inits.append(helper.make_tensor("b", TensorProto.FLOAT, b.shape, b.ravel()))
        ins.append("b")
    g = helper.make_graph([helper.make_node("Conv", ins, ["y"], **attrs)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]
                             ).SerializeToString()


CASES = [  # (x shape, w shape, attrs)
    ((1, 1, 576), (258, 1, 256), {"strides": [128]}),            # silero VAD's STFT
    ((2, 1, 1760), (257, 1, 512), {"strides": [160]}),           # openWakeWord's mel front end
    ((2, 4, 100), (6, 2, 20), {"strides": [3], "pads": [2, 5], "dilations": [2], "group": 2}),
    ((3, 2, 50), (4, 2, 5), {"strides": [4], "pads": [1, 1]}),
    ((1, 64, 2), (64, 64, 3), {"strides": [2], "pads": [1, 1]}),  # tiny: one thread
    ((1, 8, 5, 5), (4, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
def test_conv_fast_paths_match_onnxruntime(backend, x_shape, w_shape, attrs):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    blob = _conv_model(x_shape, w, b, **attrs)
    want = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = kiln.InferenceSession(blob, backend=backend).run(None, {"x": x})
    assert got[0].shape == want[0].shape
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["silero_vad", "oww_melspec", "oww_embedding"])
def test_trained_audio_models_match_onnxruntime(backend, name):
    m = tm.get(name)
    if m.path is None:
        pytest.skip(f"{m.package} not installed")
    for batch in (1, 3):
        feed = tm.feed_at_batch(m, batch, seed_samples=4)
        want = ort.InferenceSession(m.path, providers=["CPUExecutionProvider"]).run(None, feed)
        got = kiln.InferenceSession(m.path, backend=backend).run(None, feed)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3 * max(1.0, np.abs(w).max()))
