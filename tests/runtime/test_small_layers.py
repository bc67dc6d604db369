"""Small layers on their fast paths (issue 42, item 2) give onnxruntime's results: 1-D
convolutions with wide kernels or long strides (STFT written as a Conv), tiny convolutions,
and the trained models those paths serve, on both backends."""

from __future__ import annotations

import importlib.util

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
import trained_models as tm

BACKENDS = [
    "numpy",
    pytest.param(
        "torch",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("torch") is None, reason="torch not installed"
        ),
    ),
]


def _conv_model(x_shape, w, b, **attrs) -> bytes:
    inits = [helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel())]
    ins = ["x", "w"]
    if b is not None:
        inits.append(helper.make_tensor("b", TensorProto.FLOAT, b.shape, b.ravel()))
        ins.append("b")
    g = helper.make_graph(
        [helper.make_node("Conv", ins, ["y"], **attrs)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=inits,
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


CASES = [  # (x shape, w shape, attrs)
    ((1, 1, 576), (258, 1, 256), {"strides": [128]}),  # silero VAD's STFT
    ((2, 1, 1760), (257, 1, 512), {"strides": [160]}),  # openWakeWord's mel front end
    ((2, 4, 100), (6, 2, 20), {"strides": [3], "pads": [2, 5], "dilations": [2], "group": 2}),
    ((3, 2, 50), (4, 2, 5), {"strides": [4], "pads": [1, 1]}),
    ((1, 64, 2), (64, 64, 3), {"strides": [2], "pads": [1, 1]}),  # tiny
    ((1, 8, 5, 5), (4, 8, 3, 3), {"pads": [1, 1, 1, 1]}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("x_shape,w_shape,attrs", CASES)
def test_conv_fast_paths_match_onnxruntime(backend, x_shape, w_shape, attrs):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[0]).astype(np.float32)
    x = rng.standard_normal(x_shape).astype(np.float32)
    blob = _conv_model(x_shape, w, b, **attrs)
    want = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = kiln.InferenceSession(blob, backend=backend).run(None, {"x": x})
    assert got[0].shape == want[0].shape
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["silero_vad", "silero_vad_seq", "oww_melspec", "oww_embedding"])
def test_trained_audio_models_match_onnxruntime(backend, name):
    m = tm.get(name)
    if m.path is None:
        pytest.skip(f"{m.package} not installed")
    for batch in (1, 3):
        feed = tm.feed_at_batch(m, batch, seed_samples=4)
        want = ort.InferenceSession(m.path, providers=["CPUExecutionProvider"]).run(None, feed)
        got = kiln.InferenceSession(m.path, backend=backend).run(None, feed)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3 * max(1.0, np.abs(w).max()))


def _rnn_model(
    op: str,
    gates: int,
    x_shape,
    hidden: int,
    dirs: int,
    with_b: bool,
    with_init: bool,
    layout: int,
    attrs: dict,
    rng,
) -> tuple[bytes, dict]:
    steps, batch = (x_shape[1], x_shape[0]) if layout else x_shape[:2]
    w = rng.standard_normal((dirs, gates * hidden, x_shape[2])).astype(np.float32) * 0.5
    r = rng.standard_normal((dirs, gates * hidden, hidden)).astype(np.float32) * 0.5
    inits = [
        helper.make_tensor("w", TensorProto.FLOAT, w.shape, w.ravel()),
        helper.make_tensor("r", TensorProto.FLOAT, r.shape, r.ravel()),
    ]
    ins = ["x", "w", "r", "", "", ""]
    feeds = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    if with_b:
        b = rng.standard_normal((dirs, 2 * gates * hidden)).astype(np.float32) * 0.5
        inits.append(helper.make_tensor("b", TensorProto.FLOAT, b.shape, b.ravel()))
        ins[3] = "b"
    lens = attrs.pop("sequence_lens", None)
    if lens is not None:
        inits.append(helper.make_tensor("lens", TensorProto.INT32, [len(lens)], lens))
        ins[4] = "lens"
    state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    graph_ins = [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)]
    if with_init:
        ins[5] = "h0"
        feeds["h0"] = rng.standard_normal(state).astype(np.float32)
        graph_ins.append(helper.make_tensor_value_info("h0", TensorProto.FLOAT, state))
        if op == "LSTM":
            ins.append("c0")
            feeds["c0"] = rng.standard_normal(state).astype(np.float32)
            graph_ins.append(helper.make_tensor_value_info("c0", TensorProto.FLOAT, state))
    while ins[-1] == "":
        ins.pop()
    outs = ["y", "yh"] + (["yc"] if op == "LSTM" else [])
    direction = "bidirectional" if dirs == 2 else attrs.pop("direction", "forward")
    node = helper.make_node(
        op, ins, outs, hidden_size=hidden, direction=direction, layout=layout, **attrs
    )
    g = helper.make_graph(
        [node],
        "g",
        graph_ins,
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs],
        initializer=inits,
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    return model.SerializeToString(), feeds


