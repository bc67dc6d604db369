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
