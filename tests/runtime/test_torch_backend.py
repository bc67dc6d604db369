"""The torch backend: results against onnxruntime, torch I/O, async runs, CPU fallback and
its report, host-pinned values, reduced precision, compiled mode, and CUDA (skipped
without a GPU)."""

from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import make_model as _make_model
from conftest import ort_run
from kiln.ops import registry

torch = pytest.importorskip("torch")

from kiln.runtime.torch_backend import CompileWarning, FallbackWarning  # noqa: E402

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not CUDA, reason="no CUDA device (torch.cuda.is_available() is False); these tests run "
                     "where a GPU is present")


def make_model(nodes, inputs, outputs, initializers=(), custom: bool = False):
    """conftest's make_model, plus the test.torch domain of the custom ops here."""
    m = _make_model(nodes, inputs, outputs, initializers)
    if custom:
        m.opset_import.append(helper.make_opsetid("test.torch", 1))
    return m


def _init(name, arr):
    return numpy_helper.from_array(np.asarray(arr), name)


def _has(*ops) -> bool:
    return all(registry.lookup("", op, 17) is not None for op in ops)


def _requires(*ops):
    missing = [op for op in ops if registry.lookup("", op, 17) is None]
    return pytest.mark.skipif(bool(missing), reason=f"no NumPy kernel yet for {missing}")


@pytest.fixture
def conv_net():
    """Conv (asymmetric pads) -> BN -> Relu -> MaxPool -> Conv (SAME_UPPER, stride 2) + Add
    -> Relu -> AveragePool -> GlobalAveragePool -> Flatten -> Gemm -> Softmax."""
    rng = np.random.default_rng(1)
    f = np.float32
    inits = [_init("w1", rng.standard_normal((8, 3, 3, 3)).astype(f) * 0.3),
             _init("b1", rng.standard_normal(8).astype(f)),
             _init("scale", rng.uniform(0.5, 1.5, 8).astype(f)),
             _init("bias", rng.standard_normal(8).astype(f)),
             _init("mean", rng.standard_normal(8).astype(f) * 0.1),
             _init("var", rng.uniform(0.5, 2, 8).astype(f)),
             _init("w2", rng.standard_normal((8, 8, 3, 3)).astype(f) * 0.2),
             _init("b2", rng.standard_normal(8).astype(f)),
             _init("w3", rng.standard_normal((8, 8, 1, 1)).astype(f) * 0.3),
             _init("wf", rng.standard_normal((5, 8)).astype(f)),
             _init("bf", rng.standard_normal(5).astype(f))]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 0, 2, 1]),
        helper.make_node("BatchNormalization", ["c1", "scale", "bias", "mean", "var"], ["bn"]),
        helper.make_node("Relu", ["bn"], ["r1"]),
        helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w2", "b2"], ["c2"], auto_pad="SAME_UPPER",
                         strides=[2, 2]),
        helper.make_node("Conv", ["p1", "w3"], ["c3"], strides=[2, 2]),
        helper.make_node("Add", ["c2", "c3"], ["s"]),
        helper.make_node("Relu", ["s"], ["r2"]),
        helper.make_node("AveragePool", ["r2"], ["p2"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                         strides=[1, 1]),
        helper.make_node("GlobalAveragePool", ["p2"], ["g"]),
        helper.make_node("Flatten", ["g"], ["fl"]),
        helper.make_node("Gemm", ["fl", "wf", "bf"], ["logits"], transB=1),
        helper.make_node("Softmax", ["logits"], ["y"], axis=-1),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            ["batch", 3, 17, 15])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5])],
                      inits)


@pytest.fixture
def transformer_block():
    """One pre-LN self-attention block with a GELU MLP, shapes from the input (seq free)."""
    rng = np.random.default_rng(2)
    d, h, f = 16, 2, 32
    r = lambda *s: (rng.standard_normal(s) * 0.2).astype(np.float32)  # noqa: E731
    inits = [_init("ln_s", 1 + r(d)), _init("ln_b", r(d)), _init("wq", r(d, d)),
             _init("wk", r(d, d)), _init("wv", r(d, d)), _init("wo", r(d, d)),
             _init("bo", r(d)), _init("w1", r(d, f)), _init("b1", r(f)), _init("w2", r(f, d)),
             _init("b2", r(d)), _init("heads", np.array([0, 0, h, d // h], np.int64)),
             _init("back", np.array([0, 0, d], np.int64)),
             _init("scale", np.array(np.sqrt(d // h), np.float32)),
             _init("half", np.array(0.5, np.float32)), _init("one", np.array(1.0, np.float32)),
             _init("rsqrt2", np.array(1 / np.sqrt(2), np.float32))]
    N = helper.make_node
    nodes = [
        N("LayerNormalization", ["x", "ln_s", "ln_b"], ["ln"], axis=-1, epsilon=1e-5),
        N("MatMul", ["ln", "wq"], ["q0"]), N("MatMul", ["ln", "wk"], ["k0"]),
        N("MatMul", ["ln", "wv"], ["v0"]),
        N("Reshape", ["q0", "heads"], ["q1"]), N("Transpose", ["q1"], ["q"], perm=[0, 2, 1, 3]),
        N("Reshape", ["k0", "heads"], ["k1"]), N("Transpose", ["k1"], ["kt"], perm=[0, 2, 3, 1]),
        N("Reshape", ["v0", "heads"], ["v1"]), N("Transpose", ["v1"], ["v"], perm=[0, 2, 1, 3]),
        N("MatMul", ["q", "kt"], ["s0"]), N("Div", ["s0", "scale"], ["s1"]),
        N("Softmax", ["s1"], ["p"], axis=-1), N("MatMul", ["p", "v"], ["a0"]),
        N("Transpose", ["a0"], ["a1"], perm=[0, 2, 1, 3]), N("Reshape", ["a1", "back"], ["a2"]),
        N("MatMul", ["a2", "wo"], ["o0"]), N("Add", ["o0", "bo"], ["o1"]),
        N("Add", ["x", "o1"], ["res1"]),
        N("MatMul", ["res1", "w1"], ["m0"]), N("Add", ["m0", "b1"], ["m1"]),
        N("Mul", ["m1", "rsqrt2"], ["g0"]), N("Erf", ["g0"], ["g1"]),
        N("Add", ["g1", "one"], ["g2"]),
        N("Mul", ["m1", "g2"], ["g3"]), N("Mul", ["g3", "half"], ["g4"]),
        N("MatMul", ["g4", "w2"], ["m2"]), N("Add", ["m2", "b2"], ["m3"]),
        N("Add", ["res1", "m3"], ["y"]),
    ]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            ["batch", "seq", d])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                                     ["batch", "seq", d])], inits)


def _x_conv(batch=2, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, 3, 17, 15)).astype(np.float32)


def _x_tr(batch=2, seq=7, seed=0):
    return np.random.default_rng(seed).standard_normal((batch, seq, 16)).astype(np.float32)


# -- results ----------------------------------------------------------------------------

@_requires("Conv", "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool",
           "Flatten", "Gemm", "Softmax")
@pytest.mark.parametrize("optimize", [True, False])
def test_conv_net_matches_onnxruntime(conv_net, optimize):
    sess = kiln.InferenceSession(conv_net, backend="torch", optimize=optimize)
    for batch in (1, 3):
        x = _x_conv(batch, batch)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(conv_net, {"x": x})[0],
                                   rtol=1e-4, atol=1e-5)
    rep = sess.placement()
    assert not rep.fallbacks, str(rep)
    assert rep.last_run.transfers == 0


