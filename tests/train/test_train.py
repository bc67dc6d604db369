"""kiln.to_torch: imported models as trainable torch modules, checked against the PyTorch
module they were exported from (outputs, gradients, running statistics, optimizer steps)
and against onnxruntime for what kiln.save writes back."""

from __future__ import annotations

import copy
import io
from pathlib import Path

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import kiln  # noqa: E402
from conftest import make_model, ort_run  # noqa: E402
from kiln.errors import KilnError, UnsupportedOpError  # noqa: E402
from kiln.train.module import NonDifferentiableWarning  # noqa: E402

DATA = Path(kiln.__file__).parent / "data"
DIGITS = str(DATA / "digits_cnn.onnx")


def _net() -> nn.Module:
    """A small CNN with BatchNorm, its statistics and affine parameters randomized (as a
    trained net's are; fresh ones are equal tensors the exporter would store once)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                        nn.Conv2d(8, 12, 3, padding=1, stride=2), nn.BatchNorm2d(12), nn.ReLU(),
                        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(12, 4))
    with torch.no_grad():
        for m in net:
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.5, 0.5)
                m.running_mean.uniform_(-0.2, 0.2)
                m.running_var.uniform_(0.5, 2.0)
    return net.eval()


def _export(net: nn.Module, shape=(2, 1, 8, 8)) -> bytes:
    buf = io.BytesIO()
    torch.onnx.export(net, (torch.zeros(shape),), buf, dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
                      training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False)
    return buf.getvalue()


@pytest.fixture(scope="module")
def small():
    net = _net()
    return net, _export(net)


def _x(n=6, seed=1):
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, 1, 8, 8))
                            .astype(np.float32))


def test_parameters_buffers_and_forward_match_onnxruntime():
    m = kiln.to_torch(DIGITS)
    d = np.load(DATA / "digits_test.npz")
    x = d["images"][:16]
    (ref,) = ort_run(DIGITS, {"image": x})
    y = m(torch.from_numpy(x))
    assert y.requires_grad  # autograd on, unlike inference sessions
    np.testing.assert_allclose(y.detach().numpy(), ref, rtol=1e-4, atol=1e-5)
    proto = onnx.load(DIGITS)
    floats = {i.name for i in proto.graph.initializer if i.data_type == onnx.TensorProto.FLOAT}
    assert {m.initializer_name(k) for k, _ in m.named_parameters()} == floats
    torch.nn.functional.cross_entropy(y, torch.from_numpy(d["labels"][:16]).long()).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.parameters())


@pytest.mark.parametrize("train", [True, False])
def test_gradients_statistics_and_sgd_step_match_the_pytorch_module(small, train):
    net, blob = small
    ref = copy.deepcopy(net).train(train)
    m = kiln.to_torch(blob).train(train)
    # names map back to the PyTorch module's own state_dict keys
    assert set(m.state_dict()) == set(ref.state_dict()) - {"1.num_batches_tracked",
                                                           "4.num_batches_tracked"}
    x = _x()
    target = torch.randn(6, 4)
    opts = [torch.optim.SGD(mod.parameters(), lr=0.1, momentum=0.9) for mod in (ref, m)]
    for mod in (ref, m):
        loss = ((mod(x) - target) ** 2).mean()
        loss.backward()
    got, want = dict(m.named_parameters()), dict(ref.named_parameters())
    for k, p in got.items():
        g, w = p.grad, want[k].grad
        assert (g - w).norm() <= 1e-4 * w.norm() + 1e-8, k
    for k, b in m.named_buffers():  # train: running stats updated as torch does
        torch.testing.assert_close(b, dict(ref.named_buffers())[k], rtol=1e-5, atol=1e-6)
    for opt in opts:
        opt.step()
    for k, p in got.items():
        torch.testing.assert_close(p, want[k], rtol=1e-5, atol=1e-6)


def test_state_dict_round_trips(small):
    _, blob = small
    a, b = kiln.to_torch(blob), kiln.to_torch(blob)
    with torch.no_grad():
        for p in a.parameters():
            p.add_(0.1)
    a.train()(_x())  # moves running statistics
    b.load_state_dict(a.state_dict())
    a.eval(), b.eval()
    torch.testing.assert_close(b(_x(seed=3)), a(_x(seed=3)), rtol=0, atol=0)
    assert not torch.equal(b(_x(seed=3)), kiln.to_torch(blob).eval()(_x(seed=3)))


def test_plain_pytorch_training_matches_the_pytorch_module(small):
    """Adam with a step LR schedule, gradient clipping and the first conv frozen by name
    pattern: kiln's module ends where the PyTorch module ends."""
    net, blob = small
    mods = [copy.deepcopy(net).train(), kiln.to_torch(blob).train()]
    rng = np.random.default_rng(0)
    batches = [(torch.from_numpy(rng.standard_normal((8, 1, 8, 8)).astype(np.float32)),
                torch.from_numpy(rng.integers(0, 4, 8))) for _ in range(4)]
    frozen0 = {}
    for mod in mods:
        for name, p in mod.named_parameters():
            if name.startswith("0."):
                p.requires_grad_(False)
        frozen0[id(mod)] = mod.get_parameter("0.weight").detach().clone()
        opt = torch.optim.Adam([p for p in mod.parameters() if p.requires_grad], lr=0.05)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        for x, y in batches:
            opt.zero_grad()
            torch.nn.functional.cross_entropy(mod(x), y).backward()
            torch.nn.utils.clip_grad_norm_(mod.parameters(), 0.5)
            opt.step()
            sched.step()
    ref, m = mods
    for k, p in m.named_parameters():
        torch.testing.assert_close(p, ref.get_parameter(k), rtol=1e-4, atol=1e-5)
    assert torch.equal(m.get_parameter("0.weight"), frozen0[id(m)])
    assert not torch.equal(m.get_parameter("3.weight"), net.get_parameter("3.weight"))


