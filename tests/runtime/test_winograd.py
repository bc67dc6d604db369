"""Winograd F(2x2, 3x3) convolutions (wide 3x3 stride-1 Conv on the NumPy backend)
against onnxruntime, with every padding form and with the optimizer's fused epilogue."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import make_model, ort_run
from kiln.ops import winograd

F = TensorProto.FLOAT


def conv_model(c: int, k: int, bias: bool, relu: bool, **attrs):
    rng = np.random.default_rng(c + k)
    inits = [numpy_helper.from_array(
        (rng.standard_normal((k, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32), "w")]
    if bias:
        inits.append(numpy_helper.from_array(rng.standard_normal(k).astype(np.float32), "b"))
    nodes = [helper.make_node("Conv", ["x", "w"] + (["b"] if bias else []),
                              ["y" if not relu else "c"], kernel_shape=[3, 3], **attrs)]
    if relu:
        nodes.append(helper.make_node("Relu", ["c"], ["y"]))
    return make_model(nodes, [helper.make_tensor_value_info("x", F, None)],
                      [helper.make_tensor_value_info("y", F, None)], inits)


@pytest.mark.parametrize("shape,attrs", [
    ((1, 128, 14, 14), {"pads": [1, 1, 1, 1]}),
    ((2, 128, 7, 9), {"pads": [1, 1, 1, 1]}),
    ((1, 96, 13, 13), {"pads": [0, 0, 0, 0]}),
    ((2, 128, 8, 11), {"pads": [2, 0, 1, 3]}),
    ((1, 128, 9, 6), {"auto_pad": "SAME_UPPER"}),
    ((1, 128, 3, 3), {"auto_pad": "VALID"}),
])
@pytest.mark.parametrize("bias,relu", [(True, False), (False, True)])
def test_winograd_conv_matches_onnxruntime(shape, attrs, bias, relu, monkeypatch):
    calls = []
    real = winograd.conv3x3
    monkeypatch.setattr(winograd, "conv3x3", lambda *a: calls.append(1) or real(*a))
    model = conv_model(shape[1], 128, bias, relu, **attrs)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    (want,) = ort_run(model, {"x": x})
    for optimize in (False, True):  # plain Conv, and FusedConv with the Relu folded in
        sess = kiln.InferenceSession(model, backend="numpy", optimize=optimize)
        for _ in range(2):  # weights are transformed when they come back: the second run
            (got,) = sess.run(None, {"x": x})
            assert got.shape == want.shape and got.flags.c_contiguous
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert len(calls) == 4, "the Winograd path was not taken on every run"


def test_narrow_or_strided_convs_keep_im2col():
    x = np.zeros((1, 64, 8, 8), np.float32)
    w = np.zeros((64, 64, 3, 3), np.float32)
    assert not winograd.applies(x, w, 1, [1, 1], [1, 1], [1, 1], [1, 1])
    x, w = np.zeros((1, 128, 8, 8), np.float32), np.zeros((128, 128, 3, 3), np.float32)
    assert winograd.applies(x, w, 1, [1, 1], [1, 1], [1, 1], [1, 1])
    assert not winograd.applies(x, w, 1, [2, 2], [1, 1], [1, 1], [1, 1])
    assert not winograd.applies(x.astype(np.float64), w.astype(np.float64), 1, [1, 1], [1, 1],
                                [1, 1], [1, 1])
