"""INT8 (static, dynamic) and weight-only INT4/INT8 quantization in QDQ format.

Oracles: onnxruntime running the same quantized file (Kiln must agree within one
quantization step), the fp32 model's held-out accuracy (the shipped digits CNN,
calibrated on scikit-learn's training digits), NumPy for calibration statistics and for
the int4 packing ONNX specifies."""

from __future__ import annotations

import warnings
from importlib import resources

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import kiln
from conftest import ort_run
from kiln.errors import OptionError
from kiln.onnxio import to_proto
from kiln.quantize.calibrate import Range, calibrate
from kiln.quantize.cpu import weight_range

DIGITS = resources.files("kiln") / "data"


@pytest.fixture(scope="module")
def digits():
    """(model path, calibration feeds from the training digits, held-out images, labels).
    The CNN takes (n, 1, 8, 8) images scaled to [0, 1] (examples/train_digits.py)."""
    sklearn = pytest.importorskip("sklearn.datasets")
    from sklearn.model_selection import train_test_split

    d = sklearn.load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    x_tr, x_te, _, _ = train_test_split(x, d.target, test_size=0.25, random_state=0,
                                        stratify=d.target)
    test = np.load(str(DIGITS / "digits_test.npz"))
    np.testing.assert_array_equal(x_te, test["images"])  # same split as the shipped data
    feeds = [{"image": x_tr[i:i + 128]} for i in range(0, len(x_tr), 128)]
    return str(DIGITS / "digits_cnn.onnx"), feeds, test["images"], test["labels"]


def _one_step(proto: onnx.ModelProto) -> float:
    """The coarsest activation grid step in the file: integer kernels and a float
    reference may round one tensor differently by up to one step of its grid."""
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    return max(float(inits[n.input[1]].max()) for n in proto.graph.node
               if n.op_type == "QuantizeLinear")


