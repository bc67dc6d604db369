"""Kiln's fused ops (domain ai.kiln) are saved with model-local ONNX function bodies, so a
file ``kiln optimize`` writes runs in onnxruntime. Oracle: onnxruntime on the original
model, and onnxruntime on the saved file against Kiln on it (atol 1e-4, rtol 1e-3 as the
zoo states; 1e-5 for the small models)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from conftest import make_model, ort_run
from kiln.cli.main import main as cli_main

pytest.importorskip("onnxruntime")


def _kiln_ops(path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node
            if n.domain == "ai.kiln"}


def _check(original, saved, feeds, atol, rtol=0.0):
    ref = ort_run(str(original), feeds)
    on_saved = ort_run(str(saved), feeds)
    for a, r in zip(on_saved, ref):
        np.testing.assert_allclose(a, r, atol=atol, rtol=rtol)
    for got, r in zip(kiln.InferenceSession(str(saved)).run(None, feeds), on_saved):
        np.testing.assert_allclose(got, r, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name, expect", [
    ("mobilenetv2", {"FusedConv"}),                    # Clip(0, 6), grouped, residual adds
    ("tinyyolov2", {"FusedConv"}),                     # LeakyRelu(0.1)
    ("bert", {"Attention", "FusedMatMul"}),            # Gelu fused into MatMul
])
def test_kiln_optimize_output_runs_in_onnxruntime(zoo_model, tmp_path, name, expect):
    src = zoo_model(name)
    out = tmp_path / "opt.onnx"
    assert cli_main(["optimize", str(src), "-o", str(out)]) == 0
    assert expect <= _kiln_ops(out)
    d = np.load(src.parent / "inputs.npz")
    _check(src, out, {k: d[k] for k in d.files}, atol=1e-4, rtol=1e-3)


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _const(name, arr):
    return helper.make_tensor(name, TensorProto.FLOAT, arr.shape, arr.ravel().tolist())


_ACTS = {
    "Relu": [helper.make_node("Relu", ["h"], ["y"])],
    "LeakyRelu": [helper.make_node("LeakyRelu", ["h"], ["y"], alpha=0.2)],
    "Sigmoid": [helper.make_node("Sigmoid", ["h"], ["y"])],
    "Tanh": [helper.make_node("Tanh", ["h"], ["y"])],
    "HardSigmoid": [helper.make_node("HardSigmoid", ["h"], ["y"], alpha=0.3, beta=0.4)],
    "HardSwish": [helper.make_node("HardSwish", ["h"], ["y"])],
    "Clip": [helper.make_node("Clip", ["h", "lo", "hi"], ["y"])],
    "Silu": [helper.make_node("Sigmoid", ["h"], ["s"]),
             helper.make_node("Mul", ["h", "s"], ["y"])],
    "Gelu": [helper.make_node("Div", ["h", "sqrt2"], ["g1"]),
             helper.make_node("Erf", ["g1"], ["g2"]),
             helper.make_node("Add", ["g2", "one"], ["g3"]),
             helper.make_node("Mul", ["h", "g3"], ["g4"]),
             helper.make_node("Mul", ["g4", "half"], ["y"])],
}


@pytest.mark.parametrize("act", sorted(_ACTS))
@pytest.mark.parametrize("producer", ["conv", "matmul", "gemm"])
def test_fused_activation_bodies(tmp_path, act, producer):
    rng = np.random.default_rng(0)
    inits = [_const("lo", np.array(-0.5, np.float32)), _const("hi", np.array(0.7, np.float32)),
             _const("sqrt2", np.array(np.sqrt(2), np.float32)),
             _const("one", np.array(1, np.float32)), _const("half", np.array(0.5, np.float32))]
    if producer == "conv":
        inits += [_const("w", rng.standard_normal((4, 3, 3, 3)).astype(np.float32)),
                  _const("b", rng.standard_normal(4).astype(np.float32))]
        head = [helper.make_node("Conv", ["x", "w", "b"], ["h"], pads=[1, 1, 1, 1])]
        shape = [2, 3, 5, 5]
    elif producer == "matmul":
        inits += [_const("w", rng.standard_normal((6, 4)).astype(np.float32)),
                  _const("b", rng.standard_normal(4).astype(np.float32))]
        head = [helper.make_node("MatMul", ["x", "w"], ["m"]),
                helper.make_node("Add", ["m", "b"], ["h"])]
        shape = [2, 3, 6]
    else:
        inits += [_const("w", rng.standard_normal((4, 6)).astype(np.float32)),
                  _const("b", rng.standard_normal(4).astype(np.float32))]
        head = [helper.make_node("Gemm", ["x", "w", "b"], ["h"], transB=1, alpha=0.7)]
        shape = [3, 6]
    src, out = tmp_path / "m.onnx", tmp_path / "opt.onnx"
    onnx.save(make_model(head + _ACTS[act], [_vi("x", shape)], [_vi("y", None)], inits), src)
    kiln.save(kiln.optimize(kiln.load(src)), out)
    fused = [nd for nd in onnx.load(str(out)).graph.node if nd.domain == "ai.kiln"]
    acts = [helper.get_attribute_value(a) for nd in fused for a in nd.attribute
            if a.name == "activation"]
    assert acts == [act.encode()], f"{producer} + {act} fused as {fused}"
    _check(src, out, {"x": rng.standard_normal(shape).astype(np.float32)}, atol=1e-5,
           rtol=1e-5)


def test_layer_norm_and_gelu_bodies_at_old_opset(tmp_path):
    """Below opset 17 (20) LayerNorm (Gelu) are Kiln ops, with ReduceMean's axes as an
    attribute; the saved bodies use the model's opset."""
    rng = np.random.default_rng(1)
    inits = [_const("g", rng.standard_normal(8).astype(np.float32)),
             _const("bb", rng.standard_normal(8).astype(np.float32)),
             _const("two", np.array(2, np.float32)), _const("eps", np.array(1e-5, np.float32)),
             _const("sqrt2", np.array(np.sqrt(2), np.float32)),
             _const("one", np.array(1, np.float32)), _const("half", np.array(0.5, np.float32))]
    n = helper.make_node
    nodes = [n("ReduceMean", ["x"], ["mu"], axes=[-1]), n("Sub", ["x", "mu"], ["d"]),
             n("Pow", ["d", "two"], ["d2"]), n("ReduceMean", ["d2"], ["var"], axes=[-1]),
             n("Add", ["var", "eps"], ["ve"]), n("Sqrt", ["ve"], ["sd"]),
             n("Div", ["d", "sd"], ["z"]), n("Mul", ["z", "g"], ["zg"]),
             n("Add", ["zg", "bb"], ["h"])] + _ACTS["Gelu"]
    src, out = tmp_path / "m.onnx", tmp_path / "opt.onnx"
    onnx.save(make_model(nodes, [_vi("x", [2, 3, 8])], [_vi("y", None)], inits, opset=13), src)
    kiln.save(kiln.optimize(kiln.load(src)), out)
    assert {"LayerNorm", "Gelu"} <= _kiln_ops(out)
    _check(src, out, {"x": rng.standard_normal((2, 3, 8)).astype(np.float32)}, atol=1e-5,
           rtol=1e-5)