def test_mlp_matches_onnxruntime(mlp_model):
    sess = kiln.InferenceSession(mlp_model, backend="torch")
    x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(mlp_model, {"x": x})[0],
                               rtol=1e-5, atol=1e-6)


@_requires("LayerNormalization", "MatMul", "Reshape", "Transpose", "Softmax", "Erf")
@pytest.mark.parametrize("optimize", [True, False])
def test_transformer_block_matches_onnxruntime(transformer_block, optimize):
    sess = kiln.InferenceSession(transformer_block, backend="torch", optimize=optimize)
    for seq in (5, 9):
        x = _x_tr(2, seq)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0],
                                   ort_run(transformer_block, {"x": x})[0], rtol=1e-4,
                                   atol=1e-5)
    assert not sess.placement().fallbacks


def test_inspect_shows_exactly_the_layers_a_torch_session_runs(transformer_block, conv_net):
    """What the torch backend can run is known without constructing it, so inspecting the
    optimized model for torch and a torch session fuse the same layers."""
    for model in (transformer_block, conv_net):
        summary = kiln.inspect(kiln.optimize(kiln.load(model), backend="torch"),
                               backend="torch")
        sess = kiln.InferenceSession(model, backend="torch")
        assert [x.op_type for x in summary.layers] == [s.node.op_type for s in sess.plan.steps]
        assert [x.how for x in summary.layers] == [s.placement for s in sess.plan.steps]
        assert any(x.domain == "ai.kiln" for x in summary.layers)  # fused ops did appear


# -- torch in, torch out ----------------------------------------------------------------

def test_torch_feeds_and_torch_outputs(mlp_model):
    sess = kiln.InferenceSession(mlp_model, backend="torch")
    x = np.random.default_rng(3).standard_normal((4, 4)).astype(np.float32)
    want = ort_run(mlp_model, {"x": x})[0]
    y = sess.run(None, {"x": torch.from_numpy(x)}, output_type="torch")[0]
    assert isinstance(y, torch.Tensor) and y.device.type == "cpu" and y.dtype == torch.float32
    np.testing.assert_allclose(y.numpy(), want, rtol=1e-5, atol=1e-6)
    # NumPy outputs by default, torch feeds or not
    (y2,) = sess.run(["y"], {"x": torch.from_numpy(x)})
    assert isinstance(y2, np.ndarray)
    np.testing.assert_allclose(y2, want, rtol=1e-5, atol=1e-6)


def test_zero_copy_io_and_dlpack():
    m = make_model([helper.make_node("Identity", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    sess = kiln.InferenceSession(m, backend="torch", optimize=False)
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    y = sess.run(None, {"x": x}, output_type="torch")[0]
    assert y.data_ptr() == x.ctypes.data  # NumPy feed shared, not copied
    z = torch.from_dlpack(y)  # the output speaks DLPack
    assert z.data_ptr() == y.data_ptr()
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    (back,) = sess.run(None, {"x": t})
    assert back.ctypes.data == t.data_ptr()  # NumPy output is a view of the tensor
    cap = np.asarray(back)  # any DLPack producer is a valid feed
    np.testing.assert_array_equal(sess.run(None, {"x": cap})[0], t.numpy())


def test_wrong_feed_dtype_is_an_input_error(mlp_model):
    sess = kiln.InferenceSession(mlp_model, backend="torch")
    with pytest.raises(kiln.InputError, match="expects"):
        sess.run(None, {"x": torch.zeros((2, 4), dtype=torch.float64)})


def test_concurrent_runs_from_threads(mlp_model):
    from concurrent.futures import ThreadPoolExecutor
    sess = kiln.InferenceSession(mlp_model, backend="torch")
    xs = [np.random.default_rng(i).standard_normal((i + 1, 4)).astype(np.float32)
          for i in range(8)]
    want = [ort_run(mlp_model, {"x": x})[0] for x in xs]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda x: sess.run(None, {"x": x})[0], xs * 3))
    for i, g in enumerate(got):
        np.testing.assert_allclose(g, want[i % len(xs)], rtol=1e-5, atol=1e-6)


# -- async ------------------------------------------------------------------------------

def test_async_runs_keep_order_and_several_are_in_flight(mlp_model):
    sess = kiln.InferenceSession(mlp_model, backend="torch")
    xs = [np.random.default_rng(i).standard_normal((i + 1, 4)).astype(np.float32)
          for i in range(12)]
    handles = [sess.run_async(None, {"x": x}) for x in xs]  # all queued before any wait
    assert all(hasattr(h, "done") for h in handles)
    for x, h in zip(xs, handles):
        (y,) = h.result(timeout=60)
        assert h.done()
        np.testing.assert_allclose(y, ort_run(mlp_model, {"x": x})[0], rtol=1e-5, atol=1e-6)


def test_async_order_is_submission_order():
    """A slow run first and a fast one second: the second cannot finish before the first."""
    finished = []

    def slow_tag(x, *, tag=0):
        if tag == 0:
            time.sleep(0.3)
        finished.append(tag)
        return x.copy()

    kiln.register_op("test.torch", "SlowTag", slow_tag)
    m = make_model([helper.make_node("SlowTag", ["x"], ["y"], domain="test.torch")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                   custom=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        sess = kiln.InferenceSession(m, backend="torch", optimize=False)
    x = np.ones(2, np.float32)
    h1 = sess.run_async(None, {"x": x})
    h2 = sess.run_async(None, {"x": x * 2})
    assert not h2.done()  # returned at once, still queued behind the slow run
    np.testing.assert_array_equal(h2.result(timeout=30)[0], x * 2)
    assert h1.done()
    assert finished == [0, 0]


def test_async_errors_bad_feeds_raise_at_submit_and_kernel_errors_at_result(mlp_model):
    sess = kiln.InferenceSession(mlp_model, backend="torch")
    with pytest.raises(kiln.InputError):
        sess.run_async(None, {"nope": np.zeros((1, 4), np.float32)})

    def boom(x):
        raise ValueError("kaput")

    kiln.register_op("test.torch", "Boom", boom)
    m = make_model([helper.make_node("Boom", ["x"], ["y"], domain="test.torch")],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                   custom=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        bad = kiln.InferenceSession(m, backend="torch", optimize=False)
    h = bad.run_async(None, {"x": np.ones(2, np.float32)})
    with pytest.raises(kiln.KernelError, match="kaput"):
        h.result(timeout=30)
    assert h.done()


def test_async_torch_outputs_and_readback(mlp_model):
    sess = kiln.InferenceSession(mlp_model, backend="torch")
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    h = sess.run_async(None, {"x": x}, output_type="torch")
    rb = h.readback()
    (t,) = h.result(timeout=30)
    assert isinstance(t, torch.Tensor)
    (a,) = rb.result(timeout=30)
    assert isinstance(a, np.ndarray) and rb.done()
    np.testing.assert_allclose(a, t.numpy())


# -- CPU fallback -----------------------------------------------------------------------

def _fallback_model():
    """Relu -> a custom op that only has a NumPy kernel -> Add: two device<->host hops."""
    def cumulative_max(x):
        return np.maximum.accumulate(x, axis=-1)

    kiln.register_op("test.torch", "CumMax", cumulative_max)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("CumMax", ["r"], ["c"], domain="test.torch", name="cummax"),
             helper.make_node("Add", ["c", "x"], ["y"], name="add")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 5])],
                      custom=True)