def _ort_unoptimized(proto: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    """onnxruntime running every node as written (no fusion into integer kernels)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(proto.SerializeToString(), so,
                                providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _accuracy(logits, labels) -> float:
    return float((np.argmax(logits, 1) == labels).mean())


@pytest.mark.parametrize("method", ["minmax", "percentile", "entropy"])
def test_digits_static_keeps_accuracy_and_matches_onnxruntime(digits, method):
    path, feeds, images, labels = digits
    q = kiln.quantize(path, "static", feeds, method=method, measure_latency=False, backend="numpy")
    proto = to_proto(q.model)
    onnx.checker.check_model(proto, full_check=True)
    ops = {n.op_type for n in proto.graph.node}
    assert {"QuantizeLinear", "DequantizeLinear", "Conv", "Gemm"} <= ops
    (fp32,) = ort_run(path, {"image": images})
    (ort_q,) = ort_run(proto, {"image": images})
    (kiln_q,) = kiln.InferenceSession(proto, backend="numpy").run(None, {"image": images})
    assert abs(_accuracy(ort_q, labels) - _accuracy(fp32, labels)) <= 0.005
    assert abs(_accuracy(kiln_q, labels) - _accuracy(fp32, labels)) <= 0.005
    np.testing.assert_allclose(kiln_q, ort_q, atol=_one_step(proto), rtol=0)
    assert q.report.size_before > 3 * q.report.size_after
    assert len(q.report.quantized) == 8 and not q.report.kept


def test_weights_int8_symmetric_per_channel_biases_int32(digits):
    path, feeds, _, _ = digits
    q = kiln.quantize(path, "static", feeds[:2], measure_latency=False, reduce_range=True,
                      backend="numpy")
    proto = to_proto(q.model)
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    src = {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}
    for n in proto.graph.node:
        if n.op_type != "DequantizeLinear" or n.input[0] not in inits:
            continue
        w, scale, zp = (inits[i] for i in n.input)
        assert not zp.any()
        if w.dtype == np.int8:  # a weight: 7-bit range (no 16-bit overflow on AVX2)
            assert np.abs(w).max() <= 63 and scale.ndim == 1
            orig = src[n.input[0].removesuffix("_quantized")]
            deq = w * scale.reshape((-1,) + (1,) * (w.ndim - 1)) if n.attribute[0].i == 0 \
                else w * scale
            np.testing.assert_allclose(deq, orig, atol=float(scale.max()) / 2 + 1e-7)
        else:
            assert w.dtype == np.int32  # a bias at x_scale * w_scale


@pytest.mark.parametrize("kw", [dict(symmetric=True), dict(per_channel=False),
                                dict(reduce_range=False, method="percentile")])
def test_variants_run_the_same_in_kiln_and_onnxruntime(digits, kw):
    path, feeds, images, labels = digits
    q = kiln.quantize(path, "static", feeds[:3], measure_latency=False, **kw, backend="numpy")
    proto = to_proto(q.model)
    (ort_q,) = ort_run(proto, {"image": images[:100]})
    (kiln_q,) = kiln.InferenceSession(proto, backend="numpy").run(None, {"image": images[:100]})
    if q.report.weight_bits == 7 or weight_range(None).bits == 8:
        # 7-bit weights, or a CPU whose int8 kernels accumulate in int32 (VNNI): exact.
        np.testing.assert_allclose(kiln_q, ort_q, atol=_one_step(proto), rtol=0)
    else:
        # Full-range weights overflow onnxruntime's AVX2 u8s8 kernel where the machine
        # lacks VNNI (the default would not choose them there); Kiln computes exactly.
        assert _accuracy(kiln_q, labels[:100]) > 0.95


def test_digits_dynamic(digits):
    path, feeds, images, labels = digits
    q = kiln.quantize(path, "dynamic", measure_latency=False)
    proto = to_proto(q.model)
    onnx.checker.check_model(proto, full_check=True)
    assert sum(n.op_type == "DynamicQuantizeLinear" for n in proto.graph.node) == 4
    (fp32,) = ort_run(path, {"image": images})
    (ort_q,) = ort_run(proto, {"image": images})
    (kiln_q,) = kiln.InferenceSession(proto, backend="numpy").run(None, {"image": images})
    np.testing.assert_allclose(kiln_q, ort_q, atol=1e-4, rtol=1e-5)
    assert abs(_accuracy(kiln_q, labels) - _accuracy(fp32, labels)) <= 0.005
    assert q.report.outputs == {}  # no data given: nothing measured, and it says so
    assert "not measured" in str(q.report)


@pytest.mark.xfail(strict=True, reason="the torch backend's dynamic-quantization path differs "
                   "from onnxruntime's by up to ~1.5e-2 on 39 of 4,500 digits logits (found "
                   "when torch became the default backend; not yet explained)")
def test_digits_dynamic_on_torch_matches_onnxruntime(digits):
    pytest.importorskip("torch")
    path, feeds, images, labels = digits
    proto = to_proto(kiln.quantize(path, "dynamic", measure_latency=False).model)
    (ort_q,) = ort_run(proto, {"image": images})
    (kiln_q,) = kiln.InferenceSession(proto, backend="torch").run(None, {"image": images})
    np.testing.assert_allclose(kiln_q, ort_q, atol=1e-4, rtol=1e-5)


def test_report_measures_against_the_float_model(digits):
    path, feeds, images, labels = digits
    q = kiln.quantize(path, "static", feeds[:2], validation={"image": images}, backend="numpy")
    (fp32,) = ort_run(path, {"image": images})
    (kq,) = kiln.InferenceSession(q.model, backend="numpy").run(None, {"image": images})
    err = q.report.outputs["logits"]
    assert err.max_abs == pytest.approx(float(np.abs(kq - fp32).max()), rel=1e-3, abs=1e-4)
    assert err.top1 == pytest.approx(float((kq.argmax(1) == fp32.argmax(1)).mean()))
    assert q.report.samples == len(images)
    assert q.report.latency_before_ms > 0 and q.report.latency_after_ms > 0
    text = str(q)
    assert "top-1 agreement" in text and "MB ->" in text and "latency on numpy" in text


def test_calibration_statistics_against_numpy(digits):
    path, feeds, _, _ = digits
    m = kiln.load(path)
    names = ["/0/Conv_output_0", "/10/Relu_output_0"]
    # The oracle: onnxruntime computing the same intermediate tensors.
    proto = onnx.load(path)
    for n in names:
        proto.graph.output.append(onnx.ValueInfoProto(name=n))
    acts = [np.concatenate(x) for x in zip(*(ort_run(proto, f)[1:] for f in feeds))]
    got = calibrate(m, names, feeds, "minmax")
    for n, a in zip(names, acts):
        assert got[n].lo == pytest.approx(a.min(), abs=1e-4)
        assert got[n].hi == pytest.approx(a.max(), abs=1e-4)
    got = calibrate(m, names, feeds, "percentile", percentile=99.0)
    for n, a in zip(names, acts):
        width = (a.max() - a.min()) / 2048
        assert abs(got[n].hi - np.percentile(a, 99.5)) <= 2 * width
        assert abs(got[n].lo - np.percentile(a, 0.5)) <= 2 * width


def test_entropy_clips_outliers():
    # One tensor: Gaussian values plus a few huge outliers; KL calibration should clip
    # near the Gaussian's reach, not at the outliers.
    from onnx import TensorProto, helper
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])])
    m = kiln.load(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    rng = np.random.default_rng(0)
    x = rng.standard_normal(200_000).astype(np.float32)
    x[:5] = 60.0
    got = calibrate(m, ["y"], [{"x": x}], "entropy")["y"]
    assert isinstance(got, Range)
    assert 2.5 < got.hi < 10 and -10 < got.lo < -2.5


def test_weight_only_int4_blocked_bert(zoo_model):
    from kiln.zoo.registry import make_inputs

    path = str(zoo_model("bert"))
    feeds = make_inputs("bert", batch=2, seed=3)
    q = kiln.quantize(path, "weight-only", bits=4, block_size=32, validation=[feeds],
                      measure_latency=False, backend="numpy")
    proto = to_proto(q.model)
    onnx.checker.check_model(proto, full_check=True)
    assert proto.opset_import[0].version >= 21
    dqs = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"]
    assert len(dqs) == len(q.report.quantized) >= 24
    inits = {t.name: t for t in proto.graph.initializer}
    w = inits[dqs[0].input[0]]
    assert w.data_type == onnx.TensorProto.INT4
    # ONNX packs two int4 per byte, low nibble first.
    vals = numpy_helper.to_array(w).astype(np.int8).ravel()
    raw = np.frombuffer(w.raw_data, np.uint8)
    low = ((raw & 0x0F).astype(np.int8) ^ 8) - 8
    np.testing.assert_array_equal(low[: (vals.size + 1) // 2], vals[::2])
    assert {a.name: a.i for a in dqs[0].attribute}["block_size"] == 32
    refs, gots = ort_run(path, feeds), ort_run(proto, feeds)
    literal = _ort_unoptimized(proto, feeds)
    kilns = kiln.InferenceSession(proto, backend="numpy").run(None, feeds)
    for r, g, lit, k in zip(refs, gots, literal, kilns):
        # onnxruntime's fused int4 MatMul rounds differently (~1% here); run literally
        # (DQ, then a float MatMul) it is what Kiln computes.
        np.testing.assert_allclose(k, lit, atol=1e-4 * np.abs(lit).max() + 1e-5)
        np.testing.assert_allclose(k, g, atol=2e-2 * np.abs(g).max())
        assert np.abs(g - r).max() <= 0.3 * np.abs(r).max()  # the int4 cost, bounded
    assert q.report.size_before > 1.8 * q.report.size_after


@pytest.mark.parametrize("bits,block", [(8, 64), (4, 128)])
def test_weight_only_matches_onnxruntime(mlp_model, bits, block):
    q = kiln.quantize(mlp_model, "weight-only", bits=bits, block_size=block,
                      measure_latency=False)
    proto = to_proto(q.model)
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    (lit,) = _ort_unoptimized(proto, {"x": x})
    (g,) = ort_run(proto, {"x": x})
    (k,) = kiln.InferenceSession(proto, backend="numpy").run(None, {"x": x})
    np.testing.assert_allclose(k, lit, atol=1e-6)
    np.testing.assert_allclose(k, g, atol=2e-2)  # onnxruntime's fused kernel rounds more


def _embedding_model(vocab: int = 300, width: int = 24) -> onnx.ModelProto:
    """ids -> Gather(table) -> MatMul(w): a token embedding and a projection."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(7)
    table = (rng.standard_normal((vocab, width)) * rng.uniform(0.1, 3, width)).astype(np.float32)
    w = rng.standard_normal((width, 5)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["emb"], name="embed"),
         helper.make_node("MatMul", ["emb", "w"], ["y"], name="proj")], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", "s"])],
        [helper.make_tensor_value_info("emb", TensorProto.FLOAT, ["n", "s", width]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "s", 5])],
        [numpy_helper.from_array(table, "table"), numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_embedding_tables_int8_per_column(mode):
    """The Gather reads an int8 table and a DequantizeLinear follows it: every gathered
    element is within half a step of its column's grid of the float one in onnxruntime,
    and Kiln's backends compute what onnxruntime computes on the file."""
    model = _embedding_model()
    ids = np.random.default_rng(1).integers(0, 300, (4, 9))
    q = kiln.quantize(model, mode, [{"ids": ids}], measure_latency=False, backend="numpy")
    proto = to_proto(q.model)
    onnx.checker.check_model(proto, full_check=True)
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    gather = next(n for n in proto.graph.node if n.op_type == "Gather")
    assert inits[gather.input[0]].dtype == np.int8
    assert not any(a.dtype == np.float32 and a.shape == (300, 24) for a in inits.values())
    dq = next(n for n in proto.graph.node if gather.output[0] in n.input)
    assert dq.op_type == "DequantizeLinear"
    step = inits[dq.input[1]]
    assert step.shape == (24,)  # one scale per column
    fresh = np.random.default_rng(2).integers(0, 300, (3, 11))
    ref, got = ort_run(model, {"ids": fresh}), ort_run(proto, {"ids": fresh})
    assert np.all(np.abs(got[0] - ref[0]) <= step / 2 * (1 + 1e-6))
    for backend in ("numpy", "torch"):
        mine = kiln.InferenceSession(proto, backend=backend).run(None, {"ids": fresh})
        np.testing.assert_allclose(mine[0], got[0], rtol=0, atol=1e-6)
        np.testing.assert_allclose(mine[1], got[1], rtol=0, atol=_one_step(proto)
                                   if mode == "static" else 1e-2)
    assert q.report.size_after < 0.4 * q.report.size_before


def test_table_shared_with_a_matmul():
    """A tied table (read by a Gather and as a MatMul's weight) gives each its own
    quantized form: the MatMul still reads a dequantized float weight."""
    from onnx import TensorProto, helper

    table = np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("Gather", ["t", "ids"], ["e"]),
         helper.make_node("MatMul", ["x", "t"], ["y"])], "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [3]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("e", TensorProto.FLOAT, [3, 32]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
        [numpy_helper.from_array(table, "t")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    proto = to_proto(kiln.quantize(model, "dynamic", measure_latency=False).model)
    onnx.checker.check_model(proto, full_check=True)
    feeds = {"ids": np.array([0, 5, 63]),
             "x": np.random.default_rng(4).standard_normal((2, 64)).astype(np.float32)}
    ref, got = ort_run(model, feeds), ort_run(proto, feeds)
    for r, q in zip(ref, got):
        assert np.abs(q - r).max() <= 0.05 * np.abs(r).max()


def test_static_mlp_matches_onnxruntime(mlp_model):
    rng = np.random.default_rng(0)
    cal = [{"x": rng.standard_normal((16, 4)).astype(np.float32)} for _ in range(4)]
    q = kiln.quantize(mlp_model, "static", cal, measure_latency=False, backend="numpy")
    proto = to_proto(q.model)
    onnx.checker.check_model(proto, full_check=True)
    x = rng.standard_normal((64, 4)).astype(np.float32)
    (g,) = ort_run(proto, {"x": x})
    (k,) = kiln.InferenceSession(proto, backend="numpy").run(None, {"x": x})
    (kt,) = kiln.InferenceSession(proto, backend="torch").run(None, {"x": x})
    np.testing.assert_allclose(k, g, atol=_one_step(proto), rtol=0)
    np.testing.assert_allclose(kt, g, atol=_one_step(proto), rtol=0)
    assert q.report.outputs["y"].top1 >= 0.9


@pytest.mark.slow
def test_static_bert_matches_onnxruntime(zoo_model):
    from kiln.zoo.registry import make_inputs

    path = str(zoo_model("bert"))
    cal = [make_inputs("bert", batch=2, seed=s) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = kiln.quantize(path, "static", cal, measure_latency=False, backend="numpy")
    proto = to_proto(q.model)
    onnx.checker.check_model(proto, full_check=True)
    assert sum(n.op_type == "MatMul" for n in proto.graph.node) == 33
    feeds = make_inputs("bert", batch=2, seed=9)
    gots = ort_run(proto, feeds)
    kilns = kiln.InferenceSession(proto, backend="numpy").run(None, feeds)
    for g, k in zip(gots, kilns):
        np.testing.assert_allclose(k, g, atol=_one_step(proto), rtol=0)


def test_accuracy_budget_reverts_sensitive_layers(digits):
    path, feeds, images, _ = digits
    val = {"image": images}
    full = kiln.quantize(path, "static", feeds[:3], validation=val, measure_latency=False,
                         backend="numpy")
    budget = full.report.worst_rel() * 0.7  # tighter than plain quantization reaches
    q = kiln.quantize(path, "static", feeds[:3], validation=val, budget=f"rel={budget}",
                      measure_latency=False, backend="numpy")
    reverted = {k: v for k, v in q.report.kept.items() if "accuracy budget" in v}
    assert reverted and len(q.report.quantized) < len(full.report.quantized)
    # The oracle: onnxruntime on the saved file against onnxruntime on the float model.
    (fp32,) = ort_run(path, val)
    (got,) = ort_run(to_proto(q.model), val)
    assert np.abs(got - fp32).max() / np.abs(fp32).max() <= budget + 1e-6
    for name in reverted:  # reverted layers read float weights again
        node = next(n for n in q.model.graph.nodes if n.name == name)
        assert node.inputs[1].producer is None


def test_budget_measured_on_onnxruntime(digits, monkeypatch):
    """backend="onnxruntime": calibration, the budget and the report are measured by
    onnxruntime itself (every session Kiln opens is one of its), so the report's error is
    the one onnxruntime gives the file."""
    ort = pytest.importorskip("onnxruntime")
    path, feeds, images, _ = digits
    val = {"image": images}
    full = kiln.quantize(path, "static", feeds[:3], validation=val, measure_latency=False,
                         backend="numpy")
    budget = full.report.worst_rel() * 0.7
    opened = []

    class Counted(ort.InferenceSession):
        def __init__(self, *args, **kw):
            opened.append(args[0])
            super().__init__(*args, **kw)

    monkeypatch.setattr(ort, "InferenceSession", Counted)
    q = kiln.quantize(path, "static", feeds[:3], validation=val, budget=f"rel={budget}",
                      backend="onnxruntime")
    monkeypatch.undo()
    # calibration, the first build and one trial per layer, the reverts, report, latency
    assert len(opened) >= 2 + 2 * len(full.report.quantized)
    assert q.report.backend == "onnxruntime" and q.report.latency_after_ms > 0
    assert any("accuracy budget" in why for why in q.report.kept.values())
    (fp32,) = ort_run(path, val)
    (got,) = ort_run(to_proto(q.model), val)
    rel = np.abs(got - fp32).max() / np.abs(fp32).max()
    assert rel <= budget
    np.testing.assert_allclose(q.report.worst_rel(), rel, rtol=1e-6)
    with pytest.raises(OptionError, match="choose one of numpy, torch, onnxruntime"):
        kiln.quantize(path, "static", feeds[:1], backend="openvino")


def test_cli_quantize(tmp_path, digits, capsys):
    from kiln.cli.main import main

    path, feeds, images, labels = digits
    data, out = tmp_path / "cal.npz", tmp_path / "q.onnx"
    np.savez(data, image=np.concatenate([f["image"] for f in feeds[:2]]))
    assert main(["quantize", path, "-o", str(out), "--mode", "static", "--calibration",
                 str(data), "--method", "percentile", "--backend", "numpy"]) == 0
    text = capsys.readouterr().out
    assert "layers quantized: 8" in text and "top-1 agreement" in text and "latency" in text
    (fp32,) = ort_run(path, {"image": images})
    (got,) = ort_run(str(out), {"image": images})
    assert abs(_accuracy(got, labels) - _accuracy(fp32, labels)) <= 0.005
    assert main(["quantize", path, "-o", str(out), "--mode", "static"]) == 1
    assert "calibration data" in capsys.readouterr().err


@pytest.mark.slow
# About 30 s on 2 cores (one trial build per layer). Only resnet18 keeps some layers
# quantized within this budget; bert and mobilenetv2 revert every layer (their near-tie
# logits flip on any 8-bit layer), where the check below would pass on a float model.
@pytest.mark.parametrize("name", ["resnet18"])
def test_zoo_static_within_top1_budget(zoo_model, name):
    """Plain static INT8 of the zoo's seeded random-weight models keeps only 25-75% top-1
    agreement (their logits are near-ties: median top-1/top-2 margin 0.16 on resnet18);
    the accuracy-aware mode is what reaches 99%. Measured on onnxruntime and checked there:
    near ties flip with any engine's rounding, so a budget measured on Kiln's torch
    backend held on 13 of these 16 rows in onnxruntime."""
    from kiln.zoo.registry import make_inputs

    path = str(zoo_model(name))
    cal = [make_inputs(name, batch=4, seed=s) for s in range(2)]
    val = [make_inputs(name, batch=8, seed=100 + s) for s in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = kiln.quantize(path, "static", cal, validation=val, budget="top1=0.99",
                          backend="onnxruntime", measure_latency=False, speed_aware=False)
    proto = to_proto(q.model)
    agree = rows = 0
    for f in val:
        for r, g in zip(ort_run(path, f), ort_run(proto, f)):
            r2, g2 = r.reshape(-1, r.shape[-1]), g.reshape(-1, g.shape[-1])
            agree += int((r2.argmax(-1) == g2.argmax(-1)).sum())
            rows += len(r2)
    assert agree / rows >= 0.99
    assert q.report.quantized, "every layer was reverted: the file is the float model"


def test_optimized_model_quantizes_every_layer(digits):
    """#39.6: ``kiln.quantize(kiln.optimize(m))`` reported 1 layer quantized (the fused
    FusedConv/FusedGemm were skipped silently); the fused layers are expanded first, so
    the same layers are quantized as from the original file, and the result runs in
    onnxruntime as accurately."""
    path, feeds, images, labels = digits
    plain = kiln.quantize(path, "static", feeds[:2], measure_latency=False, backend="numpy")
    fused = kiln.quantize(kiln.optimize(path), "static", feeds[:2], measure_latency=False,
                          backend="numpy")
    assert len(fused.report.quantized) == len(plain.report.quantized) >= 8
    assert not fused.report.kept
    (got,) = ort_run(to_proto(fused.model), {"image": images})
    assert _accuracy(got, labels) > 0.95


def test_static_with_a_1d_output_whose_length_follows_the_feed():
    """#48.7: a VAD-like model whose 1-D output's length follows the input's crashed after
    calibration (the report concatenated the outputs of all feeds); the report now pools
    per-feed statistics, checked against NumPy on the same outputs from onnxruntime."""
    from onnx import TensorProto, helper

    from conftest import make_model
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 4, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("ReduceMax", ["r"], ["m"], name="max", axes=[1], keepdims=0),
             helper.make_node("Flatten", ["m"], ["f"], name="flat", axis=0),
             helper.make_node("Squeeze", ["f", "zero"], ["y"], name="sq")]
    model = make_model(nodes,
                       [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, "T"])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["L"])],
                       [w, numpy_helper.from_array(np.array([0], np.int64), "zero")])
    feeds = [{"x": rng.standard_normal((1, 4, t)).astype(np.float32)} for t in (16, 24, 40)]
    q = kiln.quantize(model, "static", feeds, measure_latency=False, backend="numpy")
    err = q.report.outputs["y"]
    qp = to_proto(q.model)
    diffs = [np.abs(ort_run(qp, f)[0] - ort_run(model, f)[0]).max() for f in feeds]
    scale = max(np.abs(ort_run(model, f)[0]).max() for f in feeds)
    assert err.rel == pytest.approx(max(diffs) / scale, rel=0.05, abs=2e-3)
    assert err.rel < 0.05


