"""onnxruntime's Python API as a drop-in: usage snippets written as onnxruntime's docs and
tutorials write them, run unmodified with ``rt`` = ``kiln`` and ``rt`` = ``onnxruntime``,
compared (outputs, metadata, providers, profile files). Also: intermediate outputs at run
time against onnxruntime on a copy of the model exposing them, run cancellation from
another thread, and default thread counts against the cores the OS lets us use."""

from __future__ import annotations

import json
import os
import threading
import time
import warnings

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
from conftest import make_model
from kiln.errors import InputError, OptionError, RunCancelledError

BACKENDS = ["numpy", "torch"]


@pytest.fixture
def mlp_path(mlp_model, tmp_path) -> str:
    mlp_model.producer_name = "kiln-tests"
    mlp_model.producer_version = "1.0"
    mlp_model.domain = "org.example"
    mlp_model.model_version = 7
    mlp_model.doc_string = "a small MLP"
    mlp_model.graph.doc_string = "two layers"
    helper.set_model_props(mlp_model, {"author": "tests", "labels": "a,b,c"})
    p = tmp_path / "mlp.onnx"
    onnx.save(mlp_model, p)
    return str(p)


X = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)


# -- snippets, each run with rt = kiln and rt = onnxruntime ------------------------------

def snippet_quickstart(rt, path):
    sess = rt.InferenceSession(path, providers=["CPUExecutionProvider"])
    input_name = sess.get_inputs()[0].name
    output_name = sess.get_outputs()[0].name
    result = sess.run([output_name], {input_name: X})
    return result, input_name, output_name, sess.get_inputs()[0].shape, \
        sess.get_inputs()[0].type, sess.get_providers(), sess.get_provider_options()


def snippet_session_options(rt, path):
    so = rt.SessionOptions()
    so.graph_optimization_level = rt.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.execution_mode = rt.ExecutionMode.ORT_SEQUENTIAL
    so.enable_mem_pattern = False
    so.log_severity_level = 3
    sess = rt.InferenceSession(path, so)
    outs = sess.run(None, {sess.get_inputs()[0].name: X})
    got = sess.get_session_options()
    return outs, got.intra_op_num_threads, got.log_severity_level


def snippet_bytes_and_positional(rt, path):
    with open(path, "rb") as f:
        data = f.read()
    so = rt.SessionOptions()
    sess = rt.InferenceSession(data, so, ["CPUExecutionProvider"])
    ro = rt.RunOptions()
    ro.log_severity_level = 3
    return sess.run(None, {"x": X}, ro), so.log_severity_level, so.intra_op_num_threads


def snippet_cuda_first(rt, path):
    sess = rt.InferenceSession(path, providers=["CUDAExecutionProvider",
                                                "CPUExecutionProvider"])
    return sess.run(None, {"x": X}), sess.get_providers()


def snippet_modelmeta(rt, path):
    meta = rt.InferenceSession(path).get_modelmeta()
    return (meta.producer_name, meta.graph_name, meta.domain, meta.description,
            meta.graph_description, meta.version, meta.custom_metadata_map)


def snippet_iobinding_cpu(rt, path):
    sess = rt.InferenceSession(path, providers=["CPUExecutionProvider"])
    io_binding = sess.io_binding()
    io_binding.bind_cpu_input("x", X)
    io_binding.bind_output("y")
    sess.run_with_iobinding(io_binding)
    return io_binding.copy_outputs_to_cpu()[0]


def snippet_iobinding_ortvalue(rt, path):
    sess = rt.InferenceSession(path, providers=["CPUExecutionProvider"])
    x_ortvalue = rt.OrtValue.ortvalue_from_numpy(X, "cpu", 0)
    y_ortvalue = rt.OrtValue.ortvalue_from_numpy(np.zeros((3, 3), np.float32), "cpu", 0)
    io_binding = sess.io_binding()
    io_binding.bind_ortvalue_input("x", x_ortvalue)
    io_binding.bind_ortvalue_output("y", y_ortvalue)
    sess.run_with_iobinding(io_binding)
    return y_ortvalue.numpy(), io_binding.get_outputs()[0].numpy(), \
        io_binding.get_outputs()[0].device_name(), y_ortvalue.shape()


def snippet_iobinding_pointers(rt, path):
    sess = rt.InferenceSession(path, providers=["CPUExecutionProvider"])
    x = X.copy()
    y = np.empty((3, 3), dtype=np.float32)
    io_binding = sess.io_binding()
    io_binding.bind_input(name="x", device_type="cpu", device_id=0, element_type=np.float32,
                          shape=x.shape, buffer_ptr=x.ctypes.data)
    io_binding.bind_output(name="y", device_type="cpu", device_id=0, element_type=np.float32,
                           shape=y.shape, buffer_ptr=y.ctypes.data)
    sess.run_with_iobinding(io_binding)
    return y


