"""kiln.to_torch on what PyTorch's exporters write, against the original PyTorch module
(parameter counts, per-parameter gradients, eval outputs): equal-valued initializers the
TorchScript exporter stores once, train-mode exports (Dropout and BatchNorm with
``training_mode``), Clip, and modules holding a Kiln body (issue 46)."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import kiln  # noqa: E402


def _export(net: nn.Module, args: tuple, train: bool = False, **kw) -> onnx.ModelProto:
    buf = io.BytesIO()
    mode = torch.onnx.TrainingMode.TRAINING if train else torch.onnx.TrainingMode.EVAL
    torch.onnx.export(net, args, buf, dynamo=False, training=mode, **kw)
    return onnx.load_from_string(buf.getvalue())


def _loss(out) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return (out * torch.randn(out.shape, generator=gen)).sum()


def _same_gradients(ref: nn.Module, m: nn.Module, rel: float = 1e-5) -> None:
    want = dict(ref.named_parameters())
    got = dict(m.named_parameters())
    assert set(got) == set(want)
    for k, p in got.items():
        w = want[k].grad
        assert (p.grad - w).norm() <= rel * w.norm() + 1e-7, k


def test_identity_copies_of_equal_initializers_are_parameters_of_their_own(tmp_path):
    """Zero biases and LayerNorm weights of ones are stored once and read through Identity
    nodes; they are 8 separate parameters of the module, trained apart."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 4), nn.LayerNorm(4))
    with torch.no_grad():
        net[0].bias.zero_()
        net[2].bias.zero_()
    net.eval()
    proto = _export(net, (torch.randn(2, 4),))
    assert len(proto.graph.initializer) < 8  # the exporter did store them once
    m = kiln.to_torch(proto)
    assert len(list(m.parameters())) == len(list(net.parameters())) == 8
    x = torch.randn(3, 4)
    _loss(net(x)).backward()
    _loss(m(x)).backward()
    _same_gradients(net, m)
    for mod in (net, m):
        torch.optim.SGD(mod.parameters(), lr=0.1).step()
    path = tmp_path / "untied.onnx"
    kiln.save(m, path)
    saved = onnx.load(path)
    assert len(saved.graph.initializer) == 8  # saved untied, each with its own step
    back = kiln.to_torch(path)
    for k, p in net.named_parameters():
        torch.testing.assert_close(back.get_parameter(k), p, rtol=1e-6, atol=1e-7)