def test_static_on_a_transformer_recommends_dynamic(digits):
    """#48.4: static per-tensor activation scales lose accuracy on transformers' outlier
    channels (MiniLM: 63.5% static vs 95.8% dynamic top-1, measured from outside); a
    static quantization of an attention block says to use dynamic, in its report and in
    a warning (the report alone let it lose 35 points silently), a CNN's does not."""
    from onnx import TensorProto, helper

    from conftest import make_model
    rng = np.random.default_rng(0)
    wq = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "wq")
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="proj"),
             helper.make_node("Transpose", ["x"], ["kt"], perm=[0, 2, 1], name="t"),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores"),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1, name="softmax"),
             helper.make_node("MatMul", ["p", "x"], ["y"], name="mix")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [1, 4, 8])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8])],
                       [wq])
    feeds = [{"x": rng.standard_normal((1, 4, 8)).astype(np.float32)}]
    with pytest.warns(UserWarning, match="mode='dynamic'"):
        q = kiln.quantize(model, "static", feeds, measure_latency=False, backend="numpy")
    assert any("mode='dynamic'" in a for a in q.report.advice)
    assert "advice:" in str(q.report)
    path, cal, _, _ = digits
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cnn = kiln.quantize(path, "static", cal[:1], measure_latency=False,
                            backend="numpy").report.advice
    assert not any("dynamic" in a for a in cnn)
    assert not any("transformer" in str(w.message) for w in caught)