def test_fallback_op_runs_on_numpy_is_reported_and_warned_once():
    m = _fallback_model()
    with pytest.warns(FallbackWarning, match="CumMax") as rec:
        sess = kiln.InferenceSession(m, backend="torch", optimize=False)
    assert len([w for w in rec if issubclass(w.category, FallbackWarning)]) == 1
    x = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FallbackWarning)  # never again on run
        (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, np.maximum.accumulate(np.maximum(x, 0), axis=-1) + x,
                               rtol=1e-6)
    rep = sess.placement()
    by_name = {lp.name: lp for lp in rep.layers}
    assert by_name["cummax"].how == "cpu-fallback" and by_name["cummax"].where == "cpu"
    assert "NumPy kernel" in by_name["cummax"].why
    assert by_name["relu"].how == "torch" and by_name["add"].how == "torch-generic"
    assert [lp.name for lp in rep.fallbacks] == ["cummax"]
    # On the CPU the NumPy kernel reads and writes the tensors' memory: nothing crosses a
    # device, so nothing counts as a transfer.
    assert rep.last_run.transfers == 0
    assert rep.last_run.fallback_calls == 1
    assert "cummax" in str(rep)


@pytest.mark.skipif(not _has("NonZero"), reason="no NumPy NonZero kernel yet")
def test_fallback_with_a_standard_op_torch_lacks_matches_onnxruntime():
    """NonZero has no torch kernel (its output size depends on the data): NumPy runs it."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("NonZero", ["r"], ["nz"]),
             helper.make_node("Cast", ["nz"], ["y"], to=TensorProto.FLOAT)]
    m = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    with pytest.warns(FallbackWarning, match="NonZero"):
        sess = kiln.InferenceSession(m, backend="torch")
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], ort_run(m, {"x": x})[0])
    assert [lp.op_type for lp in sess.placement().fallbacks] == ["NonZero"]
    assert sess.placement().last_run.transfers == 0  # CPU tensors <-> NumPy: no device crossed
    assert sess.placement().last_run.fallback_calls == 1


def test_string_values_stay_numpy():
    """Strings have no torch type: they stay NumPy arrays and string ops run on NumPy."""
    if not _has("StringNormalizer"):
        pytest.skip("no NumPy StringNormalizer kernel yet")
    m = make_model([helper.make_node("StringNormalizer", ["s"], ["t"],
                                     case_change_action="UPPER")],
                   [helper.make_tensor_value_info("s", TensorProto.STRING, [3])],
                   [helper.make_tensor_value_info("t", TensorProto.STRING, None)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        sess = kiln.InferenceSession(m, backend="torch")
    s = np.array(["a", "bC", "d"], dtype=object)
    assert list(sess.run(None, {"s": s})[0]) == ["A", "BC", "D"]


# -- host-pinned values -----------------------------------------------------------------

def _shape_model():
    """y = Reshape(x, [Shape(x)[0], -1]): shape arithmetic the optimizer pins to the host."""
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
             helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"]),
             helper.make_node("Concat", ["n1", "minus1"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y0"]),
             helper.make_node("Relu", ["y0"], ["y"])]
    inits = [_init("zero", np.array(0, np.int64)), _init("ax0", np.array([0], np.int64)),
             _init("minus1", np.array([-1], np.int64))]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                            ["batch", 3, 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)


@_requires("Shape", "Gather", "Unsqueeze", "Concat", "Reshape")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_host_pinned_shape_values_cause_no_transfers(device):
    sess = kiln.InferenceSession(_shape_model(), backend="torch", device=device)
    host = [v.name for v in _all_values(sess) if v.meta.get("host")]
    assert host, "the optimizer pins the shape arithmetic to the host"
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, np.maximum(x.reshape(2, -1), 0))
    rep = sess.placement()
    assert rep.last_run.transfers == 0 and rep.last_run.fallback_calls == 0
    assert not rep.fallbacks
    # every host value really lives on the host
    seen = {}
    with torch.inference_mode():
        sess.plan.run([sess.backend.accept_feed(x, kiln.DType.FLOAT)],
                      observer=lambda s, t0, t1, r: seen.update({s.outputs[0].name: r}))
    for name in host:
        if name in seen:
            assert seen[name].device.type == "cpu", name


def test_host_values_from_a_numpy_kernel_are_not_transfers():
    """A host-resident value computed by a NumPy-only kernel stays on the host: no copy."""
    def shape_plus_zero(s):
        return np.asarray(s, np.int64) + 0

    kiln.register_op("test.torch", "ShapeCopy", shape_plus_zero)
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ShapeCopy", ["s"], ["s2"], domain="test.torch"),
             helper.make_node("Reshape", ["x", "s2"], ["y"])]
    onnx_model = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                  [2, 3])],
                            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
                            custom=True)
    model = kiln.load(onnx_model.SerializeToString())
    for n in model.graph.nodes:
        if n.op_type != "Reshape":
            n.outputs[0].meta["host"] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        sess = kiln.InferenceSession(model, backend="torch", optimize=False)
    x = np.ones((2, 3), np.float32)
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], x)
    st = sess.placement().last_run
    assert st.fallback_calls == 1 and st.transfers == 0


def _all_values(sess):
    g = sess.model.graph
    vals = set(g.inputs) | set(g.initializers.values())
    for n in g.nodes:
        vals.update(v for v in n.outputs if v is not None)
    return vals


# -- precision, threads, compile --------------------------------------------------------

@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_reduced_precision_keeps_fp32_io(mlp_model, precision):
    sess = kiln.InferenceSession(mlp_model, backend="torch", precision=precision)
    x = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)
    (y,) = sess.run(None, {"x": x})
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, ort_run(mlp_model, {"x": x})[0], atol=3e-2)
    assert any("computes in" in lp.why for lp in sess.placement().layers)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_a_precision_this_cpu_lacks_warns(mlp_model, precision):
    """A reduced precision without native arithmetic on this CPU (torch's oneDNN says
    which it has) runs in reference kernels, 9-192x slower for fp16: the session says so."""
    from kiln.runtime.torch_backend import PrecisionWarning

    has = {"bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported,
           "fp16": torch.ops.mkldnn._is_mkldnn_fp16_supported}[precision]()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        kiln.InferenceSession(mlp_model, backend="torch", precision=precision)
    said = [str(w.message) for w in seen if issubclass(w.category, PrecisionWarning)]
    assert len(said) == (0 if has else 1), said
    assert all(f"no native {precision}" in m and "use " in m for m in said)


@_requires("Conv", "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool")
def test_reduced_precision_conv_net(conv_net):
    sess = kiln.InferenceSession(conv_net, backend="torch", precision="bf16")
    x = _x_conv(2)
    (y,) = sess.run(None, {"x": x})
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, ort_run(conv_net, {"x": x})[0], atol=3e-2)


def test_bad_options_are_clear():
    with pytest.raises(ValueError, match="precision"):
        kiln.InferenceSession(_shape_model(), backend="torch", precision="int3")
    with pytest.raises(ValueError, match="device"):
        kiln.InferenceSession(_shape_model(), backend="torch", device="tpu")
    with pytest.raises(ValueError, match="tf32.*device='cuda'"):
        kiln.InferenceSession(_shape_model(), backend="torch", precision="tf32")
    if not CUDA:
        with pytest.raises(kiln.KilnError, match="CUDA"):
            kiln.InferenceSession(_shape_model(), backend="torch", device="cuda")


def test_threads_option_sets_torch_threads(mlp_model):
    before = torch.get_num_threads()
    try:
        kiln.InferenceSession(mlp_model, backend="torch", threads=1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_compile_runs_one_program_and_matches(mlp_model, monkeypatch):
    # The in-memory torch.compile path (CUDA's, and the CPU's with the disk cache off);
    # tests/runtime/test_compile_cache.py covers the CPU's AOTInductor packages.
    monkeypatch.setenv("KILN_COMPILE_CACHE", "0")
    sess = kiln.InferenceSession(mlp_model, backend="torch", compile=True)
    assert sess.placement().compiled.startswith("yes")
    for batch in (2, 5):
        for seed in (batch, batch + 10):  # the first run of a shape compiles; later ones not
            x = np.random.default_rng(seed).standard_normal((batch, 4)).astype(np.float32)
            np.testing.assert_allclose(sess.run(None, {"x": x})[0],
                                       ort_run(mlp_model, {"x": x})[0], rtol=1e-5, atol=1e-6)
            assert sess.placement().last_run.compiled


@pytest.mark.parametrize("cache", ["disk", "off"])
def test_compile_in_bf16_builds_one_program(mlp_model, monkeypatch, tmp_path, cache):
    """Reduced precision compiles too, on AOTInductor's path (cache on disk) and
    torch.compile's: a bf16 copy of a weight made in prepare used to become a lifted
    constant AOTInductor failed on, and the session then ran eagerly."""
    monkeypatch.setenv("KILN_COMPILE_CACHE", str(tmp_path) if cache == "disk" else "0")
    sess = kiln.InferenceSession(mlp_model, backend="torch", precision="bf16", compile=True)
    for seed in (0, 1):
        x = np.random.default_rng(seed).standard_normal((3, 4)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0],
                                   ort_run(mlp_model, {"x": x})[0], atol=3e-2)
        assert sess.placement().last_run.compiled
    assert sess.placement().compiled.startswith("yes"), sess.placement().compiled


def test_compile_takes_positions_computed_from_the_input(monkeypatch, tmp_path):
    """RoBERTa's position ids, as exported: a CumSum over the non-padding tokens whose axis
    is a constant the dynamo exporter also adds elsewhere, then gathers at the computed
    positions (GatherElements; GatherND as the dynamo export's mask code does). Each used
    to read a value on the host while tracing (the axis; the gathers' range checks), so the
    whole model ran eagerly with compile=True."""
    monkeypatch.setenv("KILN_COMPILE_CACHE", str(tmp_path))
    i64 = TensorProto.INT64
    nodes = [helper.make_node("Equal", ["ids", "pad"], ["is_pad"]),
             helper.make_node("Not", ["is_pad"], ["real"]),
             helper.make_node("Cast", ["real"], ["r"], to=TensorProto.INT32),
             helper.make_node("CumSum", ["r", "one"], ["c"]),
             helper.make_node("Mul", ["c", "r"], ["cm"]),
             helper.make_node("Cast", ["cm"], ["pos0"], to=i64),
             helper.make_node("Add", ["pos0", "one"], ["pos"]),
             helper.make_node("GatherElements", ["table", "pos"], ["y"], axis=1),
             helper.make_node("Unsqueeze", ["pos", "last"], ["pos_nd"]),
             helper.make_node("GatherND", ["table", "pos_nd"], ["y_nd"], batch_dims=1)]
    rng = np.random.default_rng(0)
    out = [helper.make_tensor_value_info(n, i64, [2, 6]) for n in ("y", "y_nd")]
    model = make_model(nodes, [helper.make_tensor_value_info("ids", i64, [2, 6]),
                               helper.make_tensor_value_info("table", i64, [2, 9])], out,
                       [_init("pad", np.int64(1)), _init("one", np.int64(1)),
                        _init("last", np.array([-1], np.int64))])
    sess = kiln.InferenceSession(model, backend="torch", compile=True)
    for seed in (0, 1):
        feeds = {"ids": rng.integers(0, 4, (2, 6)).astype(np.int64),
                 "table": rng.integers(-50, 50, (2, 9)).astype(np.int64) + seed}
        for got, want in zip(sess.run(None, feeds), ort_run(model, feeds)):
            np.testing.assert_array_equal(got, want)
        assert sess.placement().last_run.compiled, sess.placement().compiled


@_requires("Conv", "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool")
def test_compiled_conv_net_in_bf16_is_one_graph(conv_net, monkeypatch):
    """torch.compile traces the whole model as one graph: a kernel reading a NumPy constant
    inside its run (rather than in prepare) breaks it into pieces, one per layer."""
    monkeypatch.setenv("KILN_COMPILE_CACHE", "0")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    sess = kiln.InferenceSession(conv_net, backend="torch", precision="bf16", compile=True)
    x = _x_conv(2)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(conv_net, {"x": x})[0],
                               atol=3e-2)
    assert sess.placement().last_run.compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, \
        dict(torch._dynamo.utils.counters["stats"])


def test_compile_falls_back_to_eager_with_a_warning():
    with pytest.warns(CompileWarning, match="running eagerly"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FallbackWarning)
            sess = kiln.InferenceSession(_fallback_model(), backend="torch", compile=True,
                                         optimize=False)
    assert sess.placement().compiled.startswith("no")
    x = np.ones((2, 5), np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], 2 * x)
    assert not sess.placement().last_run.compiled


# -- CUDA -------------------------------------------------------------------------------

@needs_cuda
@_requires("Conv", "BatchNormalization", "MaxPool", "AveragePool", "GlobalAveragePool")
def test_cuda_conv_net_matches_onnxruntime(conv_net):
    """fp32 means fp32 on a GPU too: torch's default TF32 convolutions (10-bit products)
    are off while Kiln runs, and the caller's switch is as it was afterwards."""
    before = (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    sess = kiln.InferenceSession(conv_net, backend="torch", device="cuda")
    x = _x_conv(2)
    y = sess.run(None, {"x": x}, output_type="torch")[0]
    assert y.is_cuda
    want = ort_run(conv_net, {"x": x})[0]
    np.testing.assert_allclose(y.cpu().numpy(), want, rtol=1e-5, atol=1e-5)
    assert sess.placement().last_run.transfers == 0
    assert (torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) == before
    tf32 = kiln.InferenceSession(conv_net, backend="torch", device="cuda", precision="tf32")
    np.testing.assert_allclose(tf32.run(None, {"x": x})[0], want, rtol=1e-2, atol=1e-2)


@needs_cuda
def test_cuda_feeds_on_device_and_async_readback(mlp_model):
    sess = kiln.InferenceSession(mlp_model, backend="torch", device="cuda")
    xs = [torch.randn(3, 4, device="cuda") for _ in range(6)]
    hs = [sess.run_async(None, {"x": x}, output_type="torch") for x in xs]
    rbs = [h.readback() for h in hs]
    for x, h, rb in zip(xs, hs, rbs):
        (t,) = h.result()
        assert t.is_cuda
        (a,) = rb.result()
        np.testing.assert_allclose(a, ort_run(mlp_model, {"x": x.cpu().numpy()})[0],
                                   rtol=1e-4, atol=1e-5)
        assert rb.done()


@needs_cuda
def test_cuda_fallback_counts_transfers():
    with pytest.warns(FallbackWarning):
        sess = kiln.InferenceSession(_fallback_model(), backend="torch", device="cuda",
                                     optimize=False)
    x = np.ones((2, 5), np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], 2 * x)
    rep = sess.placement()
    # Relu's output goes down to the NumPy kernel, whose result goes back up: two crossings
    # (the feed's upload and the output's readback are the caller's, not the model's)
    assert rep.last_run.transfers == 2
    assert rep.last_run.fallback_calls == 1
    assert [f.name for f in rep.fallbacks] == ["cummax"]


@needs_cuda
def test_cuda_compile_with_cuda_graphs(mlp_model):
    """Each replay overwrites the graph's memory: an output held from an earlier run
    keeps its own values."""
    sess = kiln.InferenceSession(mlp_model, backend="torch", device="cuda", compile=True)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 4)).astype(np.float32) for _ in range(4)]
    held = [sess.run(None, {"x": torch.from_numpy(x).cuda()}, output_type="torch")[0]
            for x in xs]
    for x, y in zip(xs, held):
        np.testing.assert_allclose(y.cpu().numpy(), ort_run(mlp_model, {"x": x})[0],
                                   rtol=1e-4, atol=1e-5)
    assert sess.placement().last_run.compiled


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_a_failing_kernel_names_its_layer_and_nothing_runs_twice(backend):
    """The straight-line program reports the failing layer from its traceback: the model
    is not re-run to find it, so each kernel ran exactly once."""
    calls = {"before": 0, "boom": 0}

    def before(x):
        calls["before"] += 1
        return x + 1

    def boom(x):
        calls["boom"] += 1
        raise ValueError("kaput")

    kiln.register_op("test.torch", "Before", before)
    kiln.register_op("test.torch", "Boom", boom)
    nodes = [helper.make_node("Before", ["x"], ["a"], domain="test.torch", name="first"),
             helper.make_node("Boom", ["a"], ["b"], domain="test.torch", name="the_culprit"),
             helper.make_node("Relu", ["b"], ["y"], name="after")]
    m = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], custom=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        sess = kiln.InferenceSession(m, backend=backend, optimize=False)
    assert sess.plan.program is not None  # runs as the straight-line program
    with pytest.raises(kiln.KernelError, match=r"'the_culprit' \(Boom\).*kaput"):
        sess.run(None, {"x": np.ones(2, np.float32)})
    assert calls == {"before": 1, "boom": 1}


