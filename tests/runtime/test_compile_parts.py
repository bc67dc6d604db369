"""compile=True on models that cannot be one program (issue 44 item 3): the runs of layers
around an If are compiled programs, the If runs eagerly between them and its branches are
compiled the same way; results match onnxruntime's, whichever branch is taken, and the
status says what runs compiled and what eagerly. Also the compile cache's loader falling
back to torch's public one."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

import kiln

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from kiln.runtime.torch_backend import CompileWarning  # noqa: E402


def _if_between(branch_ops: int) -> bytes:
    """x -> MatMul, Relu, Mul, Sub -> If(sum(x) > 0: then | else) -> MatMul, Tanh, Mul,
    Add -> y, each branch a chain of ``branch_ops`` elementwise layers on the If's input."""
    w = np.random.default_rng(0).standard_normal((8, 8)).astype(np.float32)

    def branch(name: str, ops: list[str]):
        nodes, prev = [], "h"
        for i, op in enumerate(ops[:branch_ops]):
            nodes.append(helper.make_node(op, [prev], [f"{name}{i}"]))
            prev = f"{name}{i}"
        nodes.append(helper.make_node("Identity", [prev], [f"{name}_out"]))
        return helper.make_graph(nodes, name, [], [
            helper.make_tensor_value_info(f"{name}_out", TensorProto.FLOAT, None)])

    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Mul", ["b", "x"], ["c"]),
             helper.make_node("Sub", ["c", "x"], ["h"]),
             helper.make_node("ReduceSum", ["x"], ["s"], keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"]),
             helper.make_node("If", ["cond"], ["d"], name="pick",
                              then_branch=branch("then", ["Sigmoid", "Neg", "Exp", "Tanh"]),
                              else_branch=branch("else", ["Tanh", "Abs", "Sqrt", "Neg"])),
             helper.make_node("MatMul", ["d", "W"], ["e"]),
             helper.make_node("Tanh", ["e"], ["f"]),
             helper.make_node("Mul", ["f", "d"], ["g"]),
             helper.make_node("Add", ["g", "x"], ["y"])]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor("W", TensorProto.FLOAT, [8, 8], w.ravel()),
         helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "cache"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("KILN_COMPILE_CACHE", str(folder))
    return folder


def _check_both_branches(blob: bytes) -> kiln.InferenceSession:
    """A compiled session run on inputs taking the then branch, the else branch and the
    then branch again, each result against onnxruntime's."""
    with pytest.warns(CompileWarning) as caught:
        sess = kiln.InferenceSession(blob, backend="torch", compile=True)
        ref = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
        x = np.abs(np.random.default_rng(1).standard_normal((2, 8))).astype(np.float32) + 0.1
        for feed in (x, -x, 0.5 * x):
            got = sess.run(None, {"x": feed})[0]
            np.testing.assert_allclose(got, ref.run(None, {"x": feed})[0], rtol=1e-5,
                                       atol=1e-6)
            assert sess.backend.last_run_stats().compiled
    lines = [str(w.message) for w in caught if issubclass(w.category, CompileWarning)]
    # one line naming the layer and why, no compiler internals
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "layer 'pick' (If)" in lines[0] and "control flow" in lines[0], lines
    return sess


def test_the_layers_around_an_if_run_compiled(cache):
    """Branches of one layer stay eager (too small for a program call); the parts before
    and after the If are two programs."""
    sess = _check_both_branches(_if_between(1))
    status = sess.placement().compiled
    assert status.startswith("yes, in parts: 2 program(s)"), status
    assert "'pick' (If)" in status
    assert [e.split()[0] for e in sess.backend.compile_log] == ["compiled", "compiled"]
    assert len(list(cache.glob("*.pt2"))) == 2


@pytest.mark.slow  # four compiles
def test_an_ifs_branches_are_compiled_too(cache):
    sess = _check_both_branches(_if_between(4))
    status = sess.placement().compiled
    assert status.startswith("yes, in parts: 4 program(s)"), status
    # the else branch was compiled when the second input first took it
    assert [e.split()[0] for e in sess.backend.compile_log] == ["compiled"] * 4


