"""ML-domain bugs found with onnxruntime's own models and tests (issue 39 item 8), each
checked against onnxruntime running the same model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as oh

import kiln

ort = pytest.importorskip("onnxruntime")


def _both(model: bytes, feed: dict) -> tuple[list, list]:
    return (ort.InferenceSession(model).run(None, feed),
            kiln.InferenceSession(model).run(None, feed))


def test_linear_classifier_on_onnxruntimes_iris_example():
    # Its coefficients hold 4 features per class and it is fed 2: onnxruntime reads the
    # first classes x features coefficients. Kiln failed with a broadcast error.
    from onnxruntime import datasets
    path = datasets.get_example("logreg_iris.onnx")
    x = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
    want = ort.InferenceSession(path).run(None, {"float_input": x})
    got = kiln.InferenceSession(path).run(None, {"float_input": x})
    np.testing.assert_array_equal(got[0], want[0])
    for g, w in zip(got[1], want[1]):
        assert g.keys() == w.keys()
        np.testing.assert_allclose([g[k] for k in g], [w[k] for k in w], rtol=1e-5, atol=1e-7)


def _label_encoder_v1(inp, out, **attrs) -> bytes:
    node = oh.make_node("LabelEncoder", ["X"], ["Y"], domain="ai.onnx.ml", **attrs)
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("X", inp, [None])],
                          [oh.make_tensor_value_info("Y", out, [None])])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 11),
                                               oh.make_opsetid("ai.onnx.ml", 1)],
                         ir_version=8).SerializeToString()


@pytest.mark.parametrize("x", [np.array(["b", "c", "z", "a"]),
                               np.array(["b", "c", "z", "a"], dtype=object)])
def test_label_encoder_v1_strings_to_int64(x):
    # A NumPy str array was taken for integers (and failed, or gave the default).
    model = _label_encoder_v1(TensorProto.STRING, TensorProto.INT64,
                              classes_strings=["a", "b", "c"], default_int64=-7)
    want, got = _both(model, {"X": x})
    np.testing.assert_array_equal(got[0], want[0])


def _tree(modes, values, true_ids, false_ids, leaf_nodes, weights, base, transform):
    n = len(modes)
    node = oh.make_node(
        "TreeEnsembleClassifier", ["X"], ["label", "probs"], domain="ai.onnx.ml",
        nodes_treeids=[0] * n, nodes_nodeids=list(range(n)), nodes_featureids=[0] * n,
        nodes_values=values, nodes_modes=modes, nodes_truenodeids=true_ids,
        nodes_falsenodeids=false_ids, class_treeids=[0] * len(weights),
        class_nodeids=leaf_nodes, class_ids=[0] * len(weights), class_weights=weights,
        classlabels_int64s=[0, 1], post_transform=transform,
        **({} if base is None else {"base_values": base}))
    graph = oh.make_graph([node], "t", [oh.make_tensor_value_info("X", TensorProto.FLOAT,
                                                                  [None, 3])],
                          [oh.make_tensor_value_info("label", TensorProto.INT64, [None]),
                           oh.make_tensor_value_info("probs", TensorProto.FLOAT, [None, 2])])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 15),
                                               oh.make_opsetid("ai.onnx.ml", 3)]
                         ).SerializeToString()


SPLIT = (["BRANCH_LT", "LEAF", "LEAF"], [0.5, 0.0, 0.0], [1, 0, 0], [2, 0, 0], [1, 2])
LEAF = (["LEAF"], [0.0], [0], [0], [0])


@pytest.mark.parametrize("transform", ["LOGISTIC", "NONE", "SOFTMAX", "SOFTMAX_ZERO"])
@pytest.mark.parametrize("tree,weights,base", [
    (LEAF, [0.0], [-0.405]),          # onnxruntime issue 27533: LOGISTIC was skipped
    (LEAF, [0.7], None), (LEAF, [-0.405], [0.0]),
    (SPLIT, [0.3, 0.2], [-0.405]), (SPLIT, [0.3, 0.8], None), (SPLIT, [0.3, -0.3], [0.1])])
def test_binary_tree_classifier_scores(tree, weights, base, transform):
    model = _tree(*tree[:4], tree[4], weights, base, transform)
    x = np.array([[0.1, 0, 0], [0.9, 0, 0]], np.float32)
    want, got = _both(model, {"X": x})
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_models_still_parse():
    assert onnx.load_from_string(_tree(*LEAF[:4], LEAF[4], [0.0], None, "NONE"))


def test_label_encoder_v1_keeps_trailing_nuls():
    # ML.NET's encoders have keys like "A\0A\0"; a conversion through NumPy's str dtype
    # dropped the trailing NUL and every key missed.
    model = _label_encoder_v1(TensorProto.STRING, TensorProto.INT64,
                              classes_strings=["A\0A\0", "B\0", "B"], default_int64=-1)
    x = np.array(["A\0A\0", "B\0", "B", "A\0A"], dtype=object)
    want, got = _both(model, {"X": x})
    np.testing.assert_array_equal(got[0], want[0])