def _residual_conv_net():
    """Conv+Add+Relu (the FusedConv residual post-op), Conv+LeakyRelu, Conv with
    asymmetric pads, a bias-free Conv: each a different oneDNN path."""
    rng = np.random.default_rng(3)

    def w(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3,
                                       name)
    N = helper.make_node
    nodes = [N("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
             N("Add", ["c1", "x"], ["r1"]), N("Relu", ["r1"], ["a1"]),
             N("Conv", ["a1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
             N("LeakyRelu", ["c2"], ["a2"], alpha=0.1),
             N("Conv", ["a2", "w3"], ["c3"], pads=[0, 1, 1, 0])]
    return _make_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 8, "h", "w"])],
        [helper.make_tensor_value_info("c3", TensorProto.FLOAT, None)],
        [w("w1", 8, 8, 3, 3), w("b1", 8), w("w2", 16, 8, 3, 3), w("b2", 16),
         w("w3", 4, 16, 2, 2)])


@_requires("Conv")
def test_onednn_packed_convolutions_match_onnxruntime(monkeypatch):
    """The packed-weight oneDNN path is the default on x86 CPUs; forced here so it is checked
    on every machine. Weights are packed per input shape, so new batch sizes and image
    sizes must give onnxruntime's results too."""
    from kiln.ops.torch import conv

    if not torch.backends.mkldnn.is_available():
        pytest.skip("torch built without oneDNN")
    monkeypatch.setattr(conv, "PREPACK", True)
    model = _residual_conv_net()
    sess = kiln.InferenceSession(model, backend="torch")
    notes = " ".join(layer.why for layer in sess.placement().layers)
    assert "oneDNN, weights reordered once" in notes and "post-op" in notes, notes
    for n, size in ((1, 9), (2, 9), (1, 12), (3, 7)):
        x = np.random.default_rng(n).standard_normal((n, 8, size, size)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(model, {"x": x})[0],
                                   rtol=1e-4, atol=1e-4)


