"""Speed-aware quantization: every quantized layer is timed alone, float and quantized, on
the target backend, and those not measured faster go back to float.

No timed assertions: whatever this machine measures, the saved file must be the mix the
report describes (a reverted layer reads its float weight, a kept one a DequantizeLinear),
valid ONNX, and Kiln must run it as onnxruntime does (within one quantization step)."""

from __future__ import annotations

import re
from importlib import resources

import numpy as np
import onnx
from onnx import numpy_helper

import kiln
from conftest import ort_run
from kiln.onnxio import to_proto
from kiln.runtime.backends import default_backend_name

DIGITS = resources.files("kiln") / "data"


def _weight_is_quantized(proto: onnx.ModelProto, layer: str) -> bool:
    producers = {o: n for n in proto.graph.node for o in n.output}
    node = next(n for n in proto.graph.node if n.name == layer)
    p = producers.get(node.input[1])
    return p is not None and p.op_type == "DequantizeLinear"


def _printed_times(text: str) -> dict[str, tuple[float, float, str]]:
    """The report's per-layer lines: ``name: F ms -> Q ms (kept|reverted)``."""
    found = re.findall(r"^  (\S+): ([\d.]+) ms -> ([\d.]+) ms \((kept|reverted)\)$", text,
                       re.MULTILINE)
    return {name: (float(f), float(q), verdict) for name, f, q, verdict in found}


def test_speed_aware_mix_matches_report_and_onnxruntime(tmp_path, capsys):
    from kiln.cli.main import main

    images = np.load(str(DIGITS / "digits_test.npz"))["images"]
    np.savez(tmp_path / "cal.npz", image=images[:64])
    out = tmp_path / "q.onnx"
    # no --backend, no --speed-aware: the defaults time on the default session's backend
    assert main(["quantize", str(DIGITS / "digits_cnn.onnx"), "-o", str(out), "--mode",
                 "static", "--calibration", str(tmp_path / "cal.npz")]) == 0
    printed = capsys.readouterr().out
    assert f"measured on {default_backend_name()}: the backend a default " \
        "kiln.InferenceSession runs the file on" in printed, printed
    times = _printed_times(printed)
    # the CNN's four compute layers were each timed and printed
    assert sorted(times) == ["/0/Conv", "/11/Gemm", "/3/Conv", "/9/Gemm"]
    proto = onnx.load(str(out))
    onnx.checker.check_model(proto, full_check=True)
    whole = "the model with" in printed  # the whole model timed not faster: all float
    for layer, (f_ms, q_ms, verdict) in times.items():
        assert f_ms > 0 and q_ms > 0
        if whole:
            assert verdict == "reverted", layer
        elif q_ms != f_ms:  # equal as printed (0.1 us): the verdict may go either way
            assert (verdict == "kept") == (q_ms < f_ms), (layer, f_ms, q_ms, verdict)
        assert _weight_is_quantized(proto, layer) == (verdict == "kept"), layer
    (ref,) = ort_run(proto, {"image": images})
    inits = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    steps = [float(inits[n.input[1]].max()) for n in proto.graph.node
             if n.op_type == "QuantizeLinear"]
    for backend in ("numpy", "torch"):
        (got,) = kiln.InferenceSession(proto, backend=backend).run(None, {"image": images})
        np.testing.assert_allclose(got, ref, atol=1.001 * max(steps, default=1e-4), rtol=0)


