"""The ai.onnx.preview.training Gradient op on both backends, against torch.autograd on
the same math written directly in torch."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from kiln import InferenceSession
from kiln.errors import InputError, UnsupportedOpError

F = TensorProto.FLOAT
TRAINING = "ai.onnx.preview.training"
OPSETS = [helper.make_opsetid("", 17), helper.make_opsetid(TRAINING, 1)]


def _model(nodes, inputs, outputs, initializers=()) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    m = helper.make_model(g, opset_imports=OPSETS)
    onnx.checker.check_model(m)
    return m


def _vi(name, shape):
    return helper.make_tensor_value_info(name, F, shape)


def _mlp_model():
    """y = ReduceSum(Tanh(X @ W + B) * Sigmoid(Transpose(Reshape(X @ W))) / 3 - Pow(X @ W, 2)),
    differentiated wrt W and B, with X as a z."""
    nodes = [
        helper.make_node("MatMul", ["X", "W"], ["h"]),
        helper.make_node("Add", ["h", "B"], ["a"]),
        helper.make_node("Tanh", ["a"], ["t"]),
        helper.make_node("Reshape", ["h", "shape"], ["r"]),
        helper.make_node("Transpose", ["r"], ["rt"], perm=[1, 0]),
        helper.make_node("Transpose", ["rt"], ["rtt"], perm=[1, 0]),
        helper.make_node("Sigmoid", ["rtt"], ["s"]),
        helper.make_node("Mul", ["t", "s"], ["m"]),
        helper.make_node("Div", ["m", "three"], ["d"]),
        helper.make_node("Pow", ["h", "two"], ["p"]),
        helper.make_node("Sub", ["d", "p"], ["e"]),
        helper.make_node("ReduceSum", ["e"], ["y"], keepdims=0),
        helper.make_node("Gradient", ["W", "B", "X"], ["dW", "dB"], domain=TRAINING,
                         xs=["W", "B"], zs=["X"], y="y"),
    ]
    inits = [numpy_helper.from_array(np.array([2, 4], np.int64), "shape"),
             numpy_helper.from_array(np.array(3.0, np.float32), "three"),
             numpy_helper.from_array(np.array(2.0, np.float32), "two")]
    return _model(nodes, [_vi("X", [2, 3]), _vi("W", [3, 4]), _vi("B", [4])],
                  [_vi("y", []), _vi("dW", [3, 4]), _vi("dB", [4])], inits)


def _mlp_oracle(x, w, b):
    x = torch.tensor(x)
    w = torch.tensor(w, requires_grad=True)
    b = torch.tensor(b, requires_grad=True)
    h = x @ w
    y = ((torch.tanh(h + b) * torch.sigmoid(h)) / 3 - h ** 2).sum()
    dw, db = torch.autograd.grad(y, [w, b])
    return y.detach().numpy(), dw.numpy(), db.numpy()


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_gradient_matches_torch_autograd(backend):
    rng = np.random.default_rng(0)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3), (3, 4), (4,)))
    sess = InferenceSession(_mlp_model(), backend=backend)
    for _ in range(2):  # the second run reuses what the first built
        y, dw, db = sess.run(None, {"X": x, "W": w, "B": b})
        ry, rdw, rdb = _mlp_oracle(x, w, b)
        np.testing.assert_allclose(y, ry, rtol=1e-5)
        np.testing.assert_allclose(dw, rdw, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(db, rdb, rtol=1e-5, atol=1e-6)
        x, w, b = x + 0.5, w * 2, b - 1


def _conv_model():
    """Gradient wrt a convolution weight that is an initializer (not a graph input):
    kernels that pack constant weights must not bake it in."""
    nodes = [
        helper.make_node("Conv", ["X", "Wc"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Softmax", ["c"], ["s"], axis=1),
        helper.make_node("ReduceMean", ["s"], ["m"], axes=[2, 3], keepdims=0),
        helper.make_node("Mul", ["m", "m"], ["mm"]),
        helper.make_node("ReduceSum", ["mm"], ["y"], keepdims=0),
        helper.make_node("Gradient", ["Wc", "X"], ["dWc"], domain=TRAINING,
                         xs=["Wc"], zs=["X"], y="y"),
    ]
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3)).astype(np.float32)
    return _model(nodes, [_vi("X", [2, 3, 6, 6])], [_vi("y", []), _vi("dWc", [4, 3, 3, 3])],
                  [numpy_helper.from_array(w, "Wc")]), w


def test_torch_gradient_through_conv_and_softmax_of_an_initializer():
    model, w = _conv_model()
    x = np.random.default_rng(2).standard_normal((2, 3, 6, 6)).astype(np.float32)
    y, dw = InferenceSession(model, backend="torch").run(None, {"X": x})
    tw = torch.tensor(w, requires_grad=True)
    s = torch.softmax(torch.nn.functional.conv2d(torch.tensor(x), tw, padding=1), dim=1)
    ry = (s.mean(dim=(2, 3)) ** 2).sum()
    (rdw,) = torch.autograd.grad(ry, [tw])
    np.testing.assert_allclose(y, ry.detach().numpy(), rtol=1e-5)
    np.testing.assert_allclose(dw, rdw.numpy(), rtol=1e-4, atol=1e-7)


def test_numpy_gradient_names_an_op_it_cannot_differentiate():
    model, _ = _conv_model()
    x = np.zeros((2, 3, 6, 6), np.float32)
    sess = InferenceSession(model, backend="numpy")
    with pytest.raises(UnsupportedOpError, match="Conv"):
        sess.run(None, {"X": x})


def test_gradient_refuses_a_y_that_reads_an_input_outside_xs_and_zs():
    nodes = [helper.make_node("Mul", ["A", "C"], ["y"]),
             helper.make_node("Gradient", ["A"], ["dA"], domain=TRAINING,
                              xs=["A"], y="y")]
    model = _model(nodes, [_vi("A", [2]), _vi("C", [2])], [_vi("y", [2]), _vi("dA", [2])])
    for backend in ("numpy", "torch"):
        sess = InferenceSession(model, backend=backend)
        with pytest.raises(InputError, match="'C'"):
            sess.run(None, {"A": np.ones(2, np.float32), "C": np.ones(2, np.float32)})


def _squares_model():
    """y = ReduceSum(W * W + X) with W an initializer: folding can compute W * W."""
    nodes = [helper.make_node("Mul", ["W", "W"], ["ww"]),
             helper.make_node("Add", ["ww", "X"], ["a"]),
             helper.make_node("ReduceSum", ["a"], ["y"], keepdims=0),
             helper.make_node("Gradient", ["W", "X"], ["dW"], domain=TRAINING, xs=["W"],
                              zs=["X"], y="y")]
    w = np.array([1.0, -2.0, 3.0], np.float32)
    return _model(nodes, [_vi("X", [3])], [_vi("y", []), _vi("dW", [3])],
                  [numpy_helper.from_array(w, "W")]), w


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_gradient_wrt_an_initializer_is_never_silently_folded_to_zero(backend):
    model, w = _squares_model()
    x = np.ones(3, np.float32)
    with pytest.raises(InputError, match="constant folding"):
        InferenceSession(model, backend=backend).run(None, {"X": x})
    y, dw = InferenceSession(model, backend=backend, optimize=False).run(None, {"X": x})
    np.testing.assert_allclose(y, (w * w + x).sum())
    np.testing.assert_allclose(dw, 2 * w)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("act", ["Relu", "Sigmoid", "Tanh"])
@pytest.mark.parametrize("xshape", [(2, 3), (2, 2, 3)])
def test_gradient_through_what_the_optimizer_fuses(backend, act, xshape):
    """MatMul + constant bias + activation, twice: the session fuses them into Kiln's
    FusedGemm (2-D) or FusedMatMul (3-D), which the Gradient then differentiates."""
    rng = np.random.default_rng(3)
    b, w2, b2 = (rng.standard_normal(s).astype(np.float32) for s in ((4,), (4, 2), (2,)))
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h"]),
             helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node(act, ["a"], ["r"]),
             helper.make_node("MatMul", ["r", "W2"], ["o"]),
             helper.make_node("Add", ["o", "b2"], ["o2"]),
             helper.make_node("Sigmoid", ["o2"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0),
             helper.make_node("Gradient", ["W", "X"], ["dW"], domain=TRAINING, xs=["W"],
                              zs=["X"], y="y")]
    inits = [numpy_helper.from_array(v, n) for v, n in ((b, "b"), (w2, "W2"), (b2, "b2"))]
    model = _model(nodes, [_vi("X", list(xshape)), _vi("W", [3, 4])],
                   [_vi("y", []), _vi("dW", [3, 4])], inits)
    x, w = rng.standard_normal(xshape).astype(np.float32), \
        rng.standard_normal((3, 4)).astype(np.float32)
    _, dw = InferenceSession(model, backend=backend).run(None, {"X": x, "W": w})
    tw = torch.tensor(w, requires_grad=True)
    f = {"Relu": torch.relu, "Sigmoid": torch.sigmoid, "Tanh": torch.tanh}[act]
    y = torch.sigmoid(f(torch.tensor(x) @ tw + torch.tensor(b)) @ torch.tensor(w2)
                      + torch.tensor(b2)).sum()
    (rdw,) = torch.autograd.grad(y, [tw])
    np.testing.assert_allclose(dw, rdw.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("optimize", [True, False])
def test_gradient_through_softmax_layernorm_and_erf_gelu(backend, optimize):
    """A transformer-like chain (MatMul, Softmax, LayerNormalization, GELU written with Erf,
    LogSoftmax), differentiated wrt the weight, LayerNorm's scale and bias; optimized, the
    GELU is one fused op."""
    nodes = [helper.make_node("MatMul", ["X", "W"], ["h"]),
             helper.make_node("Softmax", ["h"], ["s"], axis=-1),
             helper.make_node("LayerNormalization", ["s", "G", "Bt"], ["ln"], epsilon=1e-5),
             helper.make_node("Div", ["ln", "sqrt2"], ["u"]),
             helper.make_node("Erf", ["u"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"]),
             helper.make_node("Mul", ["ln", "e1"], ["m"]),
             helper.make_node("Mul", ["m", "half"], ["gelu"]),
             helper.make_node("LogSoftmax", ["gelu"], ["ls"], axis=1),
             helper.make_node("Mul", ["ls", "C"], ["lc"]),
             helper.make_node("ReduceSum", ["lc"], ["y"], keepdims=0),
             helper.make_node("Gradient", ["W", "G", "Bt", "X"], ["dW", "dG", "dBt"],
                              domain=TRAINING, xs=["W", "G", "Bt"], zs=["X"], y="y")]
    rng = np.random.default_rng(4)
    c = rng.standard_normal((2, 4, 8)).astype(np.float32)
    inits = [numpy_helper.from_array(np.array(v, np.float32), n) for v, n in
             ((np.sqrt(2.0), "sqrt2"), (1.0, "one"), (0.5, "half"))]
    inits.append(numpy_helper.from_array(c, "C"))
    model = _model(nodes, [_vi("X", [2, 4, 8]), _vi("W", [8, 8]), _vi("G", [8]), _vi("Bt", [8])],
                   [_vi("y", []), _vi("dW", [8, 8]), _vi("dG", [8]), _vi("dBt", [8])], inits)
    x, w, g, bt = (rng.standard_normal(s).astype(np.float32)
                   for s in ((2, 4, 8), (8, 8), (8,), (8,)))
    _, dw, dg, dbt = InferenceSession(model, backend=backend, optimize=optimize).run(
        None, {"X": x, "W": w, "G": g, "Bt": bt})
    tw, tg, tb = (torch.tensor(v, requires_grad=True) for v in (w, g, bt))
    s = torch.softmax(torch.tensor(x) @ tw, -1)
    ln = torch.nn.functional.layer_norm(s, (8,), tg, tb, 1e-5)
    y = (torch.log_softmax(torch.nn.functional.gelu(ln), 1) * torch.tensor(c)).sum()
    for got, ref in zip((dw, dg, dbt), torch.autograd.grad(y, [tw, tg, tb])):
        np.testing.assert_allclose(got, ref.numpy(), rtol=1e-4, atol=1e-5)