def test_autocast_bf16_matches_the_pytorch_module_under_autocast(small):
    net, blob = small
    ref, m = copy.deepcopy(net).train(), kiln.to_torch(blob).train()
    x = _x()
    outs = []
    for mod in (ref, m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = mod(x)
        y.float().square().mean().backward()
        outs.append(y.float())
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
    for k, p in m.named_parameters():
        w = ref.get_parameter(k).grad
        assert (p.grad - w).norm() <= 5e-2 * w.norm() + 1e-6, k


def test_cut_at_a_layer_or_last_layers_gives_the_truncated_pytorch_module(small):
    net, blob = small
    x = _x()
    want = net[:6](x)  # through the second ReLU
    proto = onnx.load_from_string(blob)
    relu2 = [n for n in proto.graph.node if n.op_type == "Relu"][1]
    for cut in (kiln.to_torch(blob, outputs=[relu2.name]),
                kiln.to_torch(blob, outputs=relu2.output[0]),
                kiln.to_torch(blob, last_layers=-3)):  # drops pool, flatten, gemm
        torch.testing.assert_close(cut.eval()(x), want, rtol=1e-5, atol=1e-5)
        assert "8.weight" not in dict(cut.named_parameters())
    with pytest.raises(KilnError):
        kiln.to_torch(blob, outputs=["no_such_tensor"])
    with pytest.raises(KilnError):
        kiln.to_torch(blob, last_layers=-100)


def test_train_only_a_new_head(small):
    net, blob = small
    body = kiln.to_torch(blob, last_layers=-1)  # ends at Flatten: 12 features
    head = nn.Linear(12, 3)
    model = nn.Sequential(body, head)
    before = {k: p.detach().clone() for k, p in body.named_parameters()}
    body.requires_grad_(False).eval()  # frozen, statistics included
    opt = torch.optim.SGD(head.parameters(), lr=0.5)
    x, y = _x(12), torch.arange(12) % 3
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    for k, p in body.named_parameters():
        assert torch.equal(p, before[k]) and p.grad is None
    # the features are the PyTorch module's, in eval mode
    torch.testing.assert_close(body(x), net[:8](x), rtol=1e-5, atol=1e-5)


def test_save_fine_tuned_keeps_the_graph_with_new_weights(small, tmp_path):
    net, blob = small
    m = kiln.to_torch(blob).train()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        m(_x()).square().mean().backward()
        opt.step()
    path = tmp_path / "tuned.onnx"
    kiln.save(m, path)
    onnx.checker.check_model(str(path), full_check=True)
    saved, orig = onnx.load(str(path)), onnx.load_from_string(blob)
    assert [n.op_type for n in saved.graph.node] == \
        [n.op_type for n in orig.graph.node if not (n.op_type == "Identity")]
    x = _x(seed=5)
    (got,) = ort_run(str(path), {"x": x.numpy()})
    np.testing.assert_allclose(got, m.eval()(x).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_save_cut_plus_head_appends_the_head(small, tmp_path):
    _, blob = small
    body = kiln.to_torch(blob, last_layers=-1)
    model = nn.Sequential(body, nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 3))
    model(_x()).sum().backward()
    path = tmp_path / "head.onnx"
    kiln.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    saved = onnx.load(str(path))
    body_ops = [n.op_type for n in onnx.load_from_string(blob).graph.node
                if n.op_type != "Identity"][:-1]
    assert [n.op_type for n in saved.graph.node][:len(body_ops)] == body_ops
    assert [n.op_type for n in saved.graph.node][len(body_ops):] == ["Gemm", "Relu", "Gemm"]
    x = _x(4, seed=7)
    (got,) = ort_run(str(path), {"x": x.numpy()})
    np.testing.assert_allclose(got, model.eval()(x).detach().numpy(), rtol=1e-4, atol=1e-5)


def test_a_numpy_only_layer_on_a_gradient_path_is_refused_when_the_module_is_built():
    from onnx import TensorProto, helper

    from kiln.ops import registry

    w = helper.make_tensor("w", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0])
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"], name="scale"),
             helper.make_node("Det", ["h"], ["y"], name="det")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], [w])
    registry.load_backend("torch")
    if registry.lookup("", "Det", 17).differentiable_on("torch"):
        pytest.skip("Det now has a torch kernel; pick another NumPy-only op")
    with pytest.raises(UnsupportedOpError, match="det"):
        kiln.to_torch(model.SerializeToString())
    # cut before it, the module builds and trains
    m = kiln.to_torch(model.SerializeToString(), outputs=["scale"])
    m(torch.ones(2, 2)).sum().backward()
    assert torch.equal(m.get_parameter("w").grad, torch.ones(2, 2))