def test_a_weight_read_by_two_nodes_stays_tied():
    """A tied embedding and output layer: one initializer read by two nodes directly."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 6)
            self.head = nn.Linear(6, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(torch.tanh(self.emb(ids)))

    torch.manual_seed(0)
    net = Tied().eval()
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    # constant folding would store the head's transposed copy apart: kept off, as for training
    m = kiln.to_torch(_export(net, (ids,), do_constant_folding=False))
    assert len(list(m.parameters())) == len(list(net.parameters())) == 1
    _loss(net(ids)).backward()
    _loss(m(ids)).backward()
    (p,) = m.parameters()
    torch.testing.assert_close(p.grad, net.emb.weight.grad, rtol=1e-5, atol=1e-6)


def test_random_init_bert_has_the_original_parameters_and_gradients():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=32,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    net = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)

    class Body(nn.Module):  # the hidden states alone, as a tensor
        def __init__(self, bert):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    ref = Body(net).eval()
    proto = _export(ref, (ids, mask), opset_version=17, do_constant_folding=False)
    m = kiln.to_torch(proto).eval()
    want = dict(ref.named_parameters())
    # every parameter is its own, as in the original (before: 30 of them for its 69)
    assert {k for k, _ in m.named_parameters()} == set(want)
    _loss(ref(ids, mask)).backward()
    _loss(m(ids, mask)).backward()
    scale = max(p.grad.norm() for p in want.values() if p.grad is not None)
    for k, p in m.named_parameters():
        g, w = p.grad.clone(), want[k].grad
        if k == "bert.embeddings.word_embeddings.weight":
            g[cfg.pad_token_id] = 0  # ONNX has no padding_idx (docs/training.md)
        assert (g - w).norm() <= 1e-4 * w.norm() + 1e-6 * scale, k
    ln = "bert.embeddings.LayerNorm.bias"
    torch.testing.assert_close(m.get_parameter(ln).grad, want[ln].grad, rtol=1e-4, atol=1e-6)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(4 * 6 * 6, 3),
    )


def test_eval_is_inference_for_a_train_mode_export():
    """Exported in train mode, Dropout's training_mode is a constant True and BatchNorm's
    training_mode attribute 1: module.eval() still means inference, the original's eval."""
    net = _cnn()
    proto = _export(net.train(), (torch.randn(2, 1, 8, 8),), train=True, do_constant_folding=False)
    ops = {n.op_type: n for n in proto.graph.node}
    assert len(ops["BatchNormalization"].output) == 3 and len(ops["Dropout"].input) == 3
    m = kiln.to_torch(proto).eval()
    x = torch.randn(5, 1, 8, 8)
    with torch.no_grad():
        first, second, want = m(x), m(x), net.eval()(x)
    torch.testing.assert_close(first, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    stats = {k: b.clone() for k, b in m.named_buffers()}
    for k, b in m.named_buffers():  # eval never moves the running statistics
        torch.testing.assert_close(b, stats[k], rtol=0, atol=0)


def test_a_train_mode_cnn_with_batchnorm_and_dropout_trains_as_the_original():
    """BatchNormalization with training_mode=1 (three outputs) and Dropout: from the same
    seed, the same dropout masks, outputs, gradients, running statistics and SGD steps."""
    net = _cnn().train()
    # tracing in train mode moves net's running statistics; the file holds them as moved
    proto = _export(net, (torch.randn(2, 1, 8, 8),), train=True, do_constant_folding=False)
    m = kiln.to_torch(proto).train()
    assert len(list(m.parameters())) == len(list(net.parameters()))
    opts = [torch.optim.SGD(mod.parameters(), lr=0.05, momentum=0.9) for mod in (net, m)]
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(6, 1, 8, 8, generator=gen)
        y = torch.randint(0, 3, (6,), generator=gen)
        outs = []
        for mod, opt in zip((net, m), opts):
            torch.manual_seed(100 + step)
            opt.zero_grad()
            out = mod(x)
            nn.functional.cross_entropy(out, y).backward()
            outs.append(out)
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
        _same_gradients(net, m, rel=1e-4)
        for opt in opts:
            opt.step()
    ref_buffers = dict(net.named_buffers())
    for k, b in m.named_buffers():  # running statistics moved as PyTorch's
        torch.testing.assert_close(b, ref_buffers[k], rtol=1e-5, atol=1e-6)
    for k, p in m.named_parameters():
        torch.testing.assert_close(p, net.get_parameter(k), rtol=1e-5, atol=1e-6)
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(m.eval()(x), net.eval()(x), rtol=1e-5, atol=1e-6)


def test_relu6_trains_with_the_gradient_of_torch_relu6():
    """Clip with constant bounds runs as F.hardtanh (torch.nn.ReLU6's own kernel): the same
    gradient, exactly, even where an input sits on a bound (maximum/minimum would split
    it there)."""
    net = nn.Sequential(nn.Linear(5, 5), nn.ReLU6(), nn.Linear(5, 2))
    with torch.no_grad():
        net[0].weight.copy_(torch.eye(5))
        net[0].bias.copy_(torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0]))
    net.eval()
    m = kiln.to_torch(_export(net, (torch.randn(2, 5),), do_constant_folding=False))
    x = torch.tensor([[0.0, 5.5, -3.0, 2.0, 4.0], [-1.0, -0.5, 5.0, 4.5, 7.0]])  # on 0 and 6
    _loss(net(x)).backward()
    _loss(m(x)).backward()
    for k, p in m.named_parameters():
        torch.testing.assert_close(p.grad, net.get_parameter(k).grad, rtol=0, atol=0)
    assert net[0].bias.grad.abs().min() < net[0].bias.grad.abs().max()