def test_speed_aware_times_a_product_of_two_activations():
    """Attention multiplies two computed tensors (Q @ K^T). Its span is cut at both
    inputs and timed like any layer; before, the cut took only the first input and the
    whole quantization failed ("cannot be computed from the inputs")."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.normal(0, 0.2, (32, 32)).astype(np.float32), n)
               for n in ("wq", "wk")]
    nodes = [helper.make_node("MatMul", ["x", "wq"], ["q"], name="query"),
             helper.make_node("MatMul", ["x", "wk"], ["k"], name="key"),
             helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 1], name="kt"),
             helper.make_node("MatMul", ["q", "kt"], ["s"], name="scores")]
    graph = helper.make_graph(
        nodes, "attention", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            [2, 16, 32])],
        [helper.make_tensor_value_info("s", TensorProto.FLOAT, [2, 16, 16])], weights)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = [{"x": rng.normal(0, 1, (2, 16, 32)).astype(np.float32)} for _ in range(3)]
    q = kiln.quantize(proto, "static", feeds, speed_aware=True, measure_latency=False)
    assert sorted(q.report.layer_times) == ["key", "query", "scores"]
    out = to_proto(q.model)
    onnx.checker.check_model(out, full_check=True)
    (ref,) = ort_run(out, feeds[0])
    (got,) = kiln.InferenceSession(out).run(None, feeds[0])
    inits = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}
    steps = [float(inits[n.input[1]].max()) for n in out.graph.node
             if n.op_type == "QuantizeLinear"]
    np.testing.assert_allclose(got, ref, atol=1.001 * max(steps, default=1e-4), rtol=0)


def test_speed_aware_is_the_default_where_there_is_data():
    """Issue 42 item 5: a static quantization with no backend named measures on the
    backend a default session runs the file on (torch here) and says so; it times its
    layers there and keeps in float those measured slower (then the whole model, float
    against quantized); the file holds exactly the mix the report states: no layer stays
    quantized whose quantized time was not below its float time.
    ``speed_aware=False`` quantizes every layer; a dynamic run without data times none."""
    path = str(DIGITS / "digits_cnn.onnx")
    images = np.load(str(DIGITS / "digits_test.npz"))["images"]
    feeds = [{"image": images[:16]}]
    q = kiln.quantize(path, "static", feeds, measure_latency=False)
    session = kiln.InferenceSession(path)
    assert q.report.backend == session.placement().backend == "torch"
    assert "measured on torch: the backend a default kiln.InferenceSession runs the file " \
        "on" in str(q.report)
    assert "as asked" in kiln.quantize(path, "dynamic", backend="torch").report.backend_why
    assert sorted(q.report.layer_times) == ["/0/Conv", "/11/Gemm", "/3/Conv", "/9/Gemm"]
    proto = to_proto(q.model)
    onnx.checker.check_model(proto, full_check=True)
    # the whole model decides last: if what was left quantized was not faster as a
    # whole, every layer is float and says why
    whole = any("the model with" in why for why in q.report.kept.values())
    for layer, (f_ms, q_ms) in q.report.layer_times.items():
        float_kept = whole or q_ms >= f_ms
        assert _weight_is_quantized(proto, layer) == (not float_kept), layer
        assert ("speed-aware" in q.report.kept.get(layer, "")) == float_kept, layer
    every = to_proto(kiln.quantize(path, "static", feeds, backend="torch",
                                   speed_aware=False, measure_latency=False).model)
    assert all(_weight_is_quantized(every, n) for n in q.report.layer_times)
    dyn = kiln.quantize(path, "dynamic", measure_latency=False)
    assert dyn.report.layer_times == {}


def test_speed_aware_times_batch_one_too():
    """A calibration feed of many samples is timed as given and cut to one sample (the
    real-time batch): a layer stays quantized only if faster at both, so the report's
    pair for it is the worse one. The cut follows the declared shapes: only an input
    whose first dimension is not fixed is sliced."""
    from kiln.quantize.fp16 import as_model
    from kiln.quantize.speed import one_sample

    path = str(DIGITS / "digits_cnn.onnx")
    images = np.load(str(DIGITS / "digits_test.npz"))["images"]
    declared = onnx.load(path).graph.input[0].type.tensor_type.shape.dim[0]
    assert not declared.HasField("dim_value")  # the file's batch is symbolic
    one = one_sample(as_model(path), {"image": images[:16]})
    np.testing.assert_array_equal(one["image"], images[:1])
    assert one_sample(as_model(path), {"image": images[:1]}) is None
    stages = []
    q = kiln.quantize(path, "static", [{"image": images[:16]}], measure_latency=False,
                      on_stage=stages.append)
    assert any("(calibration batch and batch 1)" in s for s in stages), stages
    proto = to_proto(q.model)
    whole = any("the model with" in why for why in q.report.kept.values())
    for layer, (f_ms, q_ms) in q.report.layer_times.items():
        assert _weight_is_quantized(proto, layer) == (not whole and q_ms < f_ms), layer