RNN_CASES = [  # (op, gates, x shape, hidden, dirs, bias, initial state, layout, attrs)
    ("LSTM", 4, (1, 1, 64), 128, 1, True, True, 0, {}),  # silero VAD's one step
    ("LSTM", 4, (7, 3, 5), 6, 2, True, True, 0, {}),
    ("LSTM", 4, (7, 3, 5), 6, 1, False, False, 0, {"direction": "reverse"}),
    ("LSTM", 4, (3, 7, 5), 6, 1, True, True, 1, {}),
    ("GRU", 3, (7, 2, 5), 6, 2, True, True, 0, {"linear_before_reset": 1}),
    ("GRU", 3, (7, 2, 5), 6, 1, True, False, 0, {}),  # NumPy kernel
    ("RNN", 1, (7, 2, 5), 6, 1, True, True, 0, {}),
    ("RNN", 1, (7, 2, 5), 6, 2, False, True, 0, {"activations": ["Relu", "Relu"]}),
    ("LSTM", 4, (4, 2, 3), 5, 1, True, True, 0, {"clip": 0.5}),  # NumPy kernel
    # batch 1, each direction, both GRU cells, full and ragged sequence_lens: the NumPy
    # kernel's in-place step loops (and the general loop for clip and ragged lengths)
    ("GRU", 3, (9, 1, 8), 16, 2, True, True, 0, {}),
    ("GRU", 3, (9, 1, 8), 16, 1, False, False, 0, {"direction": "reverse"}),
    ("GRU", 3, (9, 1, 8), 16, 1, True, True, 0, {"linear_before_reset": 1, "direction": "reverse"}),
    ("GRU", 3, (4, 2, 3), 5, 1, True, True, 0, {"clip": 0.5}),
    ("GRU", 3, (6, 3, 4), 5, 1, True, True, 0, {"sequence_lens": [6, 6, 6]}),
    ("GRU", 3, (6, 3, 4), 5, 2, True, True, 0, {"sequence_lens": [6, 2, 4]}),
    ("RNN", 1, (9, 1, 8), 16, 1, True, False, 0, {"direction": "reverse"}),
    ("RNN", 1, (9, 1, 8), 16, 2, True, True, 0, {"activations": ["Relu", "Relu"]}),
    ("LSTM", 4, (9, 1, 8), 16, 2, False, True, 0, {}),
    ("LSTM", 4, (6, 3, 4), 5, 1, True, True, 0, {"sequence_lens": [6, 3, 5]}),
    ("LSTM", 4, (40, 1, 16), 24, 1, True, False, 0, {"direction": "reverse"}),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", RNN_CASES, ids=lambda c: f"{c[0]}-{c[2]}-d{c[4]}-{c[8]}")
def test_recurrent_layers_match_onnxruntime(backend, case):
    op, gates, x_shape, hidden, dirs, with_b, with_init, layout, attrs = case
    blob, feeds = _rnn_model(
        op,
        gates,
        x_shape,
        hidden,
        dirs,
        with_b,
        with_init,
        layout,
        dict(attrs),
        np.random.default_rng(1),
    )
    if layout:  # onnxruntime refuses batch-major recurrent layers: ONNX's reference runs them
        from onnx.reference import ReferenceEvaluator

        want = ReferenceEvaluator(blob).run(None, feeds)
    else:
        want = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, feeds)
    sess = kiln.InferenceSession(blob, backend=backend)
    got = sess.run(None, feeds)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_a_training_forward_keeps_torchs_thread_count_for_small_convolutions():
    """A small convolution in a training forward runs on torch's thread count, as the
    PyTorch module's does: oneDNN's one-thread algorithm rounds differently (a 1x1
    convolution over 1x1 pixels here), and in training that difference reached the
    gradients (MobileNetV2's, through train-mode BatchNorm). The Kiln module's output and
    weight gradient equal the PyTorch module's bit for bit."""
    torch = pytest.importorskip("torch")
    import io

    torch.set_num_threads(2)  # conftest restores the count
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(160, 800, 1), torch.nn.Flatten())
    x = torch.randn(2, 160, 1, 1)  # 256,000 MACs
    buf = io.BytesIO()
    torch.onnx.export(net, (x,), buf, dynamo=False, do_constant_folding=False)
    m = kiln.to_torch(buf.getvalue())
    got, want = m(x), net(x)
    assert torch.equal(got, want)
    got.square().sum().backward()
    want.square().sum().backward()
    assert torch.equal(dict(m.named_parameters())["0.weight"].grad, net[0].weight.grad)