def snippet_available_providers_and_options(rt, path):
    sess = rt.InferenceSession(path, providers=rt.get_available_providers())
    tuned = rt.InferenceSession(
        path, providers=[("CPUExecutionProvider", {"arena_extend_strategy": "kSameAsRequested"})])
    return sess.run(None, {"x": X}), tuned.run(None, {"x": X}), tuned.get_provider_options(), \
        [i.name for i in sess.get_overridable_initializers()]


def snippet_free_dimension_override(rt, path):
    so = rt.SessionOptions()
    so.add_free_dimension_override_by_name("batch", 3)
    sess = rt.InferenceSession(path, so)
    outs = sess.run(None, {"x": X})
    try:
        sess.run(None, {"x": X[:2]})
        refused = False
    except Exception:  # noqa: BLE001 - each library raises its own type
        refused = True
    return outs, sess.get_inputs()[0].shape, sess.get_outputs()[0].shape, refused


SNIPPETS = [snippet_available_providers_and_options, snippet_quickstart,
            snippet_session_options, snippet_bytes_and_positional, snippet_modelmeta,
            snippet_iobinding_cpu, snippet_iobinding_ortvalue, snippet_iobinding_pointers,
            snippet_free_dimension_override]


def _same(a, b):
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (a, b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda f: f.__name__)
def test_snippet_gives_what_onnxruntime_gives(snippet, mlp_path):
    _same(snippet(kiln, mlp_path), snippet(ort, mlp_path))


