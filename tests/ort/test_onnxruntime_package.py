"""``kiln.onnxruntime`` behaves as onnxruntime does, checked against the installed
onnxruntime on the same models and calls: the class of every common error, ``run``'s
results, values, and the ``import onnxruntime`` switch. (onnxruntime's own test suite is
the larger judge: ``.ci/run`` runs it.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
from onnx import TensorProto
from onnx import helper as oh

import kiln
import kiln.onnxruntime as kort
from kiln.onnxruntime.capi import onnxruntime_pybind11_state as KC

ort = pytest.importorskip("onnxruntime")


def _model(passthrough: bool = False) -> bytes:
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    outs = [y, x] if passthrough else [y]
    graph = oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "g", [x], outs)
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]).SerializeToString()


X = np.arange(6, dtype=np.float32).reshape(2, 3) - 2


def _raised(module, call) -> BaseException:
    with pytest.raises(Exception) as info:  # noqa: PT011 - the class is what is compared
        call(module)
    return info.value


CASES = {
    "missing file": lambda m: m.InferenceSession("/nonexistent/model.onnx"),
    "bad bytes": lambda m: m.InferenceSession(b"not a model at all"),
    "wrong dtype": lambda m: m.InferenceSession(_model()).run(None, {"x": X.astype(np.int64)}),
    "wrong shape": lambda m: m.InferenceSession(_model()).run(None, {"x": X.reshape(3, 2)}),
    "unknown output": lambda m: m.InferenceSession(_model()).run(["nope"], {"x": X}),
    "missing feed": lambda m: m.InferenceSession(_model()).run(None, {}),
    "unknown provider": lambda m: m.InferenceSession(_model()).set_providers(["NoSuchEP"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_errors_are_onnxruntimes_classes(case):
    want = _raised(ort, CASES[case])
    got = _raised(kort, CASES[case])
    ort_cls = type(want)
    if ort_cls.__module__.endswith("onnxruntime_pybind11_state"):
        assert isinstance(got, getattr(KC, ort_cls.__name__)), (case, type(got).__mro__)
        assert isinstance(got, kiln.KilnError)  # Kiln's own except clauses still work
    else:
        assert isinstance(got, ort_cls), (case, type(got).__mro__, ort_cls)


def test_run_with_empty_names_returns_every_output_and_copies_passthrough_inputs():
    so = kort.SessionOptions()
    so.graph_optimization_level = kort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = kort.InferenceSession(_model(passthrough=True), so)
    want = ort.InferenceSession(_model(passthrough=True)).run([], {"x": X})
    got = sess.run([], {"x": X})
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert not np.shares_memory(got[1], X)


def _identity_string() -> bytes:
    vi = [oh.make_tensor_value_info(n, TensorProto.STRING, [2, 2]) for n in ("s", "t")]
    graph = oh.make_graph([oh.make_node("Identity", ["s"], ["t"])], "g", vi[:1], vi[1:])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.parametrize("x", [
    np.array([["a", "bb"], ["ccc", "é"]]),
    np.array([[b"must", b"have"], [b"same", b"size"]], dtype=np.void),
    np.array([["a", "bb"], ["ccc", "é"]], dtype=object)])
def test_string_feeds_as_onnxruntime_takes_them(x):
    want = ort.InferenceSession(_identity_string()).run(None, {"s": x})[0]
    got = kort.InferenceSession(_identity_string()).run(None, {"s": x})[0]
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_ortvalue_array_dlpack_and_sparse():
    v = kort.OrtValue.ortvalue_from_numpy(X)
    a = np.asarray(v)
    assert a.ctypes.data == v.data_ptr() and v.element_type() == TensorProto.FLOAT
    w = kort.OrtValue.from_dlpack(v)
    assert w.data_ptr() == v.data_ptr()
    assert ort.OrtValue.ortvalue_from_numpy(X).tensor_size_in_bytes() == v.tensor_size_in_bytes()
    dev = kort.OrtDevice.make("cpu", 0)
    sp = kort.SparseTensor.sparse_coo_from_numpy([3, 3], np.array([1.0, 2.0], np.float32),
                                                 np.array([2, 7], np.int64), dev)
    osp = ort.SparseTensor.sparse_coo_from_numpy([3, 3], np.array([1.0, 2.0], np.float32),
                                                 np.array([2, 7], np.int64),
                                                 ort.OrtDevice.make("cpu", 0))
    assert sp.data_type() == osp.data_type() and sp.dense_shape() == list(osp.dense_shape())


def test_options_are_honoured_or_refused():
    so = kort.SessionOptions()
    so.add_session_config_entry("no.such.key", "1")
    with pytest.raises(RuntimeError, match="does not know"):
        kort.InferenceSession(_model(), so)
    so = kort.SessionOptions()
    so.execution_order = kort.ExecutionOrder.PRIORITY_BASED
    with pytest.raises(RuntimeError):
        kort.InferenceSession(_model(), so)
    with pytest.raises(AttributeError):
        kort.SessionOptions().no_such_option = 1
    so = kort.SessionOptions()
    with pytest.raises(RuntimeError):
        so.register_custom_ops_library("libx.so")


def test_intermediate_outputs_are_opt_in(tmp_path):
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = oh.make_graph([oh.make_node("Relu", ["x"], ["h"]), oh.make_node("Neg", ["h"], ["y"])],
                          "g", [x], [y])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(KC.InvalidArgument):
        kort.InferenceSession(model).run(["h"], {"x": X})
    so = kort.SessionOptions()
    so.add_session_config_entry("kiln.intermediate_outputs", "1")
    (h,) = kort.InferenceSession(model, so).run(["h"], {"x": X})
    np.testing.assert_array_equal(h, np.maximum(X, 0))


SCRIPT = textwrap.dedent("""
    import numpy as np, onnxruntime, onnxruntime.capi.onnxruntime_pybind11_state as C
    assert onnxruntime.__name__ == "kiln.onnxruntime", onnxruntime.__name__
    assert C.__name__ == "kiln.onnxruntime.capi.onnxruntime_pybind11_state"
    from onnxruntime import datasets
    s = onnxruntime.InferenceSession(datasets.get_example("mul_1.onnx"))
    print(s.run(None, {"X": np.ones((3, 2), np.float32)})[0].sum())
