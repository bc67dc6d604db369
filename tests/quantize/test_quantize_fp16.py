"""Half-precision conversion (kiln.convert_float16, `kiln convert`), checked against
onnxruntime running the fp32 original and the converted file, and against onnx.checker."""

from __future__ import annotations

import warnings
from importlib import resources

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import make_model, ort_run
from kiln.onnxio import to_proto

SMALL_ZOO = ["mobilenetv2", "emotion_ferplus", "bert", "gpt2"]
OTHER_ZOO = ["resnet18", "resnet50", "shufflenetv2", "vgg16", "tinyyolov2", "arcface", "roberta",
             "resnet18_dynamo", "mobilenetv2_dynamo", "shufflenetv2_dynamo",
             "tinyyolov2_dynamo", "arcface_dynamo", "emotion_ferplus_dynamo", "bert_dynamo",
             "roberta_dynamo", "gpt2_dynamo"]


def _checked(model: kiln.Model) -> onnx.ModelProto:
    proto = to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    return proto


def _elem_types(proto: onnx.ModelProto) -> dict[str, int]:
    inferred = onnx.shape_inference.infer_shapes(proto, strict_mode=True)
    g = inferred.graph
    out = {v.name: v.type.tensor_type.elem_type for v in
           list(g.value_info) + list(g.input) + list(g.output)}
    out.update({t.name: t.data_type for t in g.initializer})
    return out


def _conv_relu_matmul() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    m = numpy_helper.from_array(rng.standard_normal((4, 5)).astype(np.float32), "m")
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Transpose", ["r"], ["t"], name="tr", perm=[0, 2, 3, 1]),
             helper.make_node("MatMul", ["t", "m"], ["y"], name="mm")]
    return make_model(nodes,
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 6, 5])],
                      [w, m])


def test_weights_and_compute_half_io_float32():
    src = _conv_relu_matmul()
    proto = _checked(kiln.convert_float16(src))
    types = _elem_types(proto)
    assert types["x"] == types["y"] == TensorProto.FLOAT
    assert types["w"] == types["m"] == TensorProto.FLOAT16
    assert types["c"] == types["r"] == TensorProto.FLOAT16
    x = np.random.default_rng(1).standard_normal((1, 3, 6, 6)).astype(np.float32)
    (ref,), (got,) = ort_run(src, {"x": x}), ort_run(proto, {"x": x})
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, atol=2e-2 * np.abs(ref).max())


def test_half_io_when_asked():
    proto = _checked(kiln.convert_float16(_conv_relu_matmul(), keep_io_types=False))
    types = _elem_types(proto)
    assert types["x"] == types["y"] == TensorProto.FLOAT16
    assert not [n for n in proto.graph.node if n.op_type == "Cast"]


@pytest.mark.parametrize("blocked", ["Relu", "relu"])
def test_block_list_by_op_type_or_layer_name(blocked):
    src = _conv_relu_matmul()
    proto = _checked(kiln.convert_float16(src, block_list=[blocked]))
    types = _elem_types(proto)
    assert types["r"] == TensorProto.FLOAT  # the blocked layer computes in fp32
    assert types["c"] == TensorProto.FLOAT16 and types["w"] == TensorProto.FLOAT16
    relu = next(n for n in proto.graph.node if n.op_type == "Relu")
    cast_in = next(n for n in proto.graph.node if n.output[0] == relu.input[0])
    assert cast_in.op_type == "Cast"
    x = np.random.default_rng(2).standard_normal((1, 3, 6, 6)).astype(np.float32)
    (ref,), (got,) = ort_run(src, {"x": x}), ort_run(proto, {"x": x})
    np.testing.assert_allclose(got, ref, atol=2e-2 * np.abs(ref).max())


def test_out_of_range_constants_clamp_with_a_warning():
    # An additive attention-style mask of -3.4e38 and a 1e6 weight: Inf in fp16 unless clamped.
    mask = numpy_helper.from_array(
        np.array([0, np.finfo(np.float32).min, 0, 0], np.float32), "mask")
    big = numpy_helper.from_array(np.array([1e6, 1, 1, 1], np.float32), "big")
    nodes = [helper.make_node("Add", ["x", "mask"], ["s"]),
             helper.make_node("Softmax", ["s"], ["p"], axis=-1),
             helper.make_node("Mul", ["p", "big"], ["y"])]
    src = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
                     [mask, big])
    with pytest.warns(UserWarning, match="clamped"):
        proto = _checked(kiln.convert_float16(src))
    vals = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    assert all(np.isfinite(v).all() for v in vals.values())
    assert vals["mask"][1] == -65504 and vals["big"][0] == 65504
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32) * 0.1
    (got,) = ort_run(proto, {"x": x})
    (ref,) = ort_run(src, {"x": x})
    assert np.isfinite(got).all()
    assert (got[:, 1] == 0).all()  # the clamped mask still masks
    np.testing.assert_allclose(got[:, 2:], ref[:, 2:], rtol=2e-3)


