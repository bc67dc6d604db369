"""The onnxruntime-compatible session surface, the plan, custom ops and threads."""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln
from conftest import make_model, ort_run
from kiln.ir import Value


def test_inputs_and_outputs_describe_the_model(mlp_model):
    sess = kiln.InferenceSession(mlp_model)
    (x,) = sess.get_inputs()
    assert (x.name, x.shape, x.type) == ("x", ["batch", 4], "tensor(float)")
    (y,) = sess.get_outputs()
    assert (y.name, y.shape, y.type) == ("y", ["batch", 3], "tensor(float)")


def test_matches_onnxruntime_for_any_batch(mlp_model):
    sess = kiln.InferenceSession(mlp_model)
    for batch in (1, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 4)).astype(np.float32)
        np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(mlp_model, {"x": x})[0],
                                   rtol=1e-5, atol=1e-6)


def test_concurrent_runs_on_one_session(mlp_model):
    sess = kiln.InferenceSession(mlp_model)
    xs = [np.random.default_rng(i).standard_normal((i + 1, 4)).astype(np.float32)
          for i in range(16)]
    want = [ort_run(mlp_model, {"x": x})[0] for x in xs]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda x: sess.run(["y"], {"x": x})[0], xs * 4))
    for i, g in enumerate(got):
        np.testing.assert_allclose(g, want[i % len(xs)], rtol=1e-5, atol=1e-6)


def test_plan_frees_each_intermediate_after_its_last_use(mlp_model):
    plan = kiln.InferenceSession(mlp_model).plan
    freed = [v for s in plan.steps for v in s.frees]
    assert len(freed) == len(set(freed)), "a value is freed twice"
    # Feeds are dropped after their last reader too; outputs and weights are kept.
    produced = {v for s in plan.steps for v in s.outputs} | set(plan.graph.inputs)
    assert set(freed) == produced - set(plan.graph.outputs) - set(plan.consts)
    for i, s in enumerate(plan.steps):
        for v in s.frees:  # freed exactly at its last reader
            assert not any(v in later.inputs for later in plan.steps[i + 1:])
            assert v in s.inputs or v in s.outputs


def test_custom_op_registration():
    def scaled_tanh(x, *, alpha=1.0):
        return (alpha * np.tanh(x)).astype(x.dtype)

    kiln.register_op("com.example", "ScaledTanh", scaled_tanh)
    nodes = [helper.make_node("ScaledTanh", ["x"], ["t"], domain="com.example", alpha=2.5),
             helper.make_node("Add", ["t", "x"], ["y"])]
    m = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    m.opset_import.append(helper.make_opsetid("com.example", 1))
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    (y,) = kiln.InferenceSession(m).run(None, {"x": x})
    np.testing.assert_allclose(y, 2.5 * np.tanh(x) + x, rtol=1e-6)


def _affine_kernels():
    """One custom kernel, y = alpha * x + beta, in each shape a kernel's signature can
    take: what the registry reads from it decides which attributes (and context) it gets."""
    import functools

    def plain(x, *, alpha=1.0, beta=0.0):
        return (alpha * x + beta).astype(x.dtype)

    def with_ctx(ctx, x, *, alpha=1.0, beta=0.0):
        assert ctx.num_outputs == 1
        return plain(x, alpha=alpha, beta=beta)

    def star_args(x, *rest, alpha=1.0, beta=0.0):
        return plain(x, alpha=alpha, beta=beta)

    def any_attrs(x, **attrs):
        return plain(x, alpha=attrs["alpha"], beta=attrs["beta"])

    @functools.wraps(plain)
    def wrapped(*args, **kwargs):
        return plain(*args, **kwargs)

    return [plain, with_ctx, star_args, any_attrs, wrapped]


@pytest.mark.parametrize("kernel", _affine_kernels(), ids=lambda k: k.__name__)
def test_custom_kernels_get_their_attributes_whatever_their_signature(kernel):
    domain = f"com.example.{kernel.__name__}"
    kiln.register_op(domain, "Affine", kernel)
    nodes = [helper.make_node("Affine", ["x"], ["y"], domain=domain, alpha=2.5, beta=-1.0,
                              unused_hint=7)]
    m = make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    m.opset_import.append(helper.make_opsetid(domain, 1))
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    (y,) = kiln.InferenceSession(m).run(None, {"x": x})
    np.testing.assert_allclose(y, 2.5 * x - 1.0, rtol=1e-6)


def test_overridable_initializer(mlp_model):
    mlp_model.graph.input.append(helper.make_tensor_value_info("b1", TensorProto.FLOAT, [8]))
    sess = kiln.InferenceSession(mlp_model)
    assert [i.name for i in sess.get_inputs()] == ["x"]
    x = np.ones((2, 4), np.float32)
    b1 = np.full(8, 3.0, np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x, "b1": b1})[0],
                               ort_run(mlp_model, {"x": x, "b1": b1})[0], rtol=1e-5, atol=1e-6)


def test_ir_values_are_objects_not_protobuf(mlp_model):
    model = kiln.load(mlp_model)
    for _, node in model.graph.walk():
        assert all(isinstance(v, Value) for v in node.inputs + node.outputs if v is not None)
    assert model.graph.nodes[1].inputs[0] is model.graph.nodes[0].outputs[0]


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn", "int4", "uint4"])
def test_narrow_dtypes_import(dtype):
    import ml_dtypes
    from onnx import numpy_helper
    arr = np.arange(6).reshape(2, 3).astype(getattr(ml_dtypes, dtype))
    t = numpy_helper.from_array(arr, "c")
    m = make_model([helper.make_node("Identity", ["c"], ["y"])], [],
                   [helper.make_tensor_value_info("y", t.data_type, [2, 3])], [t], opset=21)
    got = kiln.load(m).graph.initializers["c"].const
    assert got.dtype == arr.dtype
    np.testing.assert_array_equal(got.astype(np.float32), arr.astype(np.float32))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_results_are_c_ordered_as_onnxruntime_hands_them_out(backend):
    """A channels-last convolution (torch) and a transposed view (NumPy) come back in
    C order, as onnxruntime's results always do: callers hand them to ctypes and buffers."""
    if backend == "torch":
        pytest.importorskip("torch")
    F = TensorProto.FLOAT
    rng = np.random.default_rng(0)
    w = helper.make_tensor("w", F, [64, 64, 3, 3], rng.standard_normal(64 * 64 * 9) / 24)
    model = make_model(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Transpose", ["c"], ["y"], perm=[0, 2, 3, 1])],
        [helper.make_tensor_value_info("x", F, None)],
        [helper.make_tensor_value_info("c", F, None), helper.make_tensor_value_info("y", F, None)],
        [w])
    x = rng.standard_normal((1, 64, 12, 12)).astype(np.float32)
    want = ort_run(model, {"x": x})
    got = kiln.InferenceSession(model, backend=backend).run(None, {"x": x})
    for g, r in zip(got, want):
        assert r.flags.c_contiguous and g.flags.c_contiguous
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-4)
