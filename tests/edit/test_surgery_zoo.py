"""Surgery on every zoo model, against onnxruntime on the original: a cut through the
middle (the original's intermediates exposed as outputs), last_layers=-1, set_batch and an
ArgMax tail (full onnx.checker check), and for image models uint8/NHWC/BGR preprocessing.
Slow: the fast tests (test_surgery.py) cover the same functions on three zoo models."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

zoo = pytest.importorskip("kiln.zoo")

from test_surgery import ort_outputs  # noqa: E402

import kiln  # noqa: E402
from kiln.onnxio import to_proto  # noqa: E402
from kiln.zoo.registry import REGISTRY, make_inputs  # noqa: E402


def _valid(model: kiln.Model) -> onnx.ModelProto:
    proto = to_proto(model)
    onnx.checker.check_model(proto, full_check=True)
    return proto


@pytest.mark.slow
@pytest.mark.parametrize("name", list(REGISTRY))
def test_surgery_on_zoo_model(name, zoo_model):
    path = str(zoo_model(name))
    model = kiln.load(path)
    entry = REGISTRY[name]
    feeds = make_inputs(entry, batch=2, seq=8)
    layer_list = [n for n in model.graph.nodes if n.op_type != "Constant"]
    a = layer_list[len(layer_list) // 3].outputs[0].name
    b = layer_list[2 * len(layer_list) // 3].outputs[0].name
    ref = ort_outputs(path, feeds, [a, b])
    try:  # a residual network needs its input beside a: say so, then give it
        part = kiln.cut(model, inputs=[a], outputs=[b])
    except kiln.KilnError as e:
        assert "cannot be computed from the inputs" in str(e)
        part = kiln.cut(model, inputs=[a] + [v.name for v in model.graph.inputs], outputs=[b])
    got = ort_outputs(_valid(part), {v.name: ref.get(v.name, feeds.get(v.name))
                                     for v in part.graph.inputs})
    np.testing.assert_allclose(got[b], ref[b], rtol=1e-4, atol=1e-4)

    _valid(kiln.cut(model, last_layers=-1))
    _valid(kiln.add_tail(model, "ArgMax", model.graph.outputs[0].name))
    feeds3 = make_inputs(entry, batch=3, seq=8)
    got = ort_outputs(_valid(kiln.set_batch(model, 3)), feeds3)
    for k, want in ort_outputs(path, feeds3).items():
        np.testing.assert_allclose(got[k], want, rtol=1e-4, atol=1e-4)

    x = model.graph.inputs[0]
    if x.shape is None or len(x.shape) != 4:
        return
    c = x.shape[1]
    pre = kiln.preprocess(model, input_type="uint8", layout="NHWC", mean=[120.0] * c,
                          scale=[60.0] * c, reverse_channels=c == 3)
    u = np.random.default_rng(0).integers(0, 256, (1, *x.shape[2:], c), dtype=np.uint8)
    img = u.astype(np.float32).transpose(0, 3, 1, 2)[:, ::-1 if c == 3 else 1]
    img = np.ascontiguousarray((img - 120) / 60, dtype=np.float32)
    got = ort_outputs(_valid(pre), {x.name: u})
    for k, want in ort_outputs(path, {x.name: img}).items():
        np.testing.assert_allclose(got[k], want, rtol=1e-3, atol=1e-3 * np.abs(want).max())