def test_resize_and_shape_computations_stay_float32():
    # Resize's scales are geometry: fp16 scales would be a schema violation at best.
    scales = numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("Resize", ["r", "", "scales"], ["z"], mode="linear"),
             helper.make_node("Shape", ["z"], ["sh"]),
             helper.make_node("Cast", ["sh"], ["shf"], to=TensorProto.FLOAT),
             helper.make_node("Cast", ["shf"], ["shi"], to=TensorProto.INT64),
             helper.make_node("Reshape", ["z", "shi"], ["y"])]
    src = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                           [1, 2, 3, 3])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 6, 6])],
                     [scales])
    proto = _checked(kiln.convert_float16(src))
    types = _elem_types(proto)
    assert types["scales"] == types["shf"] == TensorProto.FLOAT
    assert types["z"] == TensorProto.FLOAT  # Resize itself runs in fp32
    assert types["r"] == TensorProto.FLOAT16
    x = np.random.default_rng(4).standard_normal((1, 2, 3, 3)).astype(np.float32)
    (ref,), (got,) = ort_run(src, {"x": x}), ort_run(proto, {"x": x})
    np.testing.assert_allclose(got, ref, atol=2e-3)


def test_integer_paths_untouched():
    ids = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(3, 4), "table")
    nodes = [helper.make_node("Gather", ["table", "i"], ["g"]),
             helper.make_node("Add", ["i", "i"], ["j"]),
             helper.make_node("Relu", ["g"], ["y"])]
    src = make_model(nodes, [helper.make_tensor_value_info("i", TensorProto.INT64, [2])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4]),
                      helper.make_tensor_value_info("j", TensorProto.INT64, [2])], [ids])
    proto = _checked(kiln.convert_float16(src))
    types = _elem_types(proto)
    assert types["j"] == types["i"] == TensorProto.INT64
    feeds = {"i": np.array([2, 0], np.int64)}
    for r, g in zip(ort_run(src, feeds), ort_run(proto, feeds)):
        np.testing.assert_array_equal(g, r)


def test_bf16_weights(mlp_model):
    proto = _checked(kiln.convert_float16(mlp_model, bf16=True))
    types = _elem_types(proto)
    assert types["w1"] == types["hb"] == TensorProto.BFLOAT16
    assert types["x"] == types["y"] == TensorProto.FLOAT
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    (ref,) = ort_run(mlp_model, {"x": x})
    (got,) = kiln.InferenceSession(proto).run(None, {"x": x})
    np.testing.assert_allclose(got, ref, atol=3e-2)


def _zoo_case(zoo_model, name: str) -> None:
    from kiln.zoo.registry import make_inputs

    path = zoo_model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # attention masks clamp, and say so
        proto = _checked(kiln.convert_float16(str(path)))
    data = proto.SerializeToString()
    assert len(data) < 0.55 * path.stat().st_size
    feeds = make_inputs(name, batch=2)
    refs, gots = ort_run(str(path), feeds), ort_run(proto, feeds)
    kilns = kiln.InferenceSession(data).run(None, feeds)
    for ref, got, kgot in zip(refs, gots, kilns):
        assert got.dtype == np.float32 and np.isfinite(got).all() and np.isfinite(kgot).all()
        scale = np.abs(ref).max()
        np.testing.assert_allclose(got, ref, atol=1e-2 * scale, rtol=0)
        np.testing.assert_allclose(kgot, got, atol=1e-2 * scale, rtol=0)


