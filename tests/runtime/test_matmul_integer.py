"""MatMulInteger with a constant B (what onnxruntime's quantize_dynamic writes) on both
backends against exact integer arithmetic (NumPy int64) and onnxruntime: the torch kernel
sums K in float32 chunks, so the extreme values and a K long enough to need several
chunks are the test. onnxruntime is exact for int8 x int8; for uint8 x int8 its AVX2
kernel (no VNNI) saturates pairs of products in int16 (255 * -128 * 2), so there it is
checked on a B within -64..63 only, as its quantizer's reduce_range writes."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import ort_run


def _model(b: np.ndarray, a_type: int, b_zero_point: np.ndarray | None, with_a_zp: bool):
    inits = [numpy_helper.from_array(b, "b")]
    names = ["a", "b"]
    inputs = [helper.make_tensor_value_info("a", a_type, ["m", b.shape[0]])]
    if with_a_zp or b_zero_point is not None:
        names.append("a_zp" if with_a_zp else "")
        if with_a_zp:
            inputs.append(helper.make_tensor_value_info("a_zp", a_type, []))
    if b_zero_point is not None:
        names.append("b_zp")
        inits.append(numpy_helper.from_array(b_zero_point, "b_zp"))
    g = helper.make_graph(
        [helper.make_node("MatMulInteger", names, ["y"])], "g", inputs,
        [helper.make_tensor_value_info("y", TensorProto.INT32, ["m", b.shape[1]])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("k", [7, 256, 1500])
@pytest.mark.parametrize("a_dtype", [np.uint8, np.int8])
@pytest.mark.parametrize("b_zp", ["none", "scalar", "per_column"])
def test_exact_like_onnxruntime(k, a_dtype, b_zp):
    rng = np.random.default_rng(k)
    info = np.iinfo(a_dtype)
    b = rng.integers(-128, 128, (k, 9)).astype(np.int8)
    b[:, 0] = -128  # the extremes: the largest sums the chunking has to keep exact
    zp = {"none": None, "scalar": np.array(3, np.int8),
          "per_column": rng.integers(-5, 5, 9).astype(np.int8)}[b_zp]
    a_type = TensorProto.UINT8 if a_dtype == np.uint8 else TensorProto.INT8
    model = _model(b, a_type, zp, with_a_zp=True)
    a = rng.integers(info.min, info.max + 1, (5, k)).astype(a_dtype)
    a[0] = info.max
    feeds = {"a": a, "a_zp": np.array(info.min + 1, a_dtype)}
    az = feeds["a_zp"].astype(np.int64)
    want = (a.astype(np.int64) - az) @ (b.astype(np.int64) - (0 if zp is None else zp))
    if a_dtype == np.int8:
        np.testing.assert_array_equal(ort_run(model, feeds)[0], want)
    else:
        small = (b // 2).astype(np.int8)
        narrow = _model(small, a_type, None if zp is None else zp // 2, with_a_zp=True)
        (got,) = kiln.InferenceSession(narrow.SerializeToString(), backend="torch").run(
            None, feeds)
        np.testing.assert_array_equal(got, ort_run(narrow, feeds)[0])
    for backend in ("numpy", "torch"):
        (got,) = kiln.InferenceSession(model.SerializeToString(), backend=backend).run(
            None, feeds)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
