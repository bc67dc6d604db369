"""Errors a user can cause raise Kiln's own exception types with actionable messages."""

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from conftest import make_model


def test_malformed_bytes():
    with pytest.raises(kiln.ModelLoadError, match="not a valid ONNX model"):
        kiln.load(b"\x08\x07this is not protobuf\xff\xff\xff")


def test_truncated_file(tmp_path, mlp_model):
    data = mlp_model.SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(kiln.ModelLoadError):
        kiln.load(path)


def test_missing_file(tmp_path):
    with pytest.raises(kiln.ModelLoadError, match="no model file"):
        kiln.load(tmp_path / "nope.onnx")


def test_dangling_reference():
    m = make_model(
        [helper.make_node("Relu", ["ghost"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
    )
    with pytest.raises(kiln.ModelLoadError, match="ghost"):
        kiln.load(m)


def _external_model(location: str) -> onnx.ModelProto:
    w = helper.make_tensor("w", TensorProto.FLOAT, [4], [1, 2, 3, 4])
    w.data_location = TensorProto.EXTERNAL
    w.ClearField("float_data")
    for k, v in (("location", location), ("offset", "0"), ("length", "16")):
        w.external_data.add(key=k, value=v)
    return make_model(
        [helper.make_node("Add", ["x", "w"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
        [w],
    )


@pytest.mark.parametrize("location", ["../secret.bin", "/etc/passwd", "a/../../secret.bin"])
def test_external_data_outside_folder_refused(tmp_path, location):
    (tmp_path / "secret.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    path = model_dir / "m.onnx"
    path.write_bytes(_external_model(location).SerializeToString())
    with pytest.raises(kiln.ExternalDataError, match="refused|absolute"):
        kiln.load(path)


def test_external_data_symlink_escape_refused(tmp_path):
    (tmp_path / "secret.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    os.symlink(tmp_path / "secret.bin", model_dir / "w.bin")
    path = model_dir / "m.onnx"
    path.write_bytes(_external_model("w.bin").SerializeToString())
    with pytest.raises(kiln.ExternalDataError, match="outside"):
        kiln.load(path)


def test_external_data_truncated(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"\0" * 8)
    path = tmp_path / "m.onnx"
    path.write_bytes(_external_model("w.bin").SerializeToString())
    with pytest.raises(kiln.ExternalDataError, match="beyond the end"):
        kiln.load(path)


def test_external_data_from_bytes_needs_base_dir(tmp_path):
    with pytest.raises(kiln.ExternalDataError, match="base_dir"):
        kiln.load(_external_model("w.bin").SerializeToString())


def test_unsupported_ops_all_named_at_load():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),
        helper.make_node("FancyOp", ["a"], ["b"], domain="com.example"),
        helper.make_node("OtherOp", ["b"], ["y"], domain="com.example"),
    ]
    m = make_model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(kiln.UnsupportedOpError) as e:
        kiln.InferenceSession(m)
    assert {op for _, op, _ in e.value.ops} == {"FancyOp", "OtherOp"}
    assert "FancyOp" in str(e.value) and "OtherOp" in str(e.value)
    assert "register_op" in str(e.value)


@pytest.fixture
def session(mlp_model):
    return kiln.InferenceSession(mlp_model)


def test_unknown_input_name(session):
    with pytest.raises(kiln.InputError, match="unknown input name.*'x'"):
        session.run(None, {"x": np.ones((1, 4), np.float32), "z": np.ones(1)})


def test_missing_input(session):
    with pytest.raises(kiln.InputError, match="missing input"):
        session.run(None, {})


def test_wrong_dtype(session):
    with pytest.raises(kiln.InputError, match=r"tensor\(float\).*astype"):
        session.run(None, {"x": np.ones((1, 4), np.float64)})


def test_wrong_rank(session):
    with pytest.raises(kiln.InputError, match="rank 2"):
        session.run(None, {"x": np.ones((4,), np.float32)})


def test_fixed_dim_mismatch(session):
    with pytest.raises(kiln.InputError, match="dim 1 is fixed to 4"):
        session.run(None, {"x": np.ones((2, 5), np.float32)})


def test_unknown_output_name(session):
    with pytest.raises(kiln.InputError, match="unknown output name"):
        session.run(["nope"], {"x": np.ones((2, 4), np.float32)})


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_feeds_that_passed_before_do_not_let_bad_ones_through(mlp_model, backend):
    """A session skips the checks for a feed whose dtypes and shapes passed before: every
    other feed is still checked, and a big-endian feed (converted, as onnxruntime does)
    gives onnxruntime's answer however often it comes."""
    ort = pytest.importorskip("onnxruntime")
    if backend == "torch":
        pytest.importorskip("torch")
    sess = kiln.InferenceSession(mlp_model, backend=backend)
    x = np.random.default_rng(3).standard_normal((2, 4)).astype(np.float32)
    want = ort.InferenceSession(
        mlp_model.SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, {"x": x})[0]
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)
    with pytest.raises(kiln.InputError, match=r"tensor\(float\).*astype"):
        sess.run(None, {"x": x.astype(np.float64)})
    with pytest.raises(kiln.InputError, match="dim 1 is fixed to 4"):
        sess.run(None, {"x": np.ones((2, 5), np.float32)})
    with pytest.raises(kiln.InputError, match="unknown input name"):
        sess.run(None, {"x": x, "z": x})
    big = x.astype(">f4")
    for _ in range(3):
        np.testing.assert_allclose(sess.run(None, {"x": big})[0], want, rtol=1e-5, atol=1e-6)