""")


def test_python_m_switch_runs_a_program_on_kiln(tmp_path):
    script = tmp_path / "uses_ort.py"
    script.write_text(SCRIPT)
    out = subprocess.run([sys.executable, "-m", "kiln.onnxruntime", str(script)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    from onnxruntime import datasets
    want = ort.InferenceSession(datasets.get_example("mul_1.onnx")).run(
        None, {"X": np.ones((3, 2), np.float32)})[0].sum()
    assert float(out.stdout.strip()) == float(want)


def test_install_refuses_after_the_real_onnxruntime_was_imported():
    assert "onnxruntime" in sys.modules  # this test module imported it
    with pytest.raises(kiln.KilnError, match="install"):
        kort.install()


def test_sequence_outputs_are_described_and_returned():
    # get_outputs() on a sequence output raised AttributeError (declared-type merge).
    t = [oh.make_tensor_value_info(n, TensorProto.INT64, [2]) for n in ("a", "b")]
    s = oh.make_tensor_sequence_value_info("s", TensorProto.INT64, None)
    graph = oh.make_graph([oh.make_node("SequenceConstruct", ["a", "b"], ["s"])], "g", t, [s])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]).SerializeToString()
    feed = {"a": np.array([1, 2]), "b": np.array([3, 4])}
    want, got = ort.InferenceSession(model), kort.InferenceSession(model)
    assert [o.type for o in got.get_outputs()] == [o.type for o in want.get_outputs()]
    for g, w in zip(got.run(None, feed)[0], want.run(None, feed)[0]):
        np.testing.assert_array_equal(g, w)


def test_lora_adapter_written_by_kiln_runs_on_both(tmp_path):
    # A model whose LoRA matrices are initializers a feed may override (as onnxruntime's
    # adapters expect); the adapter file Kiln writes is read by onnxruntime too.
    from onnx import numpy_helper
    x = oh.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])
    a = oh.make_tensor_value_info("a", TensorProto.FLOAT, [4, "r"])
    b = oh.make_tensor_value_info("b", TensorProto.FLOAT, ["r", 4])
    y = oh.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])
    nodes = [oh.make_node("MatMul", ["x", "w"], ["xw"]),
             oh.make_node("MatMul", ["x", "a"], ["xa"]),
             oh.make_node("MatMul", ["xa", "b"], ["xab"]),
             oh.make_node("Add", ["xw", "xab"], ["y"])]
    inits = [numpy_helper.from_array(np.eye(4, dtype=np.float32), "w"),
             numpy_helper.from_array(np.zeros((4, 0), np.float32), "a"),
             numpy_helper.from_array(np.zeros((0, 4), np.float32), "b")]
    model = oh.make_model(oh.make_graph(nodes, "lora", [x, a, b], [y], inits),
                          opset_imports=[oh.make_opsetid("", 17)]).SerializeToString()
    rng = np.random.default_rng(0)
    fmt = kort.AdapterFormat()
    fmt.set_adapter_version(2)
    fmt.set_model_version(1)
    fmt.set_parameters({n: kort.OrtValue.ortvalue_from_numpy(v) for n, v in
                        {"a": rng.random((4, 2), np.float32),
                         "b": rng.random((2, 4), np.float32)}.items()})
    path = str(tmp_path / "p.onnx_adapter")
    fmt.export_adapter(path)
    feed = {"x": rng.random((4, 4), np.float32)}
    results = []
    for m in (ort, kort):
        adapter = m.LoraAdapter()
        adapter.Load(path)
        ro = m.RunOptions()
        ro.add_active_adapter(adapter)
        results.append(m.InferenceSession(model).run(None, feed, ro)[0])
    np.testing.assert_allclose(results[1], results[0], rtol=1e-6)
    assert not np.allclose(results[0], feed["x"])  # the adapter changed the output


@pytest.mark.parametrize("onnx_type", [TensorProto.BFLOAT16, TensorProto.FLOAT8E4M3FN])
def test_io_binding_of_types_numpy_lacks(onnx_type):
    # bfloat16 and float8 buffers bound by pointer failed: NumPy's array interface cannot
    # read ml_dtypes' typestrs.
    torch = pytest.importorskip("torch")
    tt = {TensorProto.BFLOAT16: torch.bfloat16, TensorProto.FLOAT8E4M3FN: torch.float8_e4m3fn}
    vi = [oh.make_tensor_value_info(n, onnx_type, [None]) for n in ("X", "Y")]
    graph = oh.make_graph([oh.make_node("Identity", ["X"], ["Y"])], "g", vi[:1], vi[1:])
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)],
                          ir_version=10).SerializeToString()
    x = torch.arange(8).to(tt[onnx_type])
    outs = []
    for m in (ort, kort):
        y = torch.empty(8, dtype=tt[onnx_type])
        sess = m.InferenceSession(model)
        bind = sess.io_binding()
        bind.bind_input("X", "cpu", 0, onnx_type, x.shape, x.data_ptr())
        bind.bind_output("Y", "cpu", 0, onnx_type, y.shape, y.data_ptr())
        sess.run_with_iobinding(bind)
        outs.append(y.float())
    assert torch.equal(outs[1], outs[0]) and torch.equal(outs[0], x.float())


def test_kilns_own_session_runs_as_onnxruntime_does():
    # kiln.InferenceSession: run([]) returned [], a pass-through output was the caller's
    # own array, and np.asarray(kiln.OrtValue) was a 0-d object array.
    want = ort.InferenceSession(_model(passthrough=True)).run([], {"x": X})
    got = kiln.InferenceSession(_model(passthrough=True), optimize=False).run([], {"x": X})
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert not np.shares_memory(got[1], X)
    v = kiln.OrtValue.ortvalue_from_numpy(X)
    np.testing.assert_array_equal(np.asarray(v), np.asarray(ort.OrtValue.ortvalue_from_numpy(X)))
    assert np.asarray(v).ctypes.data == v.data_ptr()