@pytest.mark.parametrize("name", SMALL_ZOO)
def test_zoo_fp16_small(zoo_model, name):
    _zoo_case(zoo_model, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", OTHER_ZOO)
def test_zoo_fp16_all(zoo_model, name):
    _zoo_case(zoo_model, name)


def test_cli_convert(tmp_path, mlp_model, capsys):
    from kiln.cli.main import main

    src, out = tmp_path / "m.onnx", tmp_path / "m16.onnx"
    onnx.save(mlp_model, src)
    assert main(["convert", str(src), "-o", str(out), "--fp16", "--block", "Softmax"]) == 0
    assert "float16" in capsys.readouterr().out
    proto = onnx.load(out)
    onnx.checker.check_model(proto, full_check=True)
    x = np.random.default_rng(6).standard_normal((2, 4)).astype(np.float32)
    (ref,), (got,) = ort_run(mlp_model, {"x": x}), ort_run(str(out), {"x": x})
    np.testing.assert_allclose(got, ref, atol=1e-2)


def _run(proto: onnx.ModelProto, feeds: dict, backend: str) -> list[np.ndarray]:
    if backend == "onnxruntime":
        return ort_run(proto, feeds)
    return kiln.InferenceSession(proto.SerializeToString(), backend=backend).run(None, feeds)


def _bn_model(after_conv: bool) -> onnx.ModelProto:
    """Conv (or Relu) then BatchNormalization whose running variance is 9.79e7, as a
    trained text detector's: beyond float16's 65504."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
                                     * 50, "w"),
             numpy_helper.from_array(np.ones(4, np.float32), "g"),
             numpy_helper.from_array(np.zeros(4, np.float32), "b"),
             numpy_helper.from_array(np.full(4, 50.0, np.float32), "mean"),
             numpy_helper.from_array(np.array([9.79e7, 4e4, 1.0, 2e5], np.float32), "var")]
    first = helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]) \
        if after_conv else helper.make_node("Relu", ["x"], ["c"], name="relu")
    chans = 4 if after_conv else 3
    if not after_conv:
        inits = inits[1:]
        inits = [numpy_helper.from_array(numpy_helper.to_array(t)[:3], t.name) for t in inits]
    nodes = [first, helper.make_node("BatchNormalization", ["c", "g", "b", "mean", "var"],
                                     ["y"], name="bn")]
    return make_model(nodes,
                      [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                     [1, chans, 8, 8])], inits)


@pytest.mark.parametrize("after_conv", [True, False])
@pytest.mark.parametrize("backend", ["onnxruntime", "numpy", "torch"])
def test_batchnorm_beyond_fp16_range_is_folded_or_kept(after_conv, backend):
    """Folded into the Conv (the variance never becomes a float16 constant) or, alone,
    kept float32 with a warning naming it; never clamped to 65504 (#48.5)."""
    src = _bn_model(after_conv)
    x = np.random.default_rng(4).standard_normal((1, 3, 8, 8)).astype(np.float32) * 10
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proto = _checked(kiln.convert_float16(src))
    said = " ".join(str(w.message) for w in caught)
    assert "clamped" not in said
    if not after_conv:
        assert "bn (its constants exceed the half range" in said
    (ref,), (got,) = ort_run(src, {"x": x}), _run(proto, {"x": x}, backend)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=0, atol=5e-3 * np.abs(ref).max())


def _loud_frontend() -> onnx.ModelProto:
    """int16-scale audio framed and 'transformed' (a MatMul with a cosine basis, as an STFT
    is), then power and log: the transform's output reaches ~5e5, beyond float16."""
    n = 64
    k = np.arange(n)
    basis = np.cos(2 * np.pi * np.outer(k, k[: n // 2]) / n).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "basis"], ["spec"], name="stft"),
             helper.make_node("Abs", ["spec"], ["mag"], name="abs"),
             helper.make_node("Add", ["mag", "one"], ["mag1"], name="add_one"),
             helper.make_node("Log", ["mag1"], ["y"], name="log")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, n])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, n // 2])],
                      [numpy_helper.from_array(basis, "basis"),
                       numpy_helper.from_array(np.array(1.0, np.float32), "one")])


@pytest.mark.parametrize("backend", ["onnxruntime", "numpy", "torch"])
def test_calibration_keeps_overflowing_layers_float32(backend):
    """With calibration data, the layers that meet values beyond float16's range stay
    float32 (warned by name) and no output is Inf or NaN; without it the output overflows
    (which is what the calibration is for) (#48.5)."""
    src = _loud_frontend()
    rng = np.random.default_rng(5)
    t = np.arange(64) / 16000

    def audio(seed):
        r = np.random.default_rng(seed)
        return (np.cos(2 * np.pi * 250 * t)[None] * 30000 +
                r.normal(0, 200, (4, 64))).astype(np.float32)
    cal = [{"x": audio(s)} for s in range(4)]
    x = audio(99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proto = _checked(kiln.convert_float16(src, calibration=cal))
    said = " ".join(str(w.message) for w in caught)
    assert "stft (" in said and "reaches" in said
    (ref,), (got,) = ort_run(src, {"x": x}), _run(proto, {"x": x}, backend)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, ref, rtol=2e-3, atol=1e-2)
    unsafe = to_proto(kiln.convert_float16(src, block_list=["Nothing"]))
    (bad,) = _run(unsafe, {"x": x}, "numpy")
    assert not np.isfinite(bad).all() or np.abs(bad - ref).max() > 1e-1
    del rng


@pytest.fixture(scope="module")
def digits_path() -> str:
    """The digits CNN Kiln ships (examples/train_digits.py)."""
    return str(resources.files("kiln") / "data" / "digits_cnn.onnx")


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_fused_model_converts_every_layer(digits_path, backend):
    """``convert_float16(kiln.optimize(m))``: Kiln's fused layers are expanded and
    converted, so every float weight becomes float16 (#39.6: 37,632 of 38,282 stayed
    float32), and the file runs within float16 error of onnxruntime on the original."""
    proto = _checked(kiln.convert_float16(kiln.optimize(digits_path)))
    weights = [t for t in proto.graph.initializer if t.data_type in
               (TensorProto.FLOAT, TensorProto.FLOAT16) and len(t.dims) >= 2]
    assert weights and all(t.data_type == TensorProto.FLOAT16 for t in weights)
    images = np.load(digits_path.replace("digits_cnn.onnx", "digits_test.npz"))["images"][:64]
    (ref,) = ort_run(digits_path, {"image": images})
    (got,) = _run(proto, {"image": images}, backend)
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.98
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-2 * np.abs(ref).max())