def test_batchnorm_after_conv_is_folded_before_quantizing(tmp_path):
    """Conv -> BatchNormalization -> Relu: the BN is folded into the Conv before the plan,
    so the static file has no float BN between a DequantizeLinear and a QuantizeLinear
    (PaddleOCR's classifier had 35, a fifth of its INT8 run on torch). Oracle:
    onnxruntime running the quantized file against onnxruntime running the fp32 one."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    c = 8
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("w", rng.standard_normal((c, 3, 3, 3)) * 0.3), ("scale", rng.uniform(0.5, 2, c)),
        ("bias", rng.standard_normal(c) * 0.1), ("mean", rng.standard_normal(c) * 0.2),
        ("var", rng.uniform(0.5, 3, c)))]
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("BatchNormalization", ["y", "scale", "bias", "mean", "var"],
                              ["z"], name="bn"),
             helper.make_node("Relu", ["z"], ["out"], name="relu")]
    graph = helper.make_graph(nodes, "convbn", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["n", 3, 12, 12])], [helper.make_tensor_value_info(
            "out", TensorProto.FLOAT, None)], inits)
    path = tmp_path / "convbn.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    feeds = [{"x": rng.standard_normal((4, 3, 12, 12)).astype(np.float32)} for _ in range(4)]
    proto = to_proto(kiln.quantize(str(path), "static", feeds, measure_latency=False,
                                   speed_aware=False).model)
    ops = [n.op_type for n in proto.graph.node]
    assert "BatchNormalization" not in ops and ops.count("Conv") == 1, ops
    (ref,) = ort_run(onnx.load(str(path)), feeds[0])
    (got,) = ort_run(proto, feeds[0])
    # within a few steps of the output grid (the coarsest: output range / 255)
    np.testing.assert_allclose(got, ref, atol=4 * float(ref.max()) / 255, rtol=0)
