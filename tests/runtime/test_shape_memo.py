"""Layers that depend only on the inputs' shapes run once per input shape
(``kiln.runtime.shape_memo``). Oracle: onnxruntime on the same model and feeds, with
shapes and data changing between runs of one session."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import ort_run

BACKENDS = ["numpy", "torch"]


def _session(model, backend: str) -> kiln.InferenceSession:
    if backend == "torch":
        pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return kiln.InferenceSession(model, backend=backend)


def _model():
    """y = x + positions (Range over x's second dim) + 0.5 * (count of x's positive
    entries, a Shape of NonZero: data, not shape) + a Where over a mask built from
    ConstantOfShape(Shape(x))."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "one"], ["s"], axis=0),
        helper.make_node("Range", ["zero", "s", "one"], ["r"]),
        helper.make_node("Cast", ["r"], ["rf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["rf", "zero_v"], ["pos"]),
        helper.make_node("Add", ["x", "pos"], ["a"]),
        helper.make_node("Greater", ["x", "zero_f"], ["gt"]),
        helper.make_node("NonZero", ["gt"], ["nz"]),
        helper.make_node("Shape", ["nz"], ["nzs"]),
        helper.make_node("Gather", ["nzs", "one"], ["count"], axis=0),
        helper.make_node("Cast", ["count"], ["cf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["cf", "half"], ["ch"]),
        helper.make_node("Add", ["a", "ch"], ["b"]),
        helper.make_node("ConstantOfShape", ["shape"], ["ones"],
                         value=numpy_helper.from_array(np.array([1], np.int64))),
        helper.make_node("Greater", ["ones", "zero"], ["mask"]),
        helper.make_node("Where", ["mask", "b", "zero_f"], ["y"]),
    ]
    inits = [numpy_helper.from_array(np.array(v, dt), n) for n, v, dt in (
        ("one", 1, np.int64), ("zero", 0, np.int64), ("zero_v", [0], np.int64),
        ("zero_f", 0.0, np.float32), ("half", 0.5, np.float32))]
    graph = helper.make_graph(
        nodes, "shape_memo", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            ["b", "s"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s"])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_shape_only_layers_follow_the_shapes_and_data_layers_the_data(backend):
    proto = _model()
    sess = _session(proto, backend)
    memo = sess.plan.program.memo
    assert memo is not None
    rng = np.random.default_rng(0)
    # same shapes with different data (the NonZero count changes), and shapes coming back
    for shape in [(2, 5), (2, 5), (3, 7), (2, 5), (1, 1), (3, 7)]:
        x = rng.normal(0, 1, shape).astype(np.float32)
        (got,) = sess.run(None, {"x": x})
        np.testing.assert_allclose(got, ort_run(proto, {"x": x})[0], rtol=1e-6, atol=1e-6)
    assert len(memo) == 3


def test_unoptimized_sessions_run_every_layer():
    """Without Kiln's inference the types are the file's word: no layer is skipped."""
    sess = kiln.InferenceSession(_model(), optimize=False)
    assert sess.plan.program.memo is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_bert_mask_code_runs_once_per_shape(zoo_model, backend):
    """BERT's export builds its positions and attention mask from Shape at every run: 28
    of its layers. Runs alternating two shapes and masks match onnxruntime."""
    from kiln.zoo.registry import make_inputs

    path = str(zoo_model("bert"))
    sess = _session(path, backend)
    for batch, seq, seed in ((1, 16, 0), (2, 24, 1), (1, 16, 2), (2, 24, 3)):
        feed = make_inputs("bert", batch, seq, seed)
        feed["attention_mask"][:, seq // 2 + seed:] = 0
        for got, want in zip(sess.run(None, feed), ort_run(path, feed)):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert len(sess.plan.program.memo) == 2


def test_values_past_the_memory_budget_are_recomputed(monkeypatch):
    import kiln.runtime.executor as executor

    monkeypatch.setattr(executor, "MAX_BYTES", 16)  # less than one run's positions
    proto = _model()
    sess = _session(proto, "numpy")
    for shape in [(2, 5), (2, 5)]:
        x = np.random.default_rng(1).normal(0, 1, shape).astype(np.float32)
        (got,) = sess.run(None, {"x": x})
        np.testing.assert_allclose(got, ort_run(proto, {"x": x})[0], rtol=1e-6, atol=1e-6)
    assert sess.plan.program.memo == {}


def test_profile_shows_the_shape_only_layers_as_run_once():
    """``kiln profile`` times what a session's runs do: the shape-only layers ran once
    (their output shapes are known) and are skipped by the measured runs."""
    from kiln.tools.profiling import profile

    x = np.random.default_rng(3).normal(0, 1, (2, 5)).astype(np.float32)
    p = profile(_session(_model(), "numpy"), {"x": x}, runs=3, warmup=1)
    once = {x.op_type for x in p.layers if x.once}
    assert {"Range", "ConstantOfShape"} <= once and "NonZero" not in once, once
    for layer in p.layers:
        assert layer.shape is not None, layer.name
        assert (len(layer.times_ms) == 0) == layer.once, layer.name


def test_observed_runs_skip_what_the_program_keeps_and_give_the_same_outputs():
    proto = _model()
    sess = _session(proto, "numpy")
    x = np.random.default_rng(4).normal(0, 1, (3, 4)).astype(np.float32)
    want = ort_run(proto, {"x": x})[0]
    seen: list = []
    (got,) = sess.plan.run([x], observer=lambda step, a, b, r: seen.append(step))
    assert len(seen) == len(sess.plan.steps)  # nothing kept for these shapes yet
    sess.run(None, {"x": x})
    seen.clear()
    (again,) = sess.plan.run([x], observer=lambda step, a, b, r: seen.append(step))
    assert len(seen) == len(sess.plan.steps) - len(sess.plan.program.once)
    for out in (got, again):
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
