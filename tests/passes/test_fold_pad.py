"""An explicit Pad before a Conv or pool folds into it (issue 42, item 3), results checked
against onnxruntime; a MobileNetV2 written with explicit ZeroPad2d layers optimizes to the
same fused layers (ReLU6 Clips included) whether PyTorch's TorchScript exporter wrote it
(18 Pad nodes, their amounts computed by a constant subgraph) or its dynamo exporter (which
folds the padding into the convolutions itself)."""

from __future__ import annotations

import collections
import importlib.util

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln

BACKENDS = ["numpy", pytest.param("torch", marks=pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch not installed"))]


def _model(pad_inputs: dict, layer: str, layer_attrs: dict, opset: int = 17) -> bytes:
    rng = np.random.default_rng(0)
    inits, pad_in = [], ["x"]
    for name in ("pads", "value", "axes"):
        if name in pad_inputs:
            a = np.asarray(pad_inputs[name])
            dt = TensorProto.FLOAT if a.dtype.kind == "f" else TensorProto.INT64
            inits.append(helper.make_tensor(name, dt, a.shape, a.ravel().tolist()))
            pad_in.append(name)
        elif name != "axes":
            pad_in.append("")
    while pad_in[-1] == "":
        pad_in.pop()
    nodes = [helper.make_node("Pad", pad_in, ["p"], mode=pad_inputs.get("mode", "constant"))]
    if layer == "Conv":
        w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
        inits.append(helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel()))
        nodes.append(helper.make_node("Conv", ["p", "w"], ["c"], **layer_attrs))
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["y"]))
        inits += [helper.make_tensor("lo", TensorProto.FLOAT, [], [0.0]),
                  helper.make_tensor("hi", TensorProto.FLOAT, [], [6.0])]
    else:
        nodes.append(helper.make_node(layer, ["p"], ["y"], kernel_shape=[3, 3], **layer_attrs))
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 9, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]
                             ).SerializeToString()


CASES = [  # (Pad inputs, layer, its attrs, folds)
    ({"pads": [0, 0, 1, 2, 0, 0, 2, 1]}, "Conv", {}, True),
    ({"pads": [0, 0, 1, 1, 0, 0, 1, 1]}, "Conv", {"pads": [1, 0, 0, 1], "strides": [2, 2]},
     True),
    ({"pads": [1, 1, 2, 2], "axes": [2, 3]}, "Conv", {}, True),
    ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "value": np.float32(1.0)}, "Conv", {}, False),
    ({"pads": [0, 1, 1, 1, 0, 0, 1, 1]}, "AveragePool", {}, False),        # channels
    ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "mode": "reflect"}, "Conv", {}, False),
    ({"pads": [0, 0, 1, 2, 0, 0, 0, 1]}, "AveragePool", {}, True),
    ({"pads": [0, 0, 1, 1, 0, 0, 1, 1]}, "AveragePool", {"pads": [1, 1, 1, 1]}, False),
    ({"pads": [0, 0, 1, 1, 0, 0, 1, 1], "value": np.float32(-np.inf)}, "MaxPool", {}, True),
    ({"pads": [0, 0, 1, 1, 0, 0, 1, 1]}, "MaxPool", {}, False),            # zeros can win
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[1]}-{sorted(c[0])}-{c[3]}")
def test_pad_folds_where_it_means_the_same(backend, case):
    pad_inputs, layer, attrs, folds = case
    opset = 18 if "axes" in pad_inputs else 17
    blob = _model(pad_inputs, layer, attrs, opset)
    x = np.random.default_rng(1).standard_normal((2, 3, 9, 8)).astype(np.float32)
    want = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = kiln.InferenceSession(blob, backend=backend).run(None, {"x": x})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    ops = collections.Counter(n.op_type for n in kiln.optimize(blob).graph.nodes)
    assert ("Pad" not in ops) == folds, ops


def _mobilenet_with_pads():
    """The zoo's MobileNetV2 with every padded convolution written as ZeroPad2d + Conv2d,
    as exports with explicit Pad layers have it."""
    import torch
    from torch import nn

    from kiln.zoo.vision import mobilenetv2

    torch.manual_seed(0)
    m = mobilenetv2().eval()
    for parent in list(m.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Conv2d) and child.padding != (0, 0):
                ph, pw = child.padding
                child.padding = (0, 0)
                setattr(parent, name, nn.Sequential(nn.ZeroPad2d((pw, pw, ph, ph)), child))
    return m


@pytest.mark.slow
def test_mobilenetv2_with_explicit_pads_fuses_alike_from_both_exporters(tmp_path):
    torch = pytest.importorskip("torch")
    m = _mobilenet_with_pads()
    x = torch.randn(1, 3, 224, 224)
    hists, feed = [], {"x": x.numpy()}
    for dynamo in (False, True):
        path = str(tmp_path / f"m{int(dynamo)}.onnx")
        torch.onnx.export(m, (x,), path, input_names=["x"], dynamo=dynamo,
                          **({} if dynamo else {"opset_version": 17}))
        raw = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        pads = sum(n.op_type == "Pad" for n in kiln.load(path).graph.nodes)
        assert pads >= 17 or dynamo  # the dynamo exporter folds ZeroPad2d into Conv itself
        want = raw.run(None, {raw.get_inputs()[0].name: feed["x"]})[0]
        for backend in ("numpy", "torch"):
            sess = kiln.InferenceSession(path, backend=backend)
            got = sess.run(None, {sess.get_inputs()[0].name: feed["x"]})[0]
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        opt = kiln.optimize(path)
        hists.append(collections.Counter(n.op_type for n in opt.graph.nodes
                                         if n.op_type in ("Pad", "Conv", "FusedConv", "Clip")))
    assert hists[0] == hists[1] and "Pad" not in hists[0] and "Clip" not in hists[0], hists