def test_a_nan_through_max_pool_trains_as_the_original():
    """A NaN reaching a MaxPool (a diverging run, a bad sample) spreads over its windows as
    in the PyTorch module, and the step goes on with the original's gradients: a session
    hands such a pool to its NumPy kernel (the reference skips the NaN), which in a training
    module would cut the gradient, so the module raised there."""
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 3, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 3 * 3, 2)
    ).eval()
    m = kiln.to_torch(_export(net, (torch.randn(2, 1, 8, 8),)))
    x = torch.randn(2, 1, 8, 8)
    x[0, 0, 2, 2] = float("nan")
    for mod in (net, m):
        mod.train()
    ref, got = net(x), m(x)
    assert ref.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, equal_nan=True)
    ref.nansum().backward()
    got.nansum().backward()
    for k, p in m.named_parameters():
        torch.testing.assert_close(
            p.grad, net.get_parameter(k).grad, rtol=1e-5, atol=1e-6, equal_nan=True
        )


def _digits_like():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(4 * 8 * 8, 16),
        nn.ReLU(),
        nn.Linear(16, 3),
    )
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].running_var.uniform_(0.5, 2.0)
    net.eval()
    buf = io.BytesIO()
    torch.onnx.export(
        net,
        (torch.zeros(2, 1, 8, 8),),
        buf,
        dynamo=False,
        input_names=["x"],
        output_names=["y"],
        dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
        training=torch.onnx.TrainingMode.PRESERVE,
        do_constant_folding=False,
    )
    return net, buf.getvalue()


def test_save_a_user_module_holding_a_kiln_body_and_a_head(tmp_path):
    """SINGA's shape: class MyModel(nn.Module) with the cut body and a new head; the cut
    says what it removed and how wide its features are."""
    from conftest import ort_run

    net, blob = _digits_like()
    body = kiln.to_torch(blob, last_layers=-3)
    assert [r.split(" (")[1] for r in body.removed_layers] == ["Gemm)", "Relu)", "Gemm)"]
    width = body.output_shapes[0][-1]
    assert width == 4 * 8 * 8

    class MyModel(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = body
            self.head = nn.Sequential(nn.Linear(width, 8), nn.Tanh(), nn.Linear(8, 2))

        def forward(self, x):
            return torch.softmax(self.head(self.body(x)), dim=-1)

    model = MyModel()
    x = torch.randn(5, 1, 8, 8)
    nn.functional.nll_loss(model(x).log(), torch.tensor([0, 1, 0, 1, 1])).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    path = tmp_path / "mine.onnx"
    kiln.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    assert model.training  # restored after the export
    (got,) = ort_run(str(path), {"x": x.numpy()})
    with torch.no_grad():
        want = model.eval()(x)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-6)
    back = kiln.to_torch(path)
    assert len(list(back.parameters())) == len(list(model.parameters()))
    assert {k for k, _ in back.named_parameters()} == {k for k, _ in model.named_parameters()}


def test_torch_onnx_export_of_a_kiln_module_writes_its_own_nodes():
    """torch.onnx.export traces torch ops, whose integer division rounds differently from
    ONNX's Div; the module writes its graph's nodes instead (at the export's opset too)."""
    from onnx import TensorProto, helper

    from conftest import make_model, ort_run

    proto = make_model(
        [helper.make_node("Div", ["a", "b"], ["y"])],
        [helper.make_tensor_value_info(n, TensorProto.INT64, [4]) for n in ("a", "b")],
        [helper.make_tensor_value_info("y", TensorProto.INT64, [4])],
        opset=13,
    )
    a, b = np.array([-7, 7, -5, 9]), np.array([2, -2, 3, 4])
    (want,) = ort_run(proto, {"a": a, "b": b})
    m = kiln.to_torch(proto)
    for opset in (13, 17):
        buf = io.BytesIO()
        torch.onnx.export(
            m,
            (torch.from_numpy(a), torch.from_numpy(b)),
            buf,
            dynamo=False,
            input_names=["a", "b"],
            opset_version=opset,
        )
        back = onnx.load_from_string(buf.getvalue())
        assert [n.op_type for n in back.graph.node] == ["Div"]
        (got,) = ort_run(back, {"a": a, "b": b})
        np.testing.assert_array_equal(got, want)


def test_a_model_with_batchnorm_folded_by_its_exporter_warns():
    pytest.importorskip("onnxscript")
    net = _cnn().train()
    buf = io.BytesIO()
    torch.onnx.export(
        net, (torch.randn(2, 1, 8, 8),), buf, dynamo=True, training=torch.onnx.TrainingMode.TRAINING
    )
    assert "BatchNormalization" not in {
        n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node
    }
    with pytest.warns(kiln.train.FoldedBatchNormWarning, match="dynamo=False"):
        kiln.to_torch(buf.getvalue())
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", kiln.train.FoldedBatchNormWarning)
        kiln.to_torch(_export(_cnn().train(), (torch.randn(2, 1, 8, 8),), train=True))