def test_the_numpy_fallback_never_cuts_a_gradient_silently():
    """A NumPy-only layer no parameter reaches is allowed (and named), but fed a tensor
    that needs gradients at run time it raises instead of cutting the gradient."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Det", ["x"], ["y"], name="det")]
    model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])])
    with pytest.warns(NonDifferentiableWarning, match="det"):
        m = kiln.to_torch(model.SerializeToString())  # no parameter reaches it: allowed
    assert any("det" in n for n in m.non_differentiable)
    x = torch.eye(2, requires_grad=True)
    with pytest.raises(kiln.KernelError, match="cuts the gradient"):
        m(x)
    with torch.no_grad():
        assert float(m(x)) == pytest.approx(1.0)


@pytest.mark.parametrize("opset", [11, 13])
def test_dropout_drops_in_train_mode_as_torch_dropout_and_not_in_eval(opset):
    """Dropout as an attribute (opset < 12) and as an input: in train mode the same mask and
    scaling torch.nn.Dropout draws from the same seed; in eval mode the identity."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"])]
    inits = [numpy_helper.from_array(w, "w")]
    if opset >= 12:
        inits.append(numpy_helper.from_array(np.array(0.3, np.float32), "ratio"))
        nodes.append(helper.make_node("Dropout", ["h", "ratio"], ["y"]))
    else:
        nodes.append(helper.make_node("Dropout", ["h"], ["y"], ratio=0.3))
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 6])], inits,
                       opset=opset)
    module = kiln.to_torch(proto)
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((5, 6)).astype(np.float32))
    reference = nn.Dropout(0.3)
    module.train()
    torch.manual_seed(7)
    got = module(x)
    torch.manual_seed(7)
    want = reference.train()(x @ torch.from_numpy(w))
    torch.testing.assert_close(got, want)
    assert (got == 0).any()
    module.eval()
    torch.testing.assert_close(module(x), x @ torch.from_numpy(w))


