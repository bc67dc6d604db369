"""Outlier-aware static quantization (issue 48 item 2, kiln.quantize.outliers): a layer
whose input has channels far below one step of its 8-bit grid, read through large
weights, is measured noisy and kept in float; each tensor's calibration method is the
one measured least noisy for the layers reading it (``method="auto"``). Both opt-in:
on the trained models measured they did not beat minmax (docs/quantization.md).

Oracles: onnxruntime runs the float file and Kiln's quantized files; NumPy computes the
grid's error for the method choice."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import ort_run
from kiln.onnxio import to_proto


def _outlier_conv() -> tuple[onnx.ModelProto, list[dict]]:
    """A 1x1 Conv over 8 channels: six loud (std 10), two quiet (std 0.02) that the
    weights amplify 500x, so the quiet ones carry half the output."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.05, (4, 8, 1, 1)).astype(np.float32)
    w[:, 6:] *= 500 * 10 / 0.02 / 500  # |w| * std equal for loud and quiet channels
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="mix")]
    graph = helper.make_graph(
        nodes, "outliers", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                           [2, 8, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 6, 6])],
        [numpy_helper.from_array(w, "w")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    std = np.array([10] * 6 + [0.02] * 2, np.float32).reshape(1, 8, 1, 1)
    feeds = [{"x": (rng.normal(0, 1, (2, 8, 6, 6)) * std).astype(np.float32)}
             for _ in range(4)]
    return proto, feeds


def _rel_error(proto, quantized, feeds) -> float:
    err = ref = 0.0
    for f in feeds:
        (a,), (b,) = ort_run(proto, f), ort_run(to_proto(quantized.model), f)
        err, ref = max(err, float(np.abs(a - b).max())), max(ref, float(np.abs(a).max()))
    return err / ref


def test_a_layer_reading_quiet_channels_through_large_weights_stays_float():
    """``max_noise``: the Conv whose quiet channels fall below one step of the per-tensor
    grid is measured noisy and kept float; without it, it is quantized (the default)."""
    proto, feeds = _outlier_conv()
    q = kiln.quantize(proto, "static", feeds[:2], max_noise=0.02, measure_latency=False,
                      backend="numpy")
    assert "outlier-aware" in q.report.kept.get("mix", ""), q.report.kept
    every = kiln.quantize(proto, "static", feeds[:2], measure_latency=False, backend="numpy")
    assert "mix" in every.report.quantized
    # onnxruntime on held-out feeds: the quantized Conv loses the quiet half of the
    # signal; the kept one is the float layer
    assert _rel_error(proto, every, feeds[2:]) > 0.05
    assert _rel_error(proto, q, feeds[2:]) < 1e-6


def test_each_tensor_takes_the_method_its_readers_measure_least_noisy():
    """With one loud value among small ones, minmax spends the grid on it and the other
    methods clip it: the auto choice must be the method whose grid NumPy measures the
    smallest squared error on the data (an identity 1x1 Conv weighs every channel the
    same)."""
    from kiln.passes.infer_shapes import infer_model
    from kiln.quantize import outliers, qdq
    from kiln.quantize.api import as_model
    from kiln.quantize.calibrate import calibrate_all

    rng = np.random.default_rng(1)
    w = np.eye(4, dtype=np.float32).reshape(4, 4, 1, 1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="c")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 32, 32])],
        [numpy_helper.from_array(w, "w")])
    m = as_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    infer_model(m)
    feeds = []
    for _ in range(3):
        x = rng.normal(0, 1, (1, 4, 32, 32)).astype(np.float32)
        x[0, 0, 0, 0] = 200.0
        feeds.append({"x": x})
    plan = qdq.plan_layers(m, "static", qdq.COMPUTE_OPS, set())
    cands = calibrate_all(m, ["x", "y"], feeds)
    chosen = outliers.measure_noise(m, plan, feeds, cands, False, 8, True, "numpy")
    xs = np.concatenate([f["x"] for f in feeds])

    def mse(method):
        scale, zp = qdq.act_params(cands[method]["x"], False)
        q = (np.clip(np.rint(xs / scale) + float(zp), 0, 255) - float(zp)) * scale
        return float(((q - xs) ** 2).mean())
    assert chosen.method["x"] == min(cands, key=mse)