@_requires("PRelu")
@pytest.mark.parametrize("x_shape, slope_shape", [
    ((2, 5, 4, 4), (5, 1, 1)), ((2, 5, 4, 4), (1, 5, 1, 1)), ((2, 5), (5,)), ((3, 5), (1,)),
    ((2, 5, 4, 4), ()), ((2, 5, 4, 4), (4,)), ((2, 5, 4, 4), (5, 4, 1)), ((4,), (4,))])
def test_prelu_matches_onnxruntime_for_every_slope_shape(x_shape, slope_shape):
    """The torch PRelu kernel takes one slope or one per channel (F.prelu); slopes that
    broadcast otherwise run the generic kernel. Both give onnxruntime's results, on NHWC
    inputs too (the layout convolutions hand it)."""
    rng = np.random.default_rng(len(x_shape) * 10 + len(slope_shape))
    slope = rng.standard_normal(slope_shape).astype(np.float32)
    model = _make_model(
        [helper.make_node("PRelu", ["x", "s"], ["y"])],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(slope, "s")])
    x = rng.standard_normal(x_shape).astype(np.float32)
    got = kiln.InferenceSession(model, backend="torch").run(None, {"x": x})[0]
    np.testing.assert_allclose(got, ort_run(model, {"x": x})[0], rtol=1e-6, atol=1e-6)
    if len(x_shape) == 4:
        t = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)
        got = kiln.InferenceSession(model, backend="torch").run(
            None, {"x": t}, output_type="torch")[0]
        np.testing.assert_allclose(got.numpy(), ort_run(model, {"x": x})[0],
                                   rtol=1e-6, atol=1e-6)