def test_lifted_scalar_literals_are_frozen_and_the_weights_train():
    """0-d initializers (what torch.onnx's dynamo exporter makes of literals) stay as in
    the module the graph came from: a Pow exponent trained would go NaN in one step."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"),
             numpy_helper.from_array(np.array(3.0, np.float32), "val_3"),
             numpy_helper.from_array(np.array(0.5, np.float32), "val_half")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Pow", ["h", "val_3"], ["c"]),
             helper.make_node("Mul", ["c", "val_half"], ["y"])]
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 4])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 3])], inits)
    module = kiln.to_torch(proto)
    params = dict(module.named_parameters())
    assert params["w"].requires_grad
    assert not params["val_3"].requires_grad and not params["val_half"].requires_grad
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32))
    wt = torch.from_numpy(w).requires_grad_()
    (0.5 * (x @ wt) ** 3).square().mean().backward()
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    module(x).square().mean().backward()
    torch.testing.assert_close(params["w"].grad, wt.grad)
    opt.step()
    assert float(params["val_3"]) == 3.0 and torch.isfinite(module(x)).all()
    # opted in, a literal trains as a torch tensor would (positive bases: a finite log)
    params["val_3"].requires_grad_()
    module.zero_grad()
    xp, wp = x.abs(), params["w"].detach().abs()
    with torch.no_grad():
        params["w"].copy_(wp)
    module(xp).square().mean().backward()
    e = torch.tensor(3.0, requires_grad=True)
    (0.5 * (xp @ wp) ** e).square().mean().backward()
    torch.testing.assert_close(params["val_3"].grad, e.grad)


@pytest.mark.parametrize("opset", [9, 11])
def test_dropout_with_its_mask_output_trains_and_masks_consistently(opset):
    """Dropout nodes that also return the mask (Caffe2-era models; opset < 10 gives it the
    input's type): in eval mode the identity (onnxruntime's output) and a mask of all kept
    (ONNX's reference evaluator: onnxruntime returns all dropped); in train mode
    y = x * mask / (1 - ratio), gradients through it."""
    from onnx import TensorProto, helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    w = np.random.default_rng(0).standard_normal((6, 6)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]),
             helper.make_node("Dropout", ["h"], ["y", "mask"], ratio=0.3)]
    mask_type = TensorProto.FLOAT if opset < 10 else TensorProto.BOOL
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [5, 6])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [5, 6]),
                        helper.make_tensor_value_info("mask", mask_type, [5, 6])],
                       [numpy_helper.from_array(w, "w")], opset=opset)
    x = np.random.default_rng(1).standard_normal((5, 6)).astype(np.float32)
    module = kiln.to_torch(proto).eval()
    (want_y, ort_mask) = ort_run(proto, {"x": x})
    (_, want_mask) = ReferenceEvaluator(proto).run(None, {"x": x})
    with torch.no_grad():
        y, mask = (t.numpy() for t in module(torch.from_numpy(x)))
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    assert mask.dtype == ort_mask.dtype
    np.testing.assert_array_equal(mask.astype(bool), want_mask.astype(bool))
    module.train()
    y, mask = module(torch.from_numpy(x))
    h = torch.from_numpy(x @ w)
    assert mask.dtype == (torch.float32 if opset < 10 else torch.bool)
    keep = mask.bool()
    assert 0 < int(keep.sum()) < keep.numel()
    torch.testing.assert_close(y, torch.where(keep, h / 0.7, 0.0))
    y.sum().backward()
    want_grad = torch.from_numpy(x).T @ (keep.float() / 0.7)
    torch.testing.assert_close(module.get_parameter("w").grad, want_grad)


def test_lrn_trains_like_torch_local_response_norm():
    """LRN (AlexNet, Inception v1) on a gradient path: torch's local_response_norm, so the
    module builds and its gradients are torch's; onnxruntime checks the forward."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(0).standard_normal((6, 3, 3, 3)).astype(np.float32)
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"], pads=[1, 1, 1, 1]),
             helper.make_node("LRN", ["h"], ["y"], size=5, alpha=2e-3, beta=0.75, bias=2.0)]
    proto = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [2, 3, 7, 7])],
                       [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6, 7, 7])],
                       [numpy_helper.from_array(w, "w")])
    x = np.random.default_rng(1).standard_normal((2, 3, 7, 7)).astype(np.float32)
    module = kiln.to_torch(proto)
    out = module(torch.from_numpy(x))
    np.testing.assert_allclose(out.detach().numpy(), ort_run(proto, {"x": x})[0],
                               rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    wt = torch.from_numpy(w).requires_grad_()
    ref = nn.functional.local_response_norm(
        nn.functional.conv2d(torch.from_numpy(x), wt, padding=1), 5, 2e-3, 0.75, 2.0)
    ref.square().sum().backward()
    torch.testing.assert_close(module.get_parameter("w").grad, wt.grad)


class _Block(nn.Module):
    """Attention with an additive mask, LayerNorm and an erf GELU written as primitives, as
    exporters decompose them."""

    def __init__(self, d=16):
        super().__init__()
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)
        self.d = d

    def forward(self, x, mask):
        q, k, v = self.qkv(x).split(self.d, dim=-1)
        s = torch.softmax(q @ k.transpose(-1, -2) / self.d ** 0.5 + mask, dim=-1)
        h = self.out(s @ v)
        return self.norm(0.5 * h * (1 + torch.erf(h / 2 ** 0.5)) + x)