def test_bf16_below_opset_13_converts_and_says_so():
    """An opset-11 model: bfloat16 needs opset 13, so the model is upgraded and converted
    instead of coming back as the float32 model unchanged (#48.6); the warning says so,
    and says when onnxruntime cannot run the file."""
    src = _conv_relu_matmul()
    src.opset_import[0].version = 11
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        proto = _checked(kiln.convert_float16(src, bf16=True))
    said = " ".join(str(w.message) for w in caught)
    assert "opset 13" in said
    types = _elem_types(proto)
    # ONNX defines Conv for bfloat16 only from opset 22: it stays float32.
    assert types["m"] == types["r"] == TensorProto.BFLOAT16 and types["w"] == TensorProto.FLOAT
    x = np.random.default_rng(1).standard_normal((1, 3, 6, 6)).astype(np.float32)
    (ref,) = ort_run(src, {"x": x})
    (got,) = _run(proto, {"x": x}, "numpy")
    np.testing.assert_allclose(got, ref, atol=3e-2 * np.abs(ref).max())
    try:
        ort_run(proto, {"x": x})
    except Exception:
        assert "runs on Kiln only" in said


def _cancelling() -> onnx.ModelProto:
    """y = ((x + 1000) - 1000) * 2: float16's step at 1000 is 0.5, so the Sub gives back
    x rounded to halves; in float32 it gives x to 6e-5."""
    big = numpy_helper.from_array(np.array(1000, np.float32), "big")
    two = numpy_helper.from_array(np.array(2, np.float32), "two")
    nodes = [helper.make_node("Add", ["x", "big"], ["a"], name="shift"),
             helper.make_node("Sub", ["a", "big"], ["s"], name="unshift"),
             helper.make_node("Mul", ["s", "two"], ["y"], name="double")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 16])],
                      [big, two])


def test_measured_drop_is_warned_and_budget_keeps_the_layers_float32():
    """#48.5: float16 resolution loss that overflows nothing (a cancellation) was silent.
    With calibration data the conversion measures itself against float32 and the warning
    gives the error; with a budget the layers adding the error stay float32, named, and
    the file agrees with onnxruntime's fp32 run of the original within it (on Kiln's
    NumPy backend, where it was measured, and in onnxruntime, whose CPU provider runs
    these float16 ops in float32 and so never showed the drop)."""
    src = _cancelling()
    cal = [{"x": np.random.default_rng(s).normal(0, 3, (4, 16)).astype(np.float32)}
           for s in range(4)]
    x = np.random.default_rng(99).normal(0, 3, (4, 16)).astype(np.float32)
    (ref,) = ort_run(src, {"x": x})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain = _checked(kiln.convert_float16(src, calibration=cal))
    said = " ".join(str(w.message) for w in caught)
    assert "measured against float32 on 4 calibration feed(s)" in said
    (lossy,) = _run(plain, {"x": x}, "numpy")
    err = float(np.abs(lossy - ref).max() / np.abs(ref).max())
    assert err > 0.01  # the drop the warning reports is real
    assert "of its largest value" in said
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kept = _checked(kiln.convert_float16(src, calibration=cal, budget="rel=0.002"))
    said = " ".join(str(w.message) for w in caught)
    assert "stay float32" in said and "shift" in said and "unshift" in said
    for (got,) in (_run(kept, {"x": x}, "numpy"), ort_run(kept, {"x": x})):
        assert float(np.abs(got - ref).max() / np.abs(ref).max()) < 0.002
    with pytest.warns(UserWarning, match="accuracy against float32 was not measured"):
        kiln.convert_float16(src)
