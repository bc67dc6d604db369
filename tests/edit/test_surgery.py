"""Model surgery (kiln.cut, kiln.compose and the interface edits, kiln.preprocess) and the
freeze step's training-mode rules. Oracle: onnxruntime running the original model (with
the cut points exposed as outputs) on inputs NumPy prepared the same way the edited model
does inside; every edited model also passes onnx.checker's full check."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import make_model

ort = pytest.importorskip("onnxruntime")

DATA = Path(kiln.__file__).parent / "data"
DIGITS = str(DATA / "digits_cnn.onnx")


def checked(model: kiln.Model, tmp_path: Path, name: str = "edited.onnx") -> str:
    """Save ``model`` with kiln.save, check the file fully, return its path."""
    path = tmp_path / name
    kiln.save(model, path)
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    return str(path)


def ort_outputs(model, feeds: dict, extra: list[str] = ()) -> dict[str, np.ndarray]:
    """onnxruntime's values of the outputs of ``model`` plus the ``extra`` intermediates."""
    proto = onnx.load(str(model)) if isinstance(model, (str, Path)) else model
    proto = onnx.ModelProto.FromString(proto.SerializeToString())
    for name in extra:
        proto.graph.output.append(onnx.ValueInfoProto(name=name))
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, feeds)))


def digits_images(n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits: raw pixel values 0..16 as uint8 (N, 1, 8, 8), and labels."""
    datasets = pytest.importorskip("sklearn.datasets")
    d = datasets.load_digits()
    return d.images[:n].astype(np.uint8).reshape(n, 1, 8, 8), d.target[:n]


# -- cut ----------------------------------------------------------------------------------

def test_cut_by_tensor_agrees_with_the_originals_intermediates(zoo_model, tmp_path):
    path = str(zoo_model("emotion_ferplus"))
    x = np.random.default_rng(0).standard_normal((2, 1, 64, 64)).astype(np.float32)
    a, b = "/3/Relu_output_0", "/25/Relu_output_0"
    ref = ort_outputs(path, {"input": x}, [a, b])
    part = kiln.cut(path, inputs=[a], outputs=[b])
    assert [v.name for v in part.graph.inputs] == [a]
    assert [v.name for v in part.graph.outputs] == [b]
    t = part.graph.inputs[0].type
    assert t.dtype == kiln.DType.FLOAT and t.shape[1:] == (64, 64, 64)  # from inference
    got = ort_outputs(checked(part, tmp_path), {a: ref[a]})
    np.testing.assert_allclose(got[b], ref[b], rtol=1e-4, atol=1e-4)
    # everything after b and before a is gone, weights included
    assert len(part.graph.nodes) < len(kiln.load(path).graph.nodes) - 10
    read = {v.name for n in part.graph.nodes for v in n.inputs if v is not None}
    assert set(part.graph.initializers) <= read
    assert "29.weight" not in part.graph.initializers


def test_cut_by_layer_names_means_their_inputs_and_outputs(tmp_path):
    x = np.random.default_rng(1).random((3, 1, 8, 8), dtype=np.float32)
    ref = ort_outputs(DIGITS, {"image": x}, ["/2/Relu_output_0", "/10/Relu_output_0"])
    # input: the inputs of layer /3/Conv; output: the outputs of layer /10/Relu
    part = kiln.cut(DIGITS, inputs=["/3/Conv"], outputs=["/10/Relu"])
    assert [v.name for v in part.graph.inputs] == ["/2/Relu_output_0"]
    got = ort_outputs(checked(part, tmp_path), {"/2/Relu_output_0": ref["/2/Relu_output_0"]})
    np.testing.assert_allclose(got["/10/Relu_output_0"], ref["/10/Relu_output_0"],
                               rtol=1e-5, atol=1e-5)


def test_cut_with_a_given_input_shape(tmp_path):
    part = kiln.cut(DIGITS, inputs={"/2/Relu_output_0": "4x16x8x8"}, outputs=["logits"])
    assert part.graph.inputs[0].shape == (4, 16, 8, 8)
    assert part.graph.outputs[0].shape == (4, 10)
    checked(part, tmp_path)


def test_last_layers_has_singas_meaning(tmp_path):
    """SINGA runs singa_ops[:last_layers] and returns singa_ops[last_layers - 1]'s outputs:
    -1 drops the final Gemm and returns the Relu before it."""
    x = np.random.default_rng(2).random((2, 1, 8, 8), dtype=np.float32)
    names = ["/10/Relu_output_0", "/7/Flatten_output_0", "/0/Conv_output_0"]
    ref = ort_outputs(DIGITS, {"image": x}, names)
    for k, want in ((-1, names[0]), (-3, names[1]), (1, names[2])):
        part = kiln.cut(DIGITS, last_layers=k)
        assert [v.name for v in part.graph.outputs] == [want]
        got = ort_outputs(checked(part, tmp_path, f"k{k}.onnx"), {"image": x})
        np.testing.assert_allclose(got[want], ref[want], rtol=1e-5, atol=1e-5)


def test_cut_keeps_only_the_model_inputs_its_outputs_need(tmp_path):
    f = TensorProto.FLOAT
    proto = make_model([helper.make_node("Relu", ["a"], ["ya"]),
                        helper.make_node("Neg", ["b"], ["yb"])],
                       [helper.make_tensor_value_info(n, f, [2]) for n in "ab"],
                       [helper.make_tensor_value_info(n, f, [2]) for n in ("ya", "yb")])
    part = kiln.cut(proto, outputs=["yb"])
    assert [v.name for v in part.graph.inputs] == ["b"]
    b = np.array([1.5, -2.0], np.float32)
    np.testing.assert_array_equal(ort_outputs(checked(part, tmp_path), {"b": b})["yb"], -b)
    # inputs named explicitly are the interface asked for, used or not
    assert [v.name for v in kiln.cut(proto, inputs=["a", "b"], outputs=["yb"])
            .graph.inputs] == ["a", "b"]


def test_cut_errors_name_close_matches_and_unreachable_outputs(zoo_model):
    with pytest.raises(kiln.KilnError, match=r"did you mean '/10/Relu_output_0'"):
        kiln.cut(DIGITS, outputs=["/10/Relu_outptu_0"])
    with pytest.raises(kiln.KilnError, match="/3/Conv"):
        kiln.cut(DIGITS, inputs=["/3/Con"])
    # the Pad's pads come from constants, but its data is the image: cutting at the last
    # Conv's input leaves an earlier tensor unreachable
    path = str(zoo_model("tinyyolov2"))
    with pytest.raises(kiln.KilnError, match="needs 'input'"):
        kiln.cut(path, inputs=["/12/12.0/Conv"], outputs=["/11/Pad_output_0"])
    with pytest.raises(kiln.KilnError, match="either outputs= or last_layers="):
        kiln.cut(DIGITS, outputs=["logits"], last_layers=-1)
    with pytest.raises(kiln.KilnError, match="layers"):
        kiln.cut(DIGITS, last_layers=-9)


# -- compose, tails, batch, rename --------------------------------------------------------

def test_argmax_tail_on_a_classifier(tmp_path):
    images, labels = digits_images(64)
    x = (images / 16.0).astype(np.float32)  # the model was trained on pixels / 16
    ref = ort_outputs(DIGITS, {"image": x})["logits"]
    m = kiln.add_tail(DIGITS, "ArgMax")
    assert [v.name for v in m.graph.outputs] == ["logits_argmax"]
    got = ort_outputs(checked(m, tmp_path), {"image": x})["logits_argmax"]
    assert got.dtype == np.int64 and got.shape == (64,)
    np.testing.assert_array_equal(got, ref.argmax(axis=1))
    assert (got == labels).mean() > 0.9  # and it is a working classifier


def test_softmax_and_topk_tails(tmp_path):
    x = np.random.default_rng(3).random((5, 1, 8, 8), dtype=np.float32)
    logits = ort_outputs(DIGITS, {"image": x})["logits"]
    m = kiln.add_tail(DIGITS, "Softmax", keep_output=True)
    got = ort_outputs(checked(m, tmp_path, "sm.onnx"), {"image": x})
    e = np.exp(logits - logits.max(axis=1, keepdims=True))
    np.testing.assert_allclose(got["logits_softmax"], e / e.sum(axis=1, keepdims=True),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["logits"], logits, rtol=1e-6)
    m = kiln.add_tail(DIGITS, "TopK", k=3, name="top")
    got = ort_outputs(checked(m, tmp_path, "topk.onnx"), {"image": x})
    order = np.argsort(-logits, axis=1, kind="stable")[:, :3]
    np.testing.assert_array_equal(got["top_indices"], order)
    np.testing.assert_allclose(got["top_values"], np.take_along_axis(logits, order, 1),
                               rtol=1e-6)


def _yolo_decode_graph() -> onnx.GraphProto:
    """Tiny-YOLOv2 post-processing: the 125x13x13 grid as 5 anchors x 25, sigmoid of
    x, y and objectness, exp of w, h, softmax over the 20 classes."""
    shape = numpy_helper.from_array(np.array([0, 5, 25, 13, 13], np.int64), "dec_shape")
    idx = {k: numpy_helper.from_array(np.array(v, np.int64), f"dec_{k}")
           for k, v in {"xy": [0, 1], "wh": [2, 3], "obj": [4], "cls": list(range(5, 25))}
           .items()}
    nodes = [helper.make_node("Reshape", ["grid", "dec_shape"], ["boxes"], name="decode")]
    for k in idx:
        nodes.append(helper.make_node("Gather", ["boxes", f"dec_{k}"], [f"raw_{k}"], axis=2))
    nodes += [helper.make_node("Sigmoid", ["raw_xy"], ["xy"]),
              helper.make_node("Exp", ["raw_wh"], ["wh"]),
              helper.make_node("Sigmoid", ["raw_obj"], ["objectness"]),
              helper.make_node("Softmax", ["raw_cls"], ["classes"], axis=2)]
    f = TensorProto.FLOAT
    return helper.make_graph(
        nodes, "yolo_decode", [helper.make_tensor_value_info("grid", f, ["N", 125, 13, 13])],
        [helper.make_tensor_value_info(n, f, None) for n in ("xy", "wh", "objectness",
                                                             "classes")],
        initializer=[shape, *idx.values()])


def test_compose_a_detector_postprocessing_then_cut_it_off(zoo_model, tmp_path):
    path = str(zoo_model("tinyyolov2"))
    x = np.random.default_rng(4).standard_normal((1, 3, 416, 416)).astype(np.float32)
    grid = ort_outputs(path, {"input": x})["grid"]
    # the decode graph's input 'grid' clashes with the detector's output: io_map joins them
    full = kiln.compose(path, _yolo_decode_graph(), io_map=[("grid", "grid")])
    assert [v.name for v in full.graph.outputs] == ["xy", "wh", "objectness", "classes"]
    got = ort_outputs(checked(full, tmp_path, "full.onnx"), {"input": x})
    boxes = grid.reshape(1, 5, 25, 13, 13)
    np.testing.assert_allclose(got["xy"], 1 / (1 + np.exp(-boxes[:, :, :2])), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(got["wh"], np.exp(boxes[:, :, 2:4]), rtol=1e-3, atol=1e-5)
    e = np.exp(boxes[:, :, 5:] - boxes[:, :, 5:].max(axis=2, keepdims=True))
    np.testing.assert_allclose(got["classes"], e / e.sum(axis=2, keepdims=True), rtol=1e-4,
                               atol=1e-6)
    # cutting the post-processing off gives the raw detector back
    raw = kiln.cut(full, outputs=["grid"])
    assert not {"Sigmoid", "Exp", "Softmax"} & {n.op_type for n in raw.graph.nodes}
    assert "decode" not in {n.name for n in raw.graph.nodes}
    assert len(raw.graph.nodes) == len(kiln.load(path).graph.nodes)
    assert "dec_shape" not in raw.graph.initializers
    got = ort_outputs(checked(raw, tmp_path, "raw.onnx"), {"input": x})
    np.testing.assert_allclose(got["grid"], grid, rtol=1e-4, atol=1e-4)


def _second_model(opset: int) -> onnx.ModelProto:
    """y = Unsqueeze(Softmax(logits * 2), axis 1), at ``opset`` (Unsqueeze takes its axes
    as an attribute before 13); its inner names clash with the digits CNN's."""
    two = numpy_helper.from_array(np.array(2.0, np.float32), "/0/Conv_output_0")
    if opset < 13:
        unsq = helper.make_node("Unsqueeze", ["/2/Relu_output_0"], ["y"], axes=[1])
        inits = [two]
    else:
        unsq = helper.make_node("Unsqueeze", ["/2/Relu_output_0", "ax"], ["y"])
        inits = [two, numpy_helper.from_array(np.array([1], np.int64), "ax")]
    nodes = [helper.make_node("Mul", ["z", "/0/Conv_output_0"], ["m"], name="/0/Conv"),
             helper.make_node("Softmax", ["m"], ["/2/Relu_output_0"], axis=1), unsq]
    f = TensorProto.FLOAT
    return make_model(nodes, [helper.make_tensor_value_info("z", f, ["b", 10])],
                      [helper.make_tensor_value_info("y", f, ["b", 1, 10])], inits,
                      opset=opset)


@pytest.mark.parametrize("opset", [11, 17])
def test_compose_prefixes_clashing_names_and_merges_opsets(opset, tmp_path):
    x = np.random.default_rng(5).random((3, 1, 8, 8), dtype=np.float32)
    logits = ort_outputs(DIGITS, {"image": x})["logits"]
    m = kiln.compose(DIGITS, _second_model(opset), io_map=[("logits", "z")])
    assert m.opset == 17
    got = ort_outputs(checked(m, tmp_path), {"image": x})
    e = np.exp(2 * logits - (2 * logits).max(axis=1, keepdims=True))
    np.testing.assert_allclose(got["y"], (e / e.sum(axis=1, keepdims=True))[:, None],
                               rtol=1e-5, atol=1e-6)
    names = {v.name for n in m.graph.nodes for v in n.outputs}
    assert "second//2/Relu_output_0" in names and "/2/Relu_output_0" in names
    assert "second//0/Conv" in {n.name for n in m.graph.nodes}


@pytest.mark.parametrize("opset", [11, 17])
def test_compose_prepends_a_small_graph(opset, tmp_path):
    """Raw digits (0..16) -> Div 16 -> the CNN: the older-opset model comes first."""
    f = TensorProto.FLOAT
    pre = make_model([helper.make_node("Div", ["raw", "sixteen"], ["image"])],
                     [helper.make_tensor_value_info("raw", f, ["n", 1, 8, 8])],
                     [helper.make_tensor_value_info("image", f, ["n", 1, 8, 8])],
                     [numpy_helper.from_array(np.array(16, np.float32), "sixteen")],
                     opset=opset)
    m = kiln.compose(pre, DIGITS, io_map=[("image", "image")])
    assert [v.name for v in m.graph.inputs] == ["raw"] and m.opset == 17
    images, _ = digits_images(16)
    got = ort_outputs(checked(m, tmp_path), {"raw": images.astype(np.float32)})["logits"]
    ref = ort_outputs(DIGITS, {"image": (images / 16).astype(np.float32)})["logits"]
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_compose_errors_name_what_is_missing():
    with pytest.raises(kiln.KilnError, match="did you mean 'logits'"):
        kiln.compose(DIGITS, _second_model(17), io_map=[("logit", "z")])
    with pytest.raises(kiln.KilnError, match="input"):
        kiln.compose(DIGITS, _second_model(17), io_map=[("logits", "zz")])


def test_set_batch_fixed_then_symbolic(tmp_path):
    x = np.random.default_rng(6).random((4, 1, 8, 8), dtype=np.float32)
    ref = ort_outputs(DIGITS, {"image": x})["logits"]
    m = kiln.set_batch(DIGITS, 4)
    assert m.graph.inputs[0].shape == (4, 1, 8, 8) and m.graph.outputs[0].shape == (4, 10)
    np.testing.assert_allclose(ort_outputs(checked(m, tmp_path, "b4.onnx"),
                                           {"image": x})["logits"], ref, rtol=1e-5)
    with pytest.raises(Exception, match="(?i)dimension|shape"):
        ort_outputs(str(tmp_path / "b4.onnx"), {"image": x[:2]})
    m = kiln.set_batch(m, "N")
    assert str(m.graph.outputs[0].shape[0]) == "N"
    np.testing.assert_allclose(ort_outputs(checked(m, tmp_path, "bn.onnx"),
                                           {"image": x[:2]})["logits"], ref[:2], rtol=1e-5)


def test_rename_inputs_and_outputs(tmp_path):
    x = np.random.default_rng(7).random((2, 1, 8, 8), dtype=np.float32)
    m = kiln.rename(DIGITS, {"image": "pixels", "logits": "scores"})
    got = ort_outputs(checked(m, tmp_path), {"pixels": x})
    np.testing.assert_allclose(got["scores"], ort_outputs(DIGITS, {"image": x})["logits"],
                               rtol=1e-6)
    with pytest.raises(kiln.KilnError, match="did you mean 'image'"):
        kiln.rename(DIGITS, {"imag": "x"})


# -- embedded preprocessing ---------------------------------------------------------------

def _resize_linear(x: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bilinear resize of NCHW ``x`` with half-pixel centers (OpenCV's INTER_LINEAR)."""
    def axis(n_in, n_out):
        src = np.clip((np.arange(n_out) + 0.5) * n_in / n_out - 0.5, 0, n_in - 1)
        lo = np.floor(src).astype(int)
        return lo, np.minimum(lo + 1, n_in - 1), (src - lo).astype(np.float32)

    y0, y1, wy = axis(x.shape[2], h)
    x0, x1, wx = axis(x.shape[3], w)
    rows = x[:, :, y0] * (1 - wy)[:, None] + x[:, :, y1] * wy[:, None]
    return rows[..., x0] * (1 - wx) + rows[..., x1] * wx


def _resize_nearest(x: np.ndarray, h: int, w: int) -> np.ndarray:
    """Nearest resize of NCHW ``x``: source pixel floor(dst * in / out) (INTER_NEAREST)."""
    ys = np.minimum(np.arange(h) * x.shape[2] // h, x.shape[2] - 1)
    xs = np.minimum(np.arange(w) * x.shape[3] // w, x.shape[3] - 1)
    return x[:, :, ys][..., xs]


def _conv_first(pads: int) -> onnx.ModelProto:
    """x[N,3,10,12] -> Conv 3x3 (pads) -> Relu -> Conv 1x1: a Conv-first network."""
    rng = np.random.default_rng(8)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32),
                                     "w1"),
             numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), "b1"),
             numpy_helper.from_array(rng.standard_normal((4, 8, 1, 1)).astype(np.float32),
                                     "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1",
                              pads=[pads] * 4),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2")]
    f = TensorProto.FLOAT
    return make_model(nodes, [helper.make_tensor_value_info("x", f, ["N", 3, 10, 12])],
                      [helper.make_tensor_value_info("y", f, None)], inits)


MEAN, SCALE = np.array([123.7, 116.3, 103.5]), np.array([58.4, 57.1, 57.4])


def _numpy_steps(u: np.ndarray, layout: str, reverse: bool, mean=MEAN, scale=SCALE,
                 resize=None, size=None) -> np.ndarray:
    """What the preprocessing computes, done outside the model."""
    x = u.astype(np.float32)
    if layout == "NHWC":
        x = x.transpose(0, 3, 1, 2)
    if resize == "linear":
        x = _resize_linear(x, *size)
    elif resize == "nearest":
        x = _resize_nearest(x, *size)
    if reverse:
        x = x[:, ::-1]
    m = np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(scale, np.float32).reshape(1, -1, 1, 1)
    return np.ascontiguousarray((x - m) / s, dtype=np.float32)


def test_preprocessing_folds_into_an_unpadded_first_conv(tmp_path):
    proto = _conv_first(pads=0)
    before = [n.op_type for n in kiln.load(proto).graph.nodes]
    u = np.random.default_rng(9).integers(0, 256, (2, 3, 10, 12)).astype(np.float32)
    m = kiln.preprocess(proto, mean=MEAN, scale=SCALE, reverse_channels=True)
    assert [n.op_type for n in m.graph.nodes] == before  # no node added at all
    got = ort_outputs(checked(m, tmp_path, "f.onnx"), {"x": u})["y"]
    ref = ort_outputs(proto, {"x": _numpy_steps(u, "NCHW", True)})["y"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    # uint8 NHWC BGR: only the Cast and the layout Transpose remain
    u8 = np.random.default_rng(10).integers(0, 256, (2, 10, 12, 3), dtype=np.uint8)
    m = kiln.preprocess(proto, input_type="uint8", layout="NHWC", mean=MEAN, scale=SCALE,
                        reverse_channels=True)
    assert [n.op_type for n in m.graph.nodes] == ["Cast", "Transpose"] + before
    assert m.graph.inputs[0].type == kiln.ir.TensorType(kiln.DType.UINT8, (
        m.graph.inputs[0].shape[0], 10, 12, 3))
    got = ort_outputs(checked(m, tmp_path, "u8.onnx"), {"x": u8})["y"]
    ref = ort_outputs(proto, {"x": _numpy_steps(u8, "NHWC", True)})["y"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)


def test_preprocessing_before_a_padded_conv_is_exact_at_the_borders(tmp_path):
    """A zero-padded border of (x - mean) / scale is not the border of a Conv with the mean
    in its bias: the mean stays one Sub, scale and channel reversal still fold."""
    proto = _conv_first(pads=1)
    u = np.random.default_rng(11).integers(0, 256, (2, 3, 10, 12)).astype(np.float32)
    m = kiln.preprocess(proto, mean=MEAN, scale=SCALE, reverse_channels=True)
    assert [n.op_type for n in m.graph.nodes] == ["Sub", "Conv", "Relu", "Conv"]
    got = ort_outputs(checked(m, tmp_path), {"x": u})["y"]
    ref = ort_outputs(proto, {"x": _numpy_steps(u, "NCHW", True)})["y"]
    for border in (np.s_[..., 0, :], np.s_[..., -1, :], np.s_[..., :, 0], np.s_[..., :, -1]):
        np.testing.assert_allclose(got[border], ref[border], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    # what folding the mean into the bias anyway would give: wrong at the borders only
    naive = kiln.load(proto)
    conv = naive.graph.nodes[0]
    w, b = conv.inputs[1].const, conv.inputs[2].const
    w2 = (w / SCALE.reshape(1, 3, 1, 1))[:, ::-1].astype(np.float32)
    b2 = (b - np.einsum("ochw,c->o", w / SCALE.reshape(1, 3, 1, 1), MEAN)).astype(np.float32)
    conv.inputs[1].const, conv.inputs[2].const = np.ascontiguousarray(w2), b2
    bad = ort_outputs(to_proto_bytes(naive), {"x": u})["y"]
    np.testing.assert_allclose(bad[..., 1:-1, 1:-1], ref[..., 1:-1, 1:-1], rtol=1e-4,
                               atol=1e-4)
    assert np.abs(bad[..., 0, :] - ref[..., 0, :]).max() > 1e-2


def to_proto_bytes(model: kiln.Model) -> onnx.ModelProto:
    return kiln.onnxio.to_proto(model)


def test_digits_cnn_takes_uint8_pixels(tmp_path):
    """scikit-learn's digits are 0..16; the CNN was trained on pixels / 16: scale 16 folds
    into its first Conv (padded, no mean: nothing stays but the Cast)."""
    images, labels = digits_images(64)
    m = kiln.preprocess(DIGITS, input_type="uint8", scale=[16])
    assert [n.op_type for n in m.graph.nodes] == \
        ["Cast"] + [n.op_type for n in kiln.load(DIGITS).graph.nodes]
    got = ort_outputs(checked(m, tmp_path), {"image": images})["logits"]
    ref = ort_outputs(DIGITS, {"image": (images / 16).astype(np.float32)})["logits"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    assert (got.argmax(1) == labels).mean() > 0.9
    (mine,) = kiln.InferenceSession(m).run(None, {"image": images})
    np.testing.assert_allclose(mine, ref, rtol=1e-4, atol=1e-4)


def test_preprocessing_with_resize_on_zoo_models(zoo_model, tmp_path):
    rng = np.random.default_rng(12)
    # MobileNetV2: uint8 BGR NHWC camera frames of 180x200, nearest resize to 224x224
    path = str(zoo_model("mobilenetv2"))
    u = rng.integers(0, 256, (1, 180, 200, 3), dtype=np.uint8)
    m = kiln.preprocess(path, input_type="uint8", layout="NHWC", mean=MEAN, scale=SCALE,
                        reverse_channels=True, resize="nearest", size=(180, 200))
    added = [n.op_type for n in m.graph.nodes][:6]
    assert added == ["Cast", "Transpose", "Shape", "Concat", "Resize", "Sub"]
    assert len(m.graph.nodes) == len(kiln.load(path).graph.nodes) + 6
    got = ort_outputs(checked(m, tmp_path, "mb.onnx"), {"input": u})["logits"]
    x = _numpy_steps(u, "NHWC", True, resize="nearest", size=(224, 224))
    ref = ort_outputs(path, {"input": x})["logits"]
    np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3)
    unfolded = kiln.preprocess(path, input_type="uint8", layout="NHWC", mean=MEAN,
                               scale=SCALE, reverse_channels=True, resize="nearest",
                               size=(180, 200), fold=False)
    got2 = ort_outputs(checked(unfolded, tmp_path, "mb2.onnx"), {"input": u})["logits"]
    np.testing.assert_allclose(got2, ref, rtol=1e-3, atol=1e-3)
    # FER+: one grey channel, uint8 NCHW of any size, linear resize to 64x64
    path = str(zoo_model("emotion_ferplus"))
    m = kiln.preprocess(path, input_type="uint8", mean=[128], scale=[64], resize="linear")
    assert [str(d) for d in m.graph.inputs[0].shape[2:]] == ["input_height", "input_width"]
    for hw in ((48, 48), (100, 80)):
        u = rng.integers(0, 256, (2, 1, *hw), dtype=np.uint8)
        got = ort_outputs(checked(m, tmp_path, "fer.onnx"), {"input": u})["logits"]
        x = _numpy_steps(u, "NCHW", False, [128], [64], "linear", (64, 64))
        ref = ort_outputs(path, {"input": x})["logits"]
        np.testing.assert_allclose(got, ref, rtol=1e-3, atol=1e-3)
    (mine,) = kiln.InferenceSession(m).run(None, {"input": u})  # Kiln runs it the same
    np.testing.assert_allclose(mine, got, rtol=1e-4, atol=1e-4)


def test_preprocessing_errors():
    with pytest.raises(kiln.KilnError, match="2 mean values .* 3 channels"):
        kiln.preprocess(_conv_first(0), mean=[1, 2])
    with pytest.raises(kiln.KilnError, match="divided by zero"):
        kiln.preprocess(_conv_first(0), scale=[1, 0, 1])
    with pytest.raises(kiln.KilnError, match="NCHW or NHWC"):
        kiln.preprocess(_conv_first(0), layout="CHW")
    with pytest.raises(kiln.KilnError, match="did you mean 'image'"):
        kiln.preprocess(DIGITS, "imgae", scale=[16])


# -- freezing: training-mode layers become their inference forms -------------------------

def _training_model(bn_outputs: int = 1, mask_out: bool = False) -> onnx.ModelProto:
    """x -> BatchNormalization(training_mode=1) -> Dropout(ratio 0.5, training_mode=True)."""
    rng = np.random.default_rng(13)
    c = 4
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in (
        ("scale", rng.random(c) + 0.5), ("bias", rng.standard_normal(c)),
        ("mean", rng.standard_normal(c)), ("var", rng.random(c) + 0.5))]
    inits += [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
              numpy_helper.from_array(np.array(True), "training")]
    bn_outs = ["b", "run_mean", "run_var"][:bn_outputs]
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"],
                              bn_outs, training_mode=1, epsilon=1e-3),
             helper.make_node("Dropout", ["b", "ratio", "training"],
                              ["y", "mask"] if mask_out else ["y"])]
    f = TensorProto.FLOAT
    outs = [helper.make_tensor_value_info("y", f, None)]
    if bn_outputs > 1:
        outs.append(helper.make_tensor_value_info("run_mean", f, None))
    if mask_out:
        outs.append(helper.make_tensor_value_info("mask", TensorProto.BOOL, None))
    return make_model(nodes, [helper.make_tensor_value_info("x", f, [2, c, 3, 3])], outs,
                      inits, opset=15)