def _pool_case(op: str, x_shape: tuple, attrs: dict):
    """A one-node pooling model ``x -> y`` and a random input for it."""
    model = _make_model(
        [helper.make_node(op, ["x"], ["y"], **attrs)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    rng = np.random.default_rng(len(x_shape) + len(attrs))
    return model, rng.standard_normal(x_shape).astype(np.float32)


@pytest.mark.parametrize("x_shape, attrs", [
    ((2, 3, 8, 8), dict(kernel_shape=[2, 2], strides=[2, 2])),
    ((2, 3, 7, 9), dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1)),
    ((1, 4, 6, 5), dict(kernel_shape=[2, 2], pads=[1, 0, 0, 1])),
    ((1, 4, 6, 5), dict(kernel_shape=[2, 2], auto_pad="SAME_LOWER")),
    ((1, 2, 9, 9), dict(kernel_shape=[2, 2], strides=[3, 2], dilations=[2, 3])),
    ((1, 5, 6, 6), dict(kernel_shape=[1, 3], strides=[1, 2], pads=[0, 1, 0, 1])),
    ((2, 3, 11), dict(kernel_shape=[3], strides=[2], ceil_mode=1)),
    ((1, 2, 4, 5, 6), dict(kernel_shape=[1, 2, 2], strides=[1, 2, 2])),
    ((2, 3, 9, 8), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])),  # ResNet's
    ((1, 3, 7, 7), dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 2, 1, 0], ceil_mode=1)),
    ((1, 2, 4, 6), dict(kernel_shape=[2, 3], strides=[2, 2], pads=[1, 0, 1, 2]))])
def test_small_max_pools_match_onnxruntime(x_shape, attrs, monkeypatch):
    """Max-pools of windows up to 3x3 run as maxima over strided views of the input, one
    axis at a time (not torch's max-pool; every input size here): padding, ceil mode,
    dilation and 1-D to 3-D windows give onnxruntime's results, on NHWC inputs too, and
    so do windows that leave it to torch's pool (outputs seeing only padding along an
    axis)."""
    from kiln.ops.torch import pool

    monkeypatch.setattr(pool, "_VIEW_POOL_MIN", 0)
    model, x = _pool_case("MaxPool", x_shape, attrs)
    want = ort_run(model, {"x": x})[0]
    sess = kiln.InferenceSession(model, backend="torch")
    assert not sess.placement().fallbacks
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], want)
    if len(x_shape) == 4:
        t = torch.from_numpy(x).contiguous(memory_format=torch.channels_last)
        np.testing.assert_array_equal(
            sess.run(None, {"x": t}, output_type="torch")[0].numpy(), want)


@pytest.mark.parametrize("batch", [1, 4])  # the strided views' size range, and past it
def test_resnet_max_pool_with_infinities_matches_the_oracles(batch):
    """ResNet's first pool on NHWC activations: the views (batch 1) and torch's pool
    (batch 4, past the views' range) give onnxruntime's result; with +inf and a window of
    -inf only, the cheap NaN check (a sum, NaN for +inf and -inf together) sends the
    result to the NumPy kernel, which gives onnx.reference's (onnxruntime's is the lowest
    float32 for that window, not -inf); NaNs are skipped as the reference skips them."""
    from onnx.reference import ReferenceEvaluator

    model, x = _pool_case("MaxPool", (batch, 64, 112, 112),
                          dict(kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1]))
    x_inf = x.copy()
    x_inf[0, 0, :2, :2] = -np.inf  # output (0, 0)'s window sees only these and padding
    x_inf[-1, -1, 50, 50] = np.inf
    want_inf = ReferenceEvaluator(model).run(None, {"x": x_inf})[0]
    assert np.isneginf(want_inf).any() and np.isposinf(want_inf).any()
    sess = kiln.InferenceSession(model, backend="torch")
    for arr, want in ((x, ort_run(model, {"x": x})[0]), (x_inf, want_inf)):
        t = torch.from_numpy(arr).contiguous(memory_format=torch.channels_last)
        np.testing.assert_array_equal(
            sess.run(None, {"x": t}, output_type="torch")[0].numpy(), want)
        np.testing.assert_array_equal(sess.run(None, {"x": arr})[0], want)
    # NaNs are skipped (no window here is all NaN): the reference's numbers, no NaN out.
    # (onnxruntime's pool at this size gives a smaller number than the window's largest
    # in half the windows holding a NaN: no oracle for this.)
    x_nan = x.copy()
    x_nan[:, :, ::3, ::2] = np.nan
    want = ReferenceEvaluator(model).run(None, {"x": x_nan})[0]
    seen = ~np.isnan(want)
    t = torch.from_numpy(x_nan).contiguous(memory_format=torch.channels_last)
    for got in (sess.run(None, {"x": t}, output_type="torch")[0].numpy(),
                sess.run(None, {"x": x_nan})[0]):
        assert not np.isnan(got).any()
        np.testing.assert_array_equal(got[seen], want[seen])


@pytest.mark.parametrize("x_shape, attrs", [
    ((1, 3, 7, 7), dict(kernel_shape=[7, 7], pads=[0, 0, 1, 1])),  # Inception v1's last
    ((2, 3, 7, 7), dict(kernel_shape=[7, 7], pads=[0, 0, 1, 1], count_include_pad=1)),
    ((1, 2, 6, 5), dict(kernel_shape=[3, 2], strides=[2, 1], pads=[2, 0, 0, 1])),
    ((1, 2, 6, 5), dict(kernel_shape=[3, 3], pads=[2, 2, 2, 2], count_include_pad=1)),
    ((2, 3, 9), dict(kernel_shape=[3], strides=[2], pads=[0, 2])),
    ((1, 2, 4, 5, 6), dict(kernel_shape=[2, 2, 2], pads=[1, 0, 0, 0, 1, 1]))])
def test_average_pools_with_padding_torch_lacks_match_onnxruntime(x_shape, attrs):
    """Uneven pads, or pads over half the window, run on torch too (padded first, divided
    by each window's share inside the input unless count_include_pad): onnxruntime's
    results, no NumPy call (which would also cut a training module's gradient)."""
    model, x = _pool_case("AveragePool", x_shape, attrs)
    sess = kiln.InferenceSession(model, backend="torch")
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(model, {"x": x})[0],
                               rtol=1e-5, atol=1e-6)
    assert sess.backend.last_run_stats().fallback_calls == 0


def _random_initializer(rng, scale: float):
    """``w(name, *shape)``: a float32 initializer of normal values times ``scale``."""
    def w(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * scale,
                                       name)
    return w