def test_resave_keeps_one_body_per_variant(tmp_path, zoo_model):
    """A saved file read back and saved again carries the same functions (the bodies read
    from the file are regenerated, not duplicated)."""
    src = zoo_model("tinyyolov2")
    first, second = tmp_path / "a.onnx", tmp_path / "b.onnx"
    kiln.save(kiln.optimize(kiln.load(src)), first)
    kiln.save(kiln.load(first), second)
    fa, fb = (onnx.load(str(p), load_external_data=False).functions for p in (first, second))
    assert sorted((f.name, f.overload) for f in fa) == sorted((f.name, f.overload) for f in fb)


def test_node_without_a_writable_body_is_saved_without_one(tmp_path):
    """Attention with K not transposed needs K's rank for its body: unknown, the node is
    saved without a function (Kiln still runs the file; NumPy computes the oracle)."""
    node = helper.make_node("Attention", ["q", "k", "v"], ["o"], domain="ai.kiln", scale=0.5)
    proto = make_model([node], [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                for n in ("q", "k", "v")],
                       [helper.make_tensor_value_info("o", TensorProto.FLOAT, None)])
    proto.opset_import.append(helper.make_opsetid("ai.kiln", 1))
    out = tmp_path / "m.onnx"
    kiln.save(kiln.load(proto), out)
    assert not onnx.load(str(out)).functions
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((2, 3, 4)).astype(np.float32) for _ in range(3))
    s = q @ k.transpose(0, 2, 1) * 0.5
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v
    got = kiln.InferenceSession(str(out), optimize=False).run(None, {"q": q, "k": k, "v": v})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