def test_smoothquant_keeps_the_quiet_channels_and_the_layer_quantized():
    """SmoothQuant migration (``smooth_alpha``): the quiet channels are scaled up to the
    loud ones' range and the weights reading them down by the same factor, so the Conv
    stays quantized (int8 weights and a uint8 input in the file) and onnxruntime running
    it on held-out feeds is within 2% of the float model, where plain minmax loses the
    quiet half of the signal (> 5%, the test above)."""
    proto, feeds = _outlier_conv()
    q = kiln.quantize(proto, "static", feeds[:2], smooth_alpha=0.5, measure_latency=False,
                      backend="numpy")
    assert "mix" in q.report.quantized and "mix" in q.report.smoothed
    assert "a float Mul in front" in q.report.smoothed["mix"]  # x is a graph input
    types = {t.data_type for t in to_proto(q.model).graph.initializer}
    assert TensorProto.INT8 in types and TensorProto.UINT8 in types
    assert _rel_error(proto, q, feeds[2:]) < 0.02


def _conv_affine_relu_conv(matmul: bool):
    """Conv -> Mul(c) -> Add(b) -> Relu -> Conv (or a MatMul over the channel axis after a
    Transpose): the second layer's input has loud and quiet channels; SmoothQuant's 1/s
    folds into the first Conv's weights and bias and the affine's constants."""
    rng = np.random.default_rng(3)
    w1 = rng.normal(0, 1, (6, 3, 3, 3)).astype(np.float32)
    w1[4:] *= 0.005
    c = rng.uniform(0.5, 2, (1, 6, 1, 1)).astype(np.float32)
    b = rng.uniform(0.1, 0.5, (6, 1, 1)).astype(np.float32)
    b[4:] = 0.0
    b1 = rng.normal(0, 1, (6,)).astype(np.float32)
    b1[4:] *= 0.005
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(c, "c"),
             numpy_helper.from_array(b, "b"), numpy_helper.from_array(b1, "b1")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["h"], name="c1", pads=[1] * 4),
             helper.make_node("Mul", ["h", "c"], ["hm"], name="scale"),
             helper.make_node("Add", ["hm", "b"], ["ha"], name="shift"),
             helper.make_node("Relu", ["ha"], ["r"], name="relu")]
    w2 = rng.normal(0, 0.2, (6, 5)).astype(np.float32)
    w2[4:] *= 200
    if matmul:
        nodes += [helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 3, 1]),
                  helper.make_node("MatMul", ["t", "w2"], ["y"], name="c2")]
        inits.append(numpy_helper.from_array(w2, "w2"))
        out = [2, 8, 8, 5]
    else:
        nodes.append(helper.make_node("Conv", ["r", "w2"], ["y"], name="c2"))
        inits.append(numpy_helper.from_array(w2.T.reshape(5, 6, 1, 1).copy(), "w2"))
        out = [2, 5, 8, 8]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = [{"x": rng.normal(0, 1, (2, 3, 8, 8)).astype(np.float32)} for _ in range(4)]
    return proto, feeds


def test_smoothing_folds_into_the_producer_and_keeps_the_function():
    """The migration is exact in float: 1/s folded through the Relu into the affine's
    bias and through its scale into the first Conv's weights and bias (as deep as it
    goes: every tensor between may get a grid of its own), no Mul inserted, and
    onnxruntime gives the smoothed float model's outputs as the original's (float32
    rounding); with no Conv to reach, the Mul's scale takes it."""
    from kiln.passes.infer_shapes import infer_model
    from kiln.quantize import qdq
    from kiln.quantize.api import as_model
    from kiln.quantize.smooth import smooth

    proto, feeds = _conv_affine_relu_conv(matmul=False)
    m = as_model(proto)
    infer_model(m)
    plan = qdq.plan_layers(m, "static", qdq.COMPUTE_OPS, set())
    done = smooth(m, [n for n in plan.quantized if n.name == "c2"], feeds[:2], 0.5)
    assert not done.inserted
    assert "through Relu, into Add shift, through Mul scale, into Conv c1's weights" in \
        done.layers["c2"]
    for f in feeds:
        (a,), (b,) = ort_run(proto, f), ort_run(to_proto(m), f)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())
    # x -> Mul -> Add -> Relu -> Conv: the Mul's scale takes it
    bare = onnx.ModelProto()
    bare.CopyFrom(proto)
    g = bare.graph
    keep = [n for n in g.node if n.name != "c1"]
    keep[0].input[0] = "x"
    del g.node[:]
    g.node.extend(keep)
    del g.input[0].type.tensor_type.shape.dim[:]
    for d in (2, 6, 8, 8):
        g.input[0].type.tensor_type.shape.dim.add().dim_value = d
    feeds = [{"x": np.random.default_rng(i).normal(0, 1, (2, 6, 8, 8)).astype(np.float32)}
             for i in range(4)]
    m = as_model(bare)
    infer_model(m)
    done = smooth(m, [n for n in m.graph.nodes if n.name == "c2"], feeds[:2], 0.5)
    assert done.layers["c2"].endswith("through Relu, into Add shift, into Mul scale)")
    for f in feeds:
        (a,), (b,) = ort_run(bare, f), ort_run(to_proto(m), f)
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * np.abs(a).max())


