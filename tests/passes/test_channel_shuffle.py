"""ShuffleNet's channel shuffle (Reshape -> Transpose -> Reshape) fused into Kiln's
ChannelShuffle. Oracles: PyTorch's ``nn.ChannelShuffle`` for the op, onnxruntime on the
original files for the fused models and for the saved ones (whose ChannelShuffle nodes
carry their three ops as a function body)."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import ort_run
from kiln.onnxio import to_proto


def _shuffle_model(shape: list[int], group: int, perm: list[int] | None = None,
                   first_dim: int = 0) -> onnx.ModelProto:
    c, rest = shape[1], shape[2:]
    perm = perm or [0, 2, 1] + list(range(3, len(shape) + 1))
    inits = [numpy_helper.from_array(np.array(s, np.int64), name) for name, s in (
        ("split", [first_dim, group, c // group] + rest), ("joined", [first_dim, c] + rest))]
    nodes = [helper.make_node("Reshape", ["x", "split"], ["r"]),
             helper.make_node("Transpose", ["r"], ["t"], perm=perm),
             helper.make_node("Reshape", ["t", "joined"], ["y"]),
             helper.make_node("Relu", ["y"], ["out"])]
    graph = helper.make_graph(
        nodes, "shuffle", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("shape, group", [([2, 12, 5, 5], 3), ([1, 8, 7], 2),
                                          ([3, 6, 2, 3, 4], 2)])
def test_fused_shuffle_is_pytorchs(shape, group):
    torch = pytest.importorskip("torch")
    proto = _shuffle_model(shape, group, first_dim=-1)
    x = np.random.default_rng(0).normal(0, 1, shape).astype(np.float32)
    want = torch.relu(torch.nn.ChannelShuffle(group)(torch.from_numpy(x))).numpy()
    for backend in ("numpy", "torch"):
        m = kiln.optimize(proto, backend=backend)
        assert [n.op_type for n in m.graph.nodes] == ["ChannelShuffle", "Relu"], backend
        (got,) = kiln.InferenceSession(proto, backend=backend).run(None, {"x": x})
        np.testing.assert_array_equal(got, want, err_msg=backend)
    # saved, the fused node's body (the three ops again) runs in onnxruntime
    np.testing.assert_array_equal(ort_run(to_proto(m), {"x": x})[0], want)


def test_other_permutations_stay():
    """Swapping the spatial axes too is not a channel shuffle: nothing is fused."""
    proto = _shuffle_model([2, 12, 5, 5], 3, perm=[0, 2, 1, 4, 3])
    m = kiln.optimize(proto)
    assert "ChannelShuffle" not in {n.op_type for n in m.graph.nodes}
    x = np.random.default_rng(1).normal(0, 1, (2, 12, 5, 5)).astype(np.float32)
    (got,) = kiln.InferenceSession(proto).run(None, {"x": x})
    np.testing.assert_array_equal(got, ort_run(proto, {"x": x})[0])


@pytest.mark.parametrize("name", ["shufflenetv2", "shufflenetv2_dynamo"])
def test_shufflenet_exports_fuse(zoo_model, name):
    """Both exporters' ShuffleNetV2 (torchscript: shape entries 0; dynamo: -1 with
    allowzero=1) lose their 16 shuffles' 48 nodes to 16 ChannelShuffle ops."""
    from kiln.zoo.registry import make_inputs

    path = str(zoo_model(name))
    feed = make_inputs(name, batch=2, seed=1)
    (ref,) = ort_run(path, feed)
    for backend in ("numpy", "torch"):
        m = kiln.optimize(path, backend=backend)
        counts = Counter(n.op_type for n in m.graph.nodes)
        assert counts["ChannelShuffle"] == 16 and counts["Transpose"] == 0, counts
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            (got,) = kiln.InferenceSession(path, backend=backend).run(None, feed)
        np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4, err_msg=backend)