def _count_packs(monkeypatch, reorder: str = "_reorder_linear_weight"
                 ) -> list[tuple[int, ...]]:
    """The shape of every weight packed from now on by oneDNN's ``reorder`` (the linear
    primitive's by default, (N, K))."""
    from kiln.ops.torch import conv

    if not conv.PREPACK:
        pytest.skip("oneDNN weight packing is used on x86 CPUs only")
    reorders: list[tuple[int, ...]] = []
    real = getattr(torch.ops.mkldnn, reorder)

    def counted(w, *args):
        reorders.append(tuple(w.shape))
        return real(w, *args)
    monkeypatch.setattr(torch.ops.mkldnn, reorder, counted)
    return reorders


@_requires("MatMul")
def test_packed_linear_layers_match_onnxruntime_and_pack_once_for_every_row_count(
        monkeypatch):
    """Products with a constant weight run through oneDNN's linear primitive with packed
    weights (the thresholds lowered here for small ones): a big weight at every call, a
    smaller one from a big enough product. Each weight is packed once, at its first packed
    call, and that pack gives onnxruntime's results for every row count, as does MKL for
    the calls below the thresholds."""
    from kiln.ops.torch import conv

    monkeypatch.setattr(conv, "_PACKED_WEIGHT", 300)  # w1 (16x24) is big; w2, wg are not
    monkeypatch.setattr(conv, "_PACKED_MACS", 2 * 6 * 24 * 8)
    reorders = _count_packs(monkeypatch)
    rng = np.random.default_rng(11)
    w = _random_initializer(rng, 0.2)
    N = helper.make_node
    nodes = [N("MatMul", ["x", "w1"], ["m1"]), N("Add", ["m1", "b1"], ["a1"]),
             N("Relu", ["a1"], ["r1"]), N("MatMul", ["r1", "w2"], ["y"])]
    model = _make_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, "s", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w("w1", 16, 24), w("b1", 24), w("w2", 24, 8)])
    sess = kiln.InferenceSession(model, backend="torch")
    assert reorders == [], reorders  # packs wait for the first run
    for seq in (5, 7, 1, 5, 64):  # w2: MKL at 5 and 1 rows a batch, packed at 7 and 64
        x = rng.standard_normal((2, seq, 16)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(model, {"x": x})[0],
                                   rtol=1e-4, atol=1e-5)
    assert reorders == [(24, 16), (8, 24)], reorders  # (N, K): each weight once

    gemm = _make_model(  # nn.Linear's export: B as (N, K), a bias scaled by beta
        [N("Gemm", ["x", "wg", "c"], ["y"], transB=1, beta=0.5)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [w("wg", 12, 16), w("c", 12)])
    sess = kiln.InferenceSession(gemm, backend="torch")
    for rows in (2, 64, 3):
        x = rng.standard_normal((rows, 16)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(gemm, {"x": x})[0],
                                   rtol=1e-4, atol=1e-5)
    assert reorders[2:] == [(12, 16)], reorders


@_requires("Conv")
def test_pointwise_convolutions_run_as_linear_layers_and_match_onnxruntime(monkeypatch):
    """1x1, stride-1, unpadded convolutions on NHWC activations run through oneDNN's
    linear primitive (with the activation fused, or the residual added inside it), each
    weight packed once; padded, strided or residual-plus-activation ones keep the
    convolution. All of them give onnxruntime's results."""
    from kiln.ops.torch import conv

    monkeypatch.setattr(conv, "_ROWS_MACS", 24_000_000)  # on AVX2 CPUs too (0 there)
    monkeypatch.setattr(conv, "_ROWS_PLAIN_MACS", 0)  # these small layers too
    _check_pointwise_model(monkeypatch, [(12, 5), (12, 12), (8, 12)])


@_requires("Conv")
def test_small_pointwise_convolutions_are_plain_products_and_match_onnxruntime(monkeypatch):
    """The same 1x1 layers under ``_ROWS_PLAIN_MACS`` run as MKL's plain product, with
    the activation and residual applied after it: no weight is packed, and the results
    are onnxruntime's."""
    from kiln.ops.torch import conv

    monkeypatch.setattr(conv, "_ROWS_MACS", 24_000_000)
    monkeypatch.setattr(conv, "_ROWS_PLAIN_MACS", 1 << 21)
    convs = _count_packs(monkeypatch, "_reorder_convolution_weight")
    _check_pointwise_model(monkeypatch, [])
    # only the padded, strided and residual-then-Relu layers (all 8x8) are convolutions
    assert convs and set(convs) == {(8, 8, 1, 1)}, convs


def _check_pointwise_model(monkeypatch, packs: list) -> None:
    reorders = _count_packs(monkeypatch)
    rng = np.random.default_rng(5)
    w = _random_initializer(rng, 0.3)
    N = helper.make_node
    nodes = [
        N("Conv", ["x", "w1", "b1"], ["c1"]), N("Relu", ["c1"], ["r1"]),          # + Relu
        N("Conv", ["r1", "w2", "b2"], ["c2"]), N("Add", ["c2", "r1"], ["a2"]),     # + residual
        N("Conv", ["a2", "w3"], ["c3"]), N("Clip", ["c3", "lo", "hi"], ["r3"]),    # ReLU6
        N("Conv", ["r3", "w4", "b4"], ["c4"], pads=[1, 1, 1, 1]),                  # padded
        N("Conv", ["c4", "w5", "b5"], ["c5"], strides=[2, 2]),                     # strided
        N("Conv", ["c5", "w6", "b6"], ["c6"]), N("Add", ["c6", "c5"], ["a6"]),
        N("Relu", ["a6"], ["y"]),                                    # residual, then Relu
    ]
    inits = [w("w1", 12, 5, 1, 1), w("b1", 12), w("w2", 12, 12, 1, 1), w("b2", 12),
             w("w3", 8, 12, 1, 1), w("w4", 8, 8, 1, 1), w("b4", 8), w("w5", 8, 8, 1, 1),
             w("b5", 8), w("w6", 8, 8, 1, 1), w("b6", 8),
             numpy_helper.from_array(np.array(0, np.float32), "lo"),
             numpy_helper.from_array(np.array(6, np.float32), "hi")]
    model = _make_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 5, 6, 7])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    sess = kiln.InferenceSession(model, backend="torch")
    for n in (1, 3, 1):
        x = rng.standard_normal((n, 5, 6, 7)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(model, {"x": x})[0],
                                   rtol=1e-4, atol=1e-5)
    assert reorders == packs, reorders  # (Cout, Cin): once each