def test_freeze_turns_training_mode_off(tmp_path):
    from kiln.passes import Freeze

    proto = _training_model(bn_outputs=3)  # running statistics computed but not read...
    proto.graph.output.pop()               # ...once they are not an output
    model, record = Freeze()(kiln.load(proto))
    assert record.changes["BatchNormalization training mode turned off"] == 1
    assert record.changes["Dropout training mode turned off"] == 1
    assert [n.op_type for n in model.graph.nodes] == ["BatchNormalization"]
    bn = model.graph.nodes[0]
    assert bn.attrs.get("training_mode", 0) == 0 and len(bn.outputs) == 1
    x = np.random.default_rng(14).standard_normal((2, 4, 3, 3)).astype(np.float32)
    init = {t.name: numpy_helper.to_array(t) for t in proto.graph.initializer}
    r = lambda a: a.reshape(1, -1, 1, 1)  # noqa: E731
    want = (x - r(init["mean"])) / np.sqrt(r(init["var"]) + 1e-3) * r(init["scale"]) + \
        r(init["bias"])
    got = ort_outputs(checked(model, tmp_path), {"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    (got,) = kiln.InferenceSession(proto).run(None, {"x": x})  # optimize freezes too
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_freeze_keeps_training_mode_whose_extra_outputs_are_read():
    from kiln.passes import Freeze

    model, record = Freeze()(kiln.load(_training_model(bn_outputs=3, mask_out=True)))
    assert [n.op_type for n in model.graph.nodes] == ["BatchNormalization", "Dropout"]
    assert model.graph.nodes[0].attrs["training_mode"] == 1
    assert record.declined["training mode: its running statistics output is read"] == 1
    assert record.declined["training mode: its mask output is read"] == 1
