"""What a session says when it is set up or fed wrongly, checked against onnxruntime and
NumPy where they give an answer: options that do not exist, devices a backend lacks,
inputs that disagree on a dim they share, and torch slicing with ONNX's extreme bounds."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.errors import InputError, KilnError, OptionError


def _two_inputs_sharing_seq() -> onnx.ModelProto:
    ids = helper.make_tensor_value_info("input_ids", TensorProto.FLOAT, ["batch", "seq"])
    mask = helper.make_tensor_value_info("attention_mask", TensorProto.FLOAT, ["batch", "seq"])
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq"])
    graph = helper.make_graph([helper.make_node("Mul", ["input_ids", "attention_mask"], ["y"])],
                              "shared", [ids, mask], [out])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_inputs_that_disagree_on_a_shared_dim_are_named_before_any_layer_runs(backend):
    proto = _two_inputs_sharing_seq()
    sess = kiln.InferenceSession(proto, backend=backend)
    ids = np.ones((1, 16), np.float32)
    with pytest.raises(InputError, match=r"'seq'.*'input_ids' dim 1 is 16.*'attention_mask' "
                                         r"dim 1 is 10"):
        sess.run(None, {"input_ids": ids, "attention_mask": np.ones((1, 10), np.float32)})
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail):  # inside its Mul
        ort.InferenceSession(proto.SerializeToString()).run(
            None, {"input_ids": ids, "attention_mask": np.ones((1, 10), np.float32)})
    mask = np.arange(16, dtype=np.float32).reshape(1, 16)
    ref = ort.InferenceSession(proto.SerializeToString()).run(
        None, {"input_ids": ids * 2, "attention_mask": mask})[0]
    got = sess.run(None, {"input_ids": ids * 2, "attention_mask": mask})[0]
    np.testing.assert_array_equal(got, ref)


def test_a_device_the_numpy_backend_lacks_points_to_the_torch_backend():
    proto = _two_inputs_sharing_seq()
    with pytest.raises(OptionError, match="backend='torch'"):
        kiln.InferenceSession(proto, backend="numpy", device="cuda")
    kiln.InferenceSession(proto, backend="numpy", device="cpu")  # its only device is fine
    with pytest.raises(OptionError, match="precision is the torch backend's"):
        kiln.InferenceSession(proto, backend="numpy", precision="bf16")


def test_an_unknown_backend_or_option_is_a_kiln_error():
    proto = _two_inputs_sharing_seq()
    with pytest.raises(KilnError, match=r"unknown backend 'cuda'.*backend='torch', device='cuda'"):
        kiln.InferenceSession(proto, backend="cuda")
    with pytest.raises(OptionError, match="no option devcie"):
        kiln.InferenceSession(proto, backend="torch", devcie="cuda")
    with pytest.raises(OptionError, match="precision"):
        kiln.InferenceSession(proto, backend="torch", precision="int3")


def test_torch_slice_with_int64_min_start_matches_onnxruntime_without_a_warning():
    lo, hi = np.iinfo(np.int64).min, np.iinfo(np.int64).max
    inits = [helper.make_tensor(n, TensorProto.INT64, [2], v) for n, v in
             (("starts", [lo, 1]), ("ends", [3, hi]), ("axes", [0, 1]))]
    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "starts", "ends", "axes"], ["y"])], "s",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    x = np.arange(20, dtype=np.float32).reshape(5, 4)
    ref = ort.InferenceSession(proto.SerializeToString()).run(None, {"x": x})[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = kiln.InferenceSession(proto, backend="torch", optimize=False).run(
            None, {"x": x})[0]
    np.testing.assert_array_equal(got, ref)