@pytest.mark.parametrize("starts, ends, axes, steps", [
    ([0], [116], [1], None),                        # ShuffleNet's channel split
    ([-3, 1], [2**63 - 1, -1], [-1, 2], None),       # from the end, to "infinity"
    ([-100], [100], [0], [2]),                       # clamped both ways, a step
    ([5, -(2**63)], [2, 3], [1, 3], [1, 1]),         # empty, INT64_MIN clamped
    ([1], [-1], [1], [-1]),                          # negative step: the general path
])
def test_constant_slices_match_onnxruntime(starts, ends, axes, steps):
    """Slice with constant bounds indexes with a slice made once; onnxruntime decides."""
    from onnx import TensorProto, helper, numpy_helper

    from conftest import ort_run

    inits = [numpy_helper.from_array(np.array(v, np.int64), n)
             for n, v in (("s", starts), ("e", ends), ("a", axes)) + (
                 (("p", steps),) if steps else ())]
    node = helper.make_node("Slice", ["x", "s", "e", "a"] + (["p"] if steps else []), ["y"])
    graph = helper.make_graph([node], "slice",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                             [4, 232, 5, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    proto.ir_version = 8  # what older onnxruntime builds read too
    x = np.random.default_rng(0).normal(0, 1, (4, 232, 5, 6)).astype(np.float32)
    (got,) = kiln.InferenceSession(proto, backend="torch").run(None, {"x": x})
    np.testing.assert_array_equal(got, ort_run(proto, {"x": x})[0])


@pytest.mark.parametrize("x_shape, w_shape, attrs", [
    ((1, 3, 5, 5), (3, 4, 3, 3), dict(strides=[2, 2], pads=[0, 1, 1, 0])),
    ((2, 4, 4, 6), (4, 2, 3, 2), dict(strides=[2, 3], pads=[2, 0, 0, 1], group=2)),
    ((1, 2, 4, 4), (2, 3, 3, 3), dict(strides=[2, 2], pads=[1, 1, 0, 0],
                                     output_padding=[1, 1])),
    ((1, 2, 4, 4), (2, 3, 3, 3), dict(strides=[2, 2], pads=[1, 1, 1, 1],
                                     output_padding=[1, 0], dilations=[1, 2])),
    ((2, 3, 7), (3, 2, 4), dict(strides=[3], pads=[0, 2]))])
def test_conv_transpose_with_uneven_pads_and_bias_matches_onnxruntime(x_shape, w_shape, attrs):
    """ConvTranspose with a bias and pads torch's op cannot take (uneven begin and end) is
    computed in full and cropped to ONNX's output size on torch, not on NumPy."""
    rng = np.random.default_rng(len(attrs) + x_shape[1])
    w = rng.standard_normal(w_shape).astype(np.float32)
    b = rng.standard_normal(w_shape[1] * attrs.get("group", 1)).astype(np.float32)
    model = _make_model(
        [helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], **attrs)],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")])
    x = rng.standard_normal(x_shape).astype(np.float32)
    sess = kiln.InferenceSession(model, backend="torch")
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(model, {"x": x})[0],
                               rtol=1e-5, atol=1e-5)
    assert sess.backend.last_run_stats().fallback_calls == 0


def test_a_torch_kernel_declining_at_run_time_hands_the_call_on():
    """The straight-line program calls a layer's torch kernel directly (no guard): where
    it returns NotImplemented, the next kernel (here the NumPy one) takes the same call,
    once, for one- and two-output layers alike, and where the next kernel takes the
    layer's context."""
    from kiln.ir import TensorType

    calls = {"HalfSplit": 0, "Twice": 0, "Thrice": 0}

    def half_split(x):
        h = x.shape[-1] // 2
        return x[..., :h].copy(), x[..., h:].copy()

    def half_types(t):
        half = (*t.shape[:-1], t.shape[-1] // 2)
        return [TensorType(t.dtype, half), TensorType(t.dtype, half)]

    kiln.register_op("test.torch", "HalfSplit", half_split, half_types)
    kiln.register_op("test.torch", "Twice", lambda x: x * 2, lambda t: t)

    def thrice_reference(ctx, x):  # a NumPy kernel taking the context
        assert ctx.num_outputs == 1
        return x * 3

    kiln.register_op("test.torch", "Thrice", thrice_reference, lambda t: t)

    @registry.backend_kernel("torch", "HalfSplit", domain="test.torch")
    def half_split_torch(x):  # declines float64, as a kernel lacking a dtype does
        calls["HalfSplit"] += 1
        return NotImplemented if x.dtype == torch.float64 else tuple(x.chunk(2, -1))

    @registry.backend_kernel("torch", "Twice", domain="test.torch")
    def twice_torch(x):
        calls["Twice"] += 1
        return NotImplemented if x.dtype == torch.float64 else x * 2

    @registry.backend_kernel("torch", "Thrice", domain="test.torch")
    def thrice_torch(x):
        calls["Thrice"] += 1
        return NotImplemented if x.dtype == torch.float64 else x * 3

    for dtype, elem in ((np.float32, TensorProto.FLOAT), (np.float64, TensorProto.DOUBLE)):
        m = make_model([helper.make_node("HalfSplit", ["x"], ["a", "b"], domain="test.torch"),
                        helper.make_node("Twice", ["x"], ["y"], domain="test.torch"),
                        helper.make_node("Thrice", ["x"], ["z"], domain="test.torch")],
                       [helper.make_tensor_value_info("x", elem, [2, 6])],
                       [helper.make_tensor_value_info("a", elem, None),
                        helper.make_tensor_value_info("y", elem, None),
                        helper.make_tensor_value_info("z", elem, None)], custom=True)
        sess = kiln.InferenceSession(m, backend="torch", optimize=False)
        x = np.arange(12, dtype=dtype).reshape(2, 6)
        calls.update(HalfSplit=0, Twice=0, Thrice=0)
        a, y, z = sess.run(None, {"x": x})
        assert a.dtype == dtype and y.dtype == dtype and z.dtype == dtype
        np.testing.assert_array_equal(a, x[:, :3])
        np.testing.assert_array_equal(y, x * 2)
        np.testing.assert_array_equal(z, x * 3)
        assert calls == {"HalfSplit": 1, "Twice": 1, "Thrice": 1}
        declined = dtype == np.float64
        assert sess.backend.last_run_stats().fallback_calls == (3 if declined else 0)


def test_cuda_runs_set_the_numeric_switches_and_give_them_back():
    """torch's TF32 switches are process-wide: while Kiln runs on
    CUDA they say what the session's precision means, and afterwards they are the caller's
    again, whichever of torch's two APIs the caller used (the switches exist without a GPU)."""
    from kiln.runtime.torch_backend import _cuda_run

    dnn, mm = torch.backends.cudnn, torch.backends.cuda.matmul
    before = (dnn.allow_tf32, mm.allow_tf32)
    try:
        dnn.allow_tf32, mm.allow_tf32 = True, False
        with _cuda_run("ieee"):
            with _cuda_run("ieee"):  # a second run in flight
                pass
            assert (dnn.allow_tf32, mm.allow_tf32) == (False, False)
        assert (dnn.allow_tf32, mm.allow_tf32) == (True, False)
        with _cuda_run("tf32"):
            assert (dnn.allow_tf32, mm.allow_tf32) == (True, True)
        assert (dnn.allow_tf32, mm.allow_tf32) == (True, False)
        if hasattr(dnn, "conv") and hasattr(dnn.conv, "fp32_precision"):
            dnn.conv.fp32_precision = "ieee"  # the newer API: the older one no longer reads
            with _cuda_run("tf32"):
                assert dnn.conv.fp32_precision == "tf32"
            assert dnn.conv.fp32_precision == "ieee"
    finally:
        if hasattr(dnn, "conv") and hasattr(dnn.conv, "fp32_precision"):
            dnn.conv.fp32_precision = dnn.rnn.fp32_precision = "tf32"
        dnn.allow_tf32, mm.allow_tf32 = before