def test_the_old_package_name_kiln_ort_still_imports_the_same_api(mlp_path):
    """``kiln.ort`` was renamed ``kiln.session_api`` (``ort`` reads as onnxruntime's alias);
    code written against the old name gets the same classes and the same outputs."""
    import kiln.ort
    import kiln.session_api
    from kiln.ort import InferenceSession, SessionOptions

    assert InferenceSession is kiln.session_api.InferenceSession is kiln.InferenceSession
    assert SessionOptions is kiln.session_api.SessionOptions
    assert sorted(kiln.ort.__all__) == sorted(kiln.session_api.__all__)
    assert all(getattr(kiln.ort, n) is getattr(kiln.session_api, n) for n in kiln.ort.__all__)
    x = {"x": np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)}
    (got,) = InferenceSession(mlp_path, SessionOptions()).run(None, x)
    (want,) = ort.InferenceSession(mlp_path, providers=["CPUExecutionProvider"]).run(None, x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_an_unavailable_provider_warns_and_falls_back_as_onnxruntime_does(mlp_path):
    if "CUDAExecutionProvider" in kiln.get_available_providers():
        pytest.skip("a CUDA device is here; onnxruntime's CPU build would still fall back")
    results = []
    for rt in (kiln, ort):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            results.append(snippet_cuda_first(rt, mlp_path))
        assert any("CUDAExecutionProvider" in str(x.message) for x in w)
    _same(*results)
    assert set(kiln.get_available_providers()) <= set(ort.get_available_providers())
    assert kiln.get_device() == ort.get_device() == "CPU"


def test_profiling_file_lists_each_run_and_layer_as_onnxruntime_does(mlp_path, tmp_path,
                                                                    monkeypatch):
    monkeypatch.chdir(tmp_path)
    layers = []
    for rt in (kiln, ort):
        so = rt.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = f"{rt.__name__}_prof"
        so.graph_optimization_level = rt.GraphOptimizationLevel.ORT_DISABLE_ALL
        sess = rt.InferenceSession(mlp_path, sess_options=so)
        for _ in range(3):
            sess.run(None, {"x": X})
        prof_file = sess.end_profiling()
        assert os.path.basename(prof_file).startswith(f"{rt.__name__}_prof")
        with open(prof_file) as f:
            events = json.load(f)
        assert all(e["ph"] == "X" and e["dur"] >= 0 for e in events)
        assert sum(e["name"] == "model_run" for e in events) == 3
        layers.append(sorted(e["args"]["op_name"] for e in events if e["cat"] == "Node"))
    assert layers[0] == layers[1]  # the same five layers, run three times


def test_log_severity_3_silences_warnings_while_the_session_is_built():
    pytest.importorskip("torch")
    unique = make_model([helper.make_node("Unique", ["x"], ["y"])],  # on the CPU fallback
                        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    so = kiln.SessionOptions()
    for level, expected in ((2, 1), (3, 0)):
        so.log_severity_level = level
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            sess = kiln.InferenceSession(unique, so, backend="torch")
        assert sum("CPU fallback" in str(x.message) for x in w) == expected
    try:
        kiln.set_default_logger_severity(3)  # sessions left at -1 take it
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            kiln.InferenceSession(unique, backend="torch")
        assert not any("CPU fallback" in str(x.message) for x in w)
    finally:
        kiln.set_default_logger_severity(2)
    x = np.array([3, 1, 3, 2], np.float32)
    want = ort.InferenceSession(unique.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_array_equal(sess.run(None, {"x": x})[0], want)


def test_optimized_model_filepath_saves_a_model_that_runs_the_same(mlp_path, tmp_path):
    so = kiln.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    kiln.InferenceSession(mlp_path, so)
    (got,) = kiln.InferenceSession(so.optimized_model_filepath, optimize=False).run(
        None, {"x": X})
    (want,) = ort.InferenceSession(mlp_path).run(None, {"x": X})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_disable_all_runs_the_model_as_written(mlp_path):
    so = kiln.SessionOptions()
    so.graph_optimization_level = kiln.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = kiln.InferenceSession(mlp_path, so)
    assert [n.op_type for n in sess.model.graph.nodes] == \
        [n.op_type for n in onnx.load(mlp_path).graph.node]


def test_optimize_false_wins_over_the_options_level(mlp_path):
    so = kiln.SessionOptions()
    so.graph_optimization_level = kiln.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = kiln.InferenceSession(mlp_path, so, optimize=False)
    assert len(sess.model.graph.nodes) == len(onnx.load(mlp_path).graph.node)
    so.graph_optimization_level = "fast"
    with pytest.raises(OptionError, match="graph_optimization_level"):
        kiln.InferenceSession(mlp_path, so)


def test_unknown_options_are_option_errors_not_type_errors(mlp_path):
    with pytest.raises(OptionError, match="intra_op_num_threads"):
        kiln.SessionOptions().intra_op_num_thread = 2  # typo: onnxruntime AttributeError
    with pytest.raises(OptionError, match="no option"):
        kiln.InferenceSession(mlp_path, backend="torch", providers=["CPUExecutionProvider"],
                              disabled_optimizers=["x"])
    with pytest.raises(OptionError, match="takes only threads"):
        kiln.InferenceSession(mlp_path, None, ["CPUExecutionProvider"], None, foo=1)
    with pytest.raises(OptionError, match="same length"):
        kiln.InferenceSession(mlp_path, providers=["CPUExecutionProvider"],
                              provider_options=[{}, {}])
    with pytest.raises(OptionError, match="kiln.SessionOptions"):
        kiln.InferenceSession(mlp_path, ort.SessionOptions())


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA device")
def test_cuda_provider_runs_on_torch_and_binds_device_tensors(mlp_path):
    import torch
    sess = kiln.InferenceSession(mlp_path, providers=["CUDAExecutionProvider",
                                                      "CPUExecutionProvider"])
    assert sess.get_providers() == ["CUDAExecutionProvider", "CPUExecutionProvider"]
    assert sess.backend.name == "torch" and sess.backend.is_cuda
    x = torch.from_numpy(X).cuda()
    io_binding = sess.io_binding()
    io_binding.bind_input(name="x", device_type="cuda", device_id=0, element_type=np.float32,
                          shape=tuple(x.shape), buffer_ptr=x.data_ptr())
    io_binding.bind_output("y", "cuda")
    sess.run_with_iobinding(io_binding)
    out = io_binding.get_outputs()[0]
    assert out.device_name() == "cuda" and out.value.is_cuda
    np.testing.assert_allclose(out.numpy(), ort.InferenceSession(mlp_path).run(
        None, {"x": X})[0], rtol=1e-4, atol=1e-5)


# -- threads ------------------------------------------------------------------------------

def _usable_cores() -> int:
    n = len(os.sched_getaffinity(0))
    try:
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return n


def test_default_threads_never_exceed_the_usable_cores(mlp_path):
    torch = pytest.importorskip("torch")
    from threadpoolctl import threadpool_info, threadpool_limits
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(_usable_cores() + 7)  # as torch does on a quota'd container
        kiln.InferenceSession(mlp_path, backend="torch")
        assert torch.get_num_threads() <= _usable_cores()
        with threadpool_limits(limits=_usable_cores() + 7, user_api="blas"):
            kiln.InferenceSession(mlp_path, backend="numpy")
            assert all(p["num_threads"] <= _usable_cores() for p in threadpool_info()
                       if p["user_api"] == "blas")
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", BACKENDS)
def test_intra_op_num_threads_is_honoured(backend, mlp_path):
    torch = pytest.importorskip("torch")
    from threadpoolctl import threadpool_info, threadpool_limits
    before = torch.get_num_threads()
    so = kiln.SessionOptions()
    so.intra_op_num_threads = 1
    try:
        with threadpool_limits(limits=2, user_api="blas"):
            sess = kiln.InferenceSession(mlp_path, so, backend=backend)
            if backend == "torch":
                assert torch.get_num_threads() == 1
            else:
                assert all(p["num_threads"] == 1 for p in threadpool_info()
                           if p["user_api"] == "blas")
            (got,) = sess.run(None, {"x": X})
    finally:
        torch.set_num_threads(before)
    np.testing.assert_allclose(got, ort.InferenceSession(mlp_path).run(None, {"x": X})[0],
                               rtol=1e-5, atol=1e-6)


# -- intermediate outputs -----------------------------------------------------------------

def _exposing(proto: onnx.ModelProto, names: list[str]) -> onnx.ModelProto:
    """A copy of ``proto`` with ``names`` as extra graph outputs (typed by ONNX's shape
    inference): what a user of onnxruntime has to do to read them."""
    m = onnx.shape_inference.infer_shapes(proto)
    info = {v.name: v for v in m.graph.value_info}
    m.graph.output.extend(info[n] for n in names)
    return m


def _hidden_by_fusion(proto: onnx.ModelProto) -> list[str]:
    """Tensors asked for: the first is one Kiln's optimizer fuses away (FER+: a Conv output,
    Conv+Relu fuse; BERT: the attention probabilities, inside the fused Attention, and
    GELU's Erf), the others some it keeps (a Relu, the classifier's features, a
    LayerNormalization output)."""
    def outs(op):
        return [n.output[0] for n in proto.graph.node if n.op_type == op]
    if outs("Conv"):
        return [outs("Conv")[3], outs("Relu")[4], outs("Flatten")[0]]
    return [outs("Softmax")[0], outs("Erf")[0], outs("LayerNormalization")[1]]


def _feeds(proto: onnx.ModelProto) -> dict[str, np.ndarray]:
    rng, feeds = np.random.default_rng(0), {}
    for i in proto.graph.input:
        shape = [d.dim_value or (1 if k == 0 else 16)
                 for k, d in enumerate(i.type.tensor_type.shape.dim)]
        if i.type.tensor_type.elem_type == TensorProto.FLOAT:
            feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
        elif "mask" in i.name:
            feeds[i.name] = np.ones(shape, np.int64)
        elif "type" in i.name:
            feeds[i.name] = np.zeros(shape, np.int64)
        else:
            feeds[i.name] = rng.integers(0, 1000, shape).astype(np.int64)
    return feeds


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["emotion_ferplus", "bert"])
def test_intermediate_outputs_of_a_zoo_model_match_onnxruntime(name, backend, zoo_model):
    path = str(zoo_model(name))
    proto = onnx.load(path)
    names = _hidden_by_fusion(proto) + [proto.graph.output[0].name]
    feed = _feeds(proto)
    want = ort.InferenceSession(_exposing(proto, names[:-1]).SerializeToString()).run(
        names, feed)
    sess = kiln.InferenceSession(path, backend=backend)
    kept = {v.name for n in sess.model.graph.nodes for v in n.outputs if v is not None}
    assert names[0] not in kept  # the optimized main plan has no such tensor
    got = sess.run(names, feed)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-3)
    (plain,) = sess.run([names[-1]], feed)  # the main plan, untouched by the variant
    np.testing.assert_allclose(plain, want[-1], rtol=1e-3, atol=1e-3)
    built = dict(sess._variants)
    sess.run(names[::-1], feed)  # the same set again: the cached plan
    assert sess._variants == built and len(built) == 1


def test_inputs_and_initializers_are_outputs_too(mlp_model):
    w1 = onnx.numpy_helper.to_array(next(t for t in mlp_model.graph.initializer
                                         if t.name == "w1"))
    sess = kiln.InferenceSession(mlp_model.SerializeToString())
    x, w, h = sess.run(["x", "w1", "h"], {"x": X})
    np.testing.assert_array_equal(x, X)
    np.testing.assert_array_equal(w, w1)
    np.testing.assert_allclose(h, X @ w1, rtol=1e-5, atol=1e-6)  # NumPy doing the MatMul


def test_an_unknown_output_name_lists_close_matches(mlp_model):
    sess = kiln.InferenceSession(mlp_model)
    with pytest.raises(InputError, match=r"'logit'.*close matches: \['logits'"):
        sess.run(["logit"], {"x": X})
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument):
        ort.InferenceSession(mlp_model.SerializeToString()).run(["logits"], {"x": X})