def test_smoothquant_on_a_matmul_reading_the_last_axis():
    """A MatMul smooths over its input's last axis; 1/s folds back through the Transpose
    (onto the channel axis it moved) and the Relu into the affine, and onnxruntime
    running the quantized file is less than half as far from the float model as
    without smoothing."""
    proto, feeds = _conv_affine_relu_conv(matmul=True)
    plain = kiln.quantize(proto, "static", feeds[:2], measure_latency=False, backend="numpy")
    smoothed = kiln.quantize(proto, "static", feeds[:2], smooth_alpha=0.5,
                             measure_latency=False, backend="numpy")
    assert "through Transpose, through Relu, into Add shift, through Mul scale, into Conv " \
        "c1's weights" in smoothed.report.smoothed["c2"]
    assert "c2" in smoothed.report.quantized
    assert _rel_error(proto, smoothed, feeds[2:]) < 0.5 * _rel_error(proto, plain, feeds[2:])


def test_budget_returns_the_float_model_at_once_when_no_layer_fits():
    """#48.3: when every layer quantized alone breaks the budget, no INT8 setting tried
    can meet it: the search says so after ranking (no reverting rounds) and returns the
    float model, which onnxruntime runs exactly like the original."""
    proto, feeds = _outlier_conv()
    q = kiln.quantize(proto, "static", feeds[:2], validation=feeds[2:], budget="rel=1e-5",
                      measure_latency=False, backend="numpy")
    log = "\n".join(q.report.budget_log)
    assert "SmoothQuant migration" in log  # tried among the cheaper fixes
    assert "no INT8 setting tried keeps this model within the budget" in log
    assert "layer(s) in float: shortfall" not in log  # no reverting rounds
    assert q.report.quantized == [] and "accuracy budget" in q.report.kept["mix"]
    assert _rel_error(proto, q, feeds[2:]) < 1e-6


def test_budget_in_the_task_s_own_terms():
    """#48.3: a budget on task agreement (here: the sign of every output, a decision per
    element) instead of relative error or top-1: the search meets it, and onnxruntime
    running the returned file makes the fp32 model's decision on at least 99% of the
    validation elements, where the default file makes it on fewer; SmoothQuant, among
    the cheaper fixes, meets it with the Conv still quantized."""
    proto, feeds = _outlier_conv()

    def signs(ref_runs, runs):
        same = [np.mean((r[0] > 0) == (g[0] > 0)) for r, g in zip(ref_runs, runs)]
        return float(np.mean(same))

    def agreement(q):
        ref = [ort_run(proto, f) for f in feeds[2:]]
        got = [ort_run(to_proto(q.model), f) for f in feeds[2:]]
        return signs(ref, got)

    plain = kiln.quantize(proto, "static", feeds[:2], measure_latency=False, backend="numpy")
    assert agreement(plain) < 0.99
    from kiln.quantize import Budget

    q = kiln.quantize(proto, "static", feeds[:2], validation=feeds[2:],
                      budget=Budget(agreement=signs, min_agreement=0.99),
                      backend="onnxruntime", measure_latency=False, speed_aware=False)
    log = "\n".join(q.report.budget_log)
    assert "budget met by SmoothQuant migration" in log, log
    assert "mix" in q.report.quantized  # not by giving the float model back
    assert agreement(q) >= 0.99


def test_smooth_alpha_that_is_no_strength_is_refused_before_any_work():
    """``smooth_alpha`` takes a strength, "auto" or None; another string is Kiln's own
    OptionError naming the choices, raised before calibration."""
    import pytest

    from kiln.errors import OptionError
    proto, feeds = _outlier_conv()
    with pytest.raises(OptionError, match="'auto'"):
        kiln.quantize(proto, "static", feeds[:1], smooth_alpha="strong", backend="numpy")