def test_fused_attention_gelu_train_like_the_module_and_save_the_original_graph(tmp_path):
    torch.manual_seed(0)
    net = _Block()
    x, mask = torch.randn(3, 5, 16), torch.zeros(3, 5, 5)
    mask[:, :, -1] = -1e4
    buf = io.BytesIO()
    torch.onnx.export(net, (x, mask), buf, dynamo=False, input_names=["x", "mask"],
                      output_names=["y"], do_constant_folding=False, opset_version=17)
    m = kiln.to_torch(buf.getvalue())
    ran = {s.node.op_type for s in m._plan.steps}
    assert {"Attention", "Gelu"} <= ran and "Erf" not in ran and "Softmax" not in ran
    ref = copy.deepcopy(net)
    for mod in (m, ref):
        mod(x, mask).square().mean().backward()
    for name, p in ref.named_parameters():
        got = m.get_parameter(m.parameter_name(name)).grad
        np.testing.assert_allclose(got.numpy(), p.grad.numpy(), rtol=1e-4, atol=1e-6)
    path = tmp_path / "block.onnx"
    kiln.save(m, path)
    saved = onnx.load(path)
    assert [n.op_type for n in saved.graph.node] == \
        [n.op_type for n in onnx.load_from_string(buf.getvalue()).graph.node]
    (y,) = ort_run(str(path), {"x": x.numpy(), "mask": mask.numpy()})
    np.testing.assert_allclose(y, net(x, mask).detach().numpy(), rtol=1e-4, atol=1e-5)