def test_intermediate_outputs_through_io_binding(mlp_model):
    want = ort.InferenceSession(_exposing(mlp_model, ["r"]).SerializeToString()).run(
        ["r"], {"x": X})[0]
    sess = kiln.InferenceSession(mlp_model)
    io = sess.io_binding()
    io.bind_cpu_input("x", X)
    io.bind_output("r")
    sess.run_with_iobinding(io)
    np.testing.assert_allclose(io.copy_outputs_to_cpu()[0], want, rtol=1e-5, atol=1e-6)


# -- cancellation ---------------------------------------------------------------------------

def _endless_loop() -> onnx.ModelProto:
    """A Loop whose trip count is 2**62: runs until stopped."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Add", ["acc", "one"], ["acc_out"])], "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []),
         helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [4])],
        [helper.make_tensor("one", TensorProto.FLOAT, [4], [1.0] * 4)])
    trip = helper.make_tensor("trip", TensorProto.INT64, [], [2**62])
    cond = helper.make_tensor("cond0", TensorProto.BOOL, [], [True])
    node = helper.make_node("Loop", ["trip", "cond0", "x"], ["y"], body=body)
    return make_model([node], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4])],
                      [trip, cond])


def _long_chain(n: int = 600) -> onnx.ModelProto:
    """x -> MatMul(w) -> Tanh -> ... n times: seconds of straight-line work."""
    w = onnx.numpy_helper.from_array(np.eye(512, dtype=np.float32) * 0.5, "w")
    nodes, prev = [], "x"
    for i in range(n):
        nodes += [helper.make_node("MatMul", [prev, "w"], [f"m{i}"]),
                  helper.make_node("Tanh", [f"m{i}"], [f"t{i}"])]
        prev = f"t{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [512, 512])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [512, 512])], [w])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model", [_endless_loop, _long_chain], ids=["loop", "chain"])
def test_terminate_from_another_thread_stops_a_long_run(backend, model):
    proto = model()
    sess = kiln.InferenceSession(proto, backend=backend, optimize=False)
    x = np.ones([d.dim_value for d in proto.graph.input[0].type.tensor_type.shape.dim],
                np.float32)
    ro = kiln.RunOptions()
    timer = threading.Timer(0.3, lambda: setattr(ro, "terminate", True))
    t0 = time.perf_counter()
    timer.start()
    with pytest.raises(RunCancelledError, match="terminate"):
        sess.run(None, {"x": x}, ro)
    assert time.perf_counter() - t0 < 20
    ro.terminate = False  # the same session runs again afterwards, to its time limit
    ro.time_limit_s = 0.2
    with pytest.raises(RunCancelledError, match="time_limit_s"):
        sess.run(None, {"x": x}, ro)


def test_terminate_stops_a_queued_async_run_and_later_runs_still_work():
    sess = kiln.InferenceSession(_endless_loop(), optimize=False)
    ro = kiln.RunOptions()
    handle = sess.run_async(None, {"x": np.zeros(4, np.float32)}, ro)
    time.sleep(0.2)
    ro.terminate = True
    with pytest.raises(RunCancelledError):
        handle.result(timeout=20)
    stop_after_3 = _endless_loop()
    stop_after_3.graph.initializer[0].CopyFrom(helper.make_tensor("trip", TensorProto.INT64,
                                                                  [], [3]))
    want = ort.InferenceSession(stop_after_3.SerializeToString()).run(
        None, {"x": np.zeros(4, np.float32)})[0]
    got = kiln.InferenceSession(stop_after_3).run_async(
        None, {"x": np.zeros(4, np.float32)}, kiln.RunOptions()).result(timeout=20)[0]
    np.testing.assert_array_equal(got, want)


def test_a_terminated_run_options_stops_the_run_as_onnxruntime_does(mlp_path):
    for rt, error in ((kiln, RunCancelledError),
                      (ort, ort.capi.onnxruntime_pybind11_state.Fail)):
        ro = rt.RunOptions()
        ro.terminate = True
        with pytest.raises(error, match="terminate"):
            rt.InferenceSession(mlp_path).run(None, {"x": X}, ro)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_with_run_options_that_is_not_stopped_is_unchanged(backend, mlp_path):
    ro = kiln.RunOptions()
    ro.time_limit_s = 60
    (got,) = kiln.InferenceSession(mlp_path, backend=backend).run(None, {"x": X}, ro)
    np.testing.assert_allclose(got, ort.InferenceSession(mlp_path).run(None, {"x": X})[0],
                               rtol=1e-5, atol=1e-6)