@pytest.mark.slow  # one compile per model, 15-70 s each
@pytest.mark.parametrize("name", ["silero_vad", "silero_vad_ifless", "oww_hey_jarvis"])
def test_trained_models_with_an_if_run_compiled(name, cache):
    import trained_models as tm

    m = tm.get(name)
    if m.path is None:
        pytest.skip(f"{m.package} not installed")
    ref = ort.InferenceSession(m.path, providers=["CPUExecutionProvider"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = kiln.InferenceSession(m.path, backend="torch", compile=True)
        for feed in m.make_feeds(0, 3)[1]:
            got = sess.run(None, feed)
            assert sess.backend.last_run_stats().compiled
            for g, w in zip(got, ref.run(None, feed)):
                np.testing.assert_allclose(g, w, rtol=1e-3,
                                           atol=1e-3 * max(1.0, np.abs(w).max()))
    status = sess.placement().compiled
    assert status.startswith("yes, in parts:"), status
    assert not any("running eagerly for these inputs" in str(w.message) for w in caught)
    assert "compiled" in [e.split()[0] for e in sess.backend.compile_log]


def test_the_public_package_loader_takes_over(cache, monkeypatch):
    """Where torch's private package loader does not take Kiln's call (another torch
    version), the package is loaded through torch._inductor.aoti_load_package."""
    import torch._inductor as inductor

    from kiln.runtime import compile_cache

    def refuse(*args):
        raise TypeError("AOTIModelPackageLoader(): incompatible constructor arguments")

    public = []
    real = inductor.aoti_load_package

    def spy(path, *args, **kwargs):
        public.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(compile_cache, "_private_loader", refuse)
    monkeypatch.setattr(inductor, "aoti_load_package", spy)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("Tanh", ["a"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor("W", TensorProto.FLOAT, [4, 4],
                            np.arange(16, dtype=np.float32) / 16)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    blob = m.SerializeToString()
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    sess = kiln.InferenceSession(blob, backend="torch", compile=True)
    got = sess.run(None, {"x": x})[0]
    want = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(got, want[0], rtol=1e-5, atol=1e-6)
    assert sess.backend.last_run_stats().compiled
    assert len(public) == 1 and public[0].endswith(".pt2")


def _conv_transpose_then(w_shape: tuple, group: int, op: str) -> bytes:
    """Conv, Relu, Conv, Relu -> ConvTranspose(w_shape, group) -> ``op`` with a
    per-output-channel constant -> Sigmoid, Conv, Relu, Conv, Sigmoid: a constant applied to a
    ConvTranspose's output with compiled runs on both sides."""
    rng = np.random.default_rng(0)
    cin, per = w_shape[0], w_shape[1]
    cout = per * group
    consts = {"W0": rng.standard_normal((cin, 3, 3, 3)) * 0.3,
              "W1": rng.standard_normal((cin, cin, 3, 3)) * 0.2,
              "WT": rng.standard_normal(w_shape),
              "K": rng.standard_normal((1, cout, 1, 1)) + 2.0,
              "W2": rng.standard_normal((4, cout, 1, 1)),
              "W3": rng.standard_normal((4, 4, 3, 3)) * 0.3}
    nodes = [helper.make_node("Conv", ["x", "W0"], ["a"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Conv", ["b", "W1"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c"], ["d"]),
             helper.make_node("ConvTranspose", ["d", "WT"], ["e"], name="up", group=group,
                              strides=[2, 2], kernel_shape=list(w_shape[2:])),
             helper.make_node(op, ["e", "K"], ["f"], name="scale"),
             helper.make_node("Sigmoid", ["f"], ["g"]),
             helper.make_node("Conv", ["g", "W2"], ["h"]),
             helper.make_node("Relu", ["h"], ["i"]),
             helper.make_node("Conv", ["i", "W3"], ["j"]),
             helper.make_node("Sigmoid", ["j"], ["y"])]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor(k, TensorProto.FLOAT, v.shape, v.astype(np.float32).ravel())
         for k, v in consts.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m.SerializeToString()


@pytest.mark.slow  # two compiles per case
@pytest.mark.parametrize("w_shape, group, op", [
    ((8, 1, 2, 2), 1, "Add"),  # PaddleOCR's detector: 8 channels in, 1 out, its bias
    ((8, 2, 2, 2), 4, "Mul"),  # grouped, as many channels in as out
    ((8, 8, 2, 2), 1, "Mul"),
])
def test_a_constant_after_a_conv_transpose_runs_eagerly_between_programs(
        w_shape, group, op, cache):
    """Inductor's freezing folds a constant Add/Mul after a ConvTranspose into it along
    the wrong axis: PaddleOCR's detector failed to compile ("expected bias to be
    1-dimensional"), and a per-channel Mul with as many channels in as out compiled to
    wrong results. That one layer now runs eagerly; the ConvTranspose and the layers
    around it are compiled, and the results match onnxruntime's."""
    blob = _conv_transpose_then(w_shape, group, op)
    x = np.random.default_rng(1).standard_normal((1, 3, 6, 6)).astype(np.float32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sess = kiln.InferenceSession(blob, backend="torch", compile=True)
        got = sess.run(None, {"x": x})[0]
    ref = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(got, ref.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert sess.backend.last_run_stats().compiled
    status = sess.placement().compiled
    assert status.startswith("yes, in parts: 2 program(s)"), status
    assert f"'scale' ({op})" in status and "'up'" not in status, status
    assert [e.split()[0] for e in sess.backend.compile_log] == ["compiled", "compiled"]
    lines = [str(w.message) for w in caught if issubclass(w.category, CompileWarning)]
    assert len(lines) == 1 and "ConvTranspose" in lines[0], lines