def test_torch_onnx_export_writes_a_transpose_without_perm():
    from onnx import TensorProto, helper

    from conftest import make_model, ort_run

    proto = make_model(
        [helper.make_node("Transpose", ["x"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 3, 2])],
        opset=13,
    )
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    buf = io.BytesIO()
    torch.onnx.export(
        kiln.to_torch(proto),
        (torch.from_numpy(x),),
        buf,
        dynamo=False,
        input_names=["x"],
        opset_version=13,
    )
    (got,) = ort_run(onnx.load_from_string(buf.getvalue()), {"x": x})
    np.testing.assert_array_equal(got, x.transpose(2, 1, 0))


class _TwoHeads(nn.Module):
    """A body with two outputs (features and their mean), for unpacking under fx."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.conv, self.fc = nn.Conv2d(1, 3, 3), nn.Linear(3 * 6 * 6, 5)

    def forward(self, x):
        f = self.fc(torch.relu(self.conv(x)).flatten(1))
        return f, f.mean(1, keepdim=True)


def test_fx_symbolic_trace_of_a_module_holding_kiln_bodies():
    """torch.fx.symbolic_trace of a user's module holding Kiln modules: each Kiln module
    is one call_module node (a leaf; several outputs unpack), and the GraphModule gives
    the original PyTorch modules' outputs and gradients and holds the Kiln parameters."""
    net, blob = _digits_like()
    two = _TwoHeads().eval()
    x = torch.randn(4, 1, 8, 8)
    two_blob = _export(two, (x,), input_names=["x"], do_constant_folding=False)
    head = nn.Linear(5, 2)

    class Mine(nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a, self.b, self.head = a, b, head

        def forward(self, x):
            feats, mean = self.b(x)
            return self.a(x).sum(1, keepdim=True) + self.head(feats) * mean

    ref = Mine(net, two).eval()
    gm = torch.fx.symbolic_trace(Mine(kiln.to_torch(blob), kiln.to_torch(two_blob)).eval())
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["b", "a", "head"]
    want = dict(ref.named_parameters())
    assert {k for k, _ in gm.named_parameters()} == set(want)
    _loss(ref(x)).backward()
    out = gm(x)
    torch.testing.assert_close(out, ref(x), rtol=1e-5, atol=1e-6)
    _loss(out).backward()
    for k, p in gm.named_parameters():
        torch.testing.assert_close(p.grad, want[k].grad, rtol=1e-4, atol=1e-6, msg=k)


def test_fx_symbolic_trace_of_a_kiln_module_itself_says_what_to_use():
    """A Kiln module alone cannot be fx-traced (its kernels are chosen by shapes and
    dtypes, which fx's proxies lack): a TypeError naming torch.export, whose program gives
    the original module's outputs."""
    net, blob = _digits_like()
    m = kiln.to_torch(blob).eval()
    with pytest.raises(TypeError, match="torch.export.export"):
        torch.fx.symbolic_trace(m)
    x = torch.randn(3, 1, 8, 8)
    program = torch.export.export(m, (x,))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(x), net(x), rtol=1e-5, atol=1e-6)


def test_linear_layers_run_as_the_originals_addmm():
    """torch.nn.Linear on a 3-D input is exported as Transpose(W), MatMul, Add(b); the
    module runs it as F.linear, as the layer did: the same addmm calls (the bias inside
    the GEMM) in forward and backward, and the original's gradients."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    x = torch.randn(2, 5, 8)
    proto = _export(net, (x,), do_constant_folding=False)
    assert {"Transpose", "MatMul", "Add"} <= {n.op_type for n in proto.graph.node}
    m = kiln.to_torch(proto)

    def addmm_calls(mod):
        with profile(activities=[ProfilerActivity.CPU]) as p:
            _loss(mod(x)).backward()
        return sum(e.count for e in p.key_averages() if e.key == "aten::addmm")

    want, got = addmm_calls(net), addmm_calls(m)
    assert want == got == 2
    _same_gradients(net, m, rel=1e-6)
    torch.testing.assert_close(m(x), net(x), rtol=1e-6, atol=1e-6)
