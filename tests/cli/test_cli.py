"""The ``kiln`` command line, each command run in a subprocess, and the tool APIs behind it
(inspect, profile with its Chrome trace, bench, report)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from conftest import LIGHT_DIR, make_model
from kiln import tools

DEFAULT_BACKEND = "torch" if importlib.util.find_spec("torch") else "numpy"
"""What a command given no --backend runs on: torch wherever it is installed."""

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def kiln_cli(*args: str, cwd=None, timeout: int = 300,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``kiln ARGS`` as a user runs it (``python -m kiln.cli`` of this interpreter), with
    ``env`` added to the environment."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kiln.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout, env=env)


def ok(r: subprocess.CompletedProcess) -> str:
    assert r.returncode == 0, f"exit {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


def tiny_cnn(batch="batch") -> onnx.ModelProto:
    """x[batch,3,8,8] -> Conv -> Relu -> Conv -> Add(residual) -> Relu -> GlobalAveragePool
    -> Flatten -> Gemm -> Softmax: every kind of layer the tools treat specially."""
    rng = np.random.default_rng(0)

    def t(name, *shape):
        return numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32) * 0.3, name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c2", "r1"], ["s"], name="residual"),
        helper.make_node("Relu", ["s"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wf", "bf"], ["logits"], name="fc", transB=1),
        helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=-1),
    ]
    return make_model(
        nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 5])],
        [t("w1", 8, 3, 3, 3), t("b1", 8), t("w2", 8, 8, 3, 3), t("wf", 5, 8), t("bf", 5)])


# conv1: 2*8*64*27 + 512 (bias), conv2: 2*8*64*72 + 512, relu/add: 512 each,
# pool: 512, gemm: 2*5*8 + 5, softmax: 3*5 (all per batch item)
TINY_FLOPS = (2 * 8 * 64 * 27 + 512) + (2 * 8 * 64 * 72 + 512) + 3 * 512 + 512 + 85 + 15


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("cli") / "tiny.onnx"
    onnx.save(tiny_cnn(), str(p))
    return str(p)


@pytest.fixture(scope="module")
def runnable(tiny) -> str:
    """The tiny model, when every op it uses has a NumPy kernel (else the test skips)."""
    missing = tools.inspect(tiny).unsupported
    if missing:
        pytest.skip(f"op kernels not implemented yet: {', '.join(missing)}")
    return tiny


# -- the command line as a whole -------------------------------------------------------

COMMANDS = ["inspect", "optimize", "run", "profile", "bench", "report"]


@pytest.mark.parametrize("cmd", [None, *COMMANDS])
def test_help(cmd):
    r = kiln_cli(*([cmd] if cmd else []), "--help")
    out = ok(r)
    assert out.startswith("usage: kiln")
    if cmd is None:
        for c in [*COMMANDS, "zoo"]:
            assert c in out


def test_usage_errors_exit_2(tiny):
    assert kiln_cli().returncode == 2  # no command
    assert kiln_cli("frobnicate").returncode == 2
    assert kiln_cli("inspect").returncode == 2  # no model
    r = kiln_cli("inspect", tiny, "--dim", "batch")
    assert r.returncode == 2 and "NAME=N" in r.stderr
    r = kiln_cli("run", tiny)  # neither --input nor --random
    assert r.returncode == 2 and "--random" in r.stderr and "Traceback" not in r.stderr
    assert kiln_cli("profile", tiny, "--runs", "0").returncode == 2
    assert kiln_cli("bench", tiny, "--vs", "tensorflow").returncode == 2


def test_failures_exit_1_without_traceback(tmp_path):
    r = kiln_cli("inspect", tmp_path / "nope.onnx")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("kiln: error:")
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"this is not a protobuf")
    r = kiln_cli("run", bad, "--random")
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_console_script_declared():
    from importlib.metadata import entry_points

    eps = [e for e in entry_points(group="console_scripts") if e.name == "kiln"]
    if not eps:
        pytest.skip("kiln is not pip-installed here, so no console script to check")
    assert eps[0].value == "kiln.cli:main"
    assert eps[0].load() is kiln.cli.main


def test_zoo_delegates():
    r = kiln_cli("zoo", "--help")
    if importlib.util.find_spec("kiln.zoo.__main__") is None:
        assert r.returncode == 1 and "zoo" in r.stderr
    else:
        assert ok(r).startswith("usage: kiln zoo")


# -- inspect ----------------------------------------------------------------------------

def test_inspect_text(tiny):
    out = ok(kiln_cli("inspect", tiny))
    assert re.search(r"^\s+x\s+float32\s+\(batch, 3, 8, 8\)$", out, re.M)
    assert re.search(r"^\s+y\s+float32\s+\(batch, 5\)$", out, re.M)
    lines = out.splitlines()
    start = lines.index("layers (9, in run order)")
    rows = lines[start + 2:start + 11]
    assert [r.split()[2] for r in rows] == ["Conv", "Relu", "Conv", "Add", "Relu",
                                            "GlobalAveragePool", "Flatten", "Gemm", "Softmax"]
    assert "(batch, 8, 8, 8)" in rows[0] and "(batch, 1, 1)" not in rows[0]
    assert "parameters: 845" in out  # 216 + 8 + 576 + 40 + 5
    assert "FLOPs (estimated):" in out and "batch=1" in out


def test_inspect_json(tiny):
    s = json.loads(ok(kiln_cli("inspect", tiny, "--json", "--dim", "batch=4")))
    assert s["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 3, 8, 8]}]
    assert [x["name"] for x in s["layers"]] == ["conv1", "relu1", "conv2", "residual", "relu2",
                                               "pool", "flatten", "fc", "softmax"]
    assert s["layers"][0]["outputs"][0]["shape"] == ["batch", 8, 8, 8]
    assert s["layers"][5]["outputs"][0]["shape"] == ["batch", 8, 1, 1]
    assert s["op_histogram"]["Relu"] == 2 and s["op_histogram"]["Conv"] == 2
    assert s["params"] == 845 and s["param_bytes"] == 845 * 4
    assert s["flops"] == 4 * TINY_FLOPS
    assert s["layers"][0]["flops"] == 4 * (2 * 8 * 64 * 27 + 512)
    assert s["dim_sizes"] == {"batch": 4}
    assert s["backend"] == DEFAULT_BACKEND and s["device"] == "cpu"


def test_inspect_dims_and_unsupported(tmp_path):
    """Fixed, symbolic and unknown dims are told apart; an op no backend has is listed
    (not raised), and its layer is marked."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "seq", None])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Frobnicate", ["r"], ["y"], name="mystery", domain="com.acme")]
    m = make_model(nodes, [x], [y])
    m.opset_import.append(helper.make_opsetid("com.acme", 1))
    p = tmp_path / "odd.onnx"
    onnx.save(m, str(p))
    out = ok(kiln_cli("inspect", p))
    assert "(1, seq, ?)" in out
    assert f"unsupported on {DEFAULT_BACKEND}: com.acme.Frobnicate (opset 1)" in out
    assert "UNSUPPORTED" in out
    s = json.loads(ok(kiln_cli("inspect", p, "--json")))
    assert s["inputs"][0]["shape"] == [1, "seq", None]
    assert s["unsupported"] == ["com.acme.Frobnicate (opset 1)"]
    assert [x["supported"] for x in s["layers"]] == [True, False]


def test_inspect_light_model():
    path = os.path.join(LIGHT_DIR, "light_squeezenet.onnx")
    if not os.path.exists(path):
        pytest.skip("onnx's light models are not installed")
    s = json.loads(ok(kiln_cli("inspect", path, "--json")))
    model = onnx.load(path)
    assert len(s["layers"]) == len(model.graph.node)
    convs = [x for x in s["layers"] if x["op_type"] == "Conv"]
    assert convs and all(x["flops"] is not None for x in convs)


def test_inspect_torch_placement(tiny):
    pytest.importorskip("torch")
    s = json.loads(ok(kiln_cli("inspect", tiny, "--backend", "torch", "--json")))
    assert s["backend"] == "torch" and s["device"] == "cpu"
    supported = [x for x in s["layers"] if x["supported"]]
    assert supported and all(x["where"] == "cpu" for x in supported)
    assert all(x["how"] for x in supported)


def test_cuda_without_gpu_fails_cleanly(tiny):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    r = kiln_cli("inspect", tiny, "--backend", "torch", "--device", "cuda")
    assert r.returncode == 1 and "CUDA" in r.stderr and "Traceback" not in r.stderr
    r = kiln_cli("inspect", tiny, "--backend", "numpy", "--device", "cuda")  # CPU only
    assert r.returncode == 1 and "--backend torch" in r.stderr


def test_flops_of_conv_transpose_and_matmul():
    from kiln.ir import DType, Node, TensorType, Value
    from kiln.tools.flops import layer_flops

    def val(name, *shape):
        return Value(name, TensorType(DType.FLOAT, shape))

    # ConvTranspose: X[1,4,5,5], W[4,2,3,3] -> each input pixel scatters 2*9 MACs per channel
    n = Node("ConvTranspose", [val("x", 1, 4, 5, 5), val("w", 4, 2, 3, 3)], [val("y", 1, 2, 7, 7)])
    assert layer_flops(n) == 2 * (4 * 25) * (2 * 9)
    # batched MatMul with a symbolic dim sized by the caller
    n = Node("MatMul", [val("a", "b", 3, 4, 6), val("w", 6, 5)], [val("y", "b", 3, 4, 5)])
    assert layer_flops(n, {"b": 2}) == 2 * (2 * 3 * 4 * 5) * 6
    n = Node("MatMul", [val("a", None, 4), val("w", 4, 5)], [Value("y")])
    assert layer_flops(n) is None  # output shape unknown
    # Gemm on a reshaped [batch*seq, K] input: the expression is evaluated
    n = Node("Gemm", [val("a", "batch*seq", 8), val("w", 8, 3)], [val("y", "batch*seq", 3)])
    assert layer_flops(n, {"batch": 2, "seq": 5}) == 2 * (10 * 3) * 8


# -- run --------------------------------------------------------------------------------

def test_run_random_saves_outputs(runnable, tmp_path):
    out = ok(kiln_cli("run", runnable, "--random", "--dim", "batch=3", "--output",
                      tmp_path / "out.npz"))
    assert "y" in out and "float32" in out and "(3, 5)" in out
    assert "min" in out and "max" in out and "mean" in out
    with np.load(tmp_path / "out.npz") as f:
        y = f["y"]
    assert y.shape == (3, 5)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)  # softmax rows


@pytest.mark.parametrize("fmt", ["npy", "pb", "npz", "npz-bare"])
def test_run_inputs_from_files(runnable, tmp_path, fmt):
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    if fmt == "npy":
        np.save(tmp_path / "x.npy", x)
        spec = f"x={tmp_path / 'x.npy'}"
    elif fmt == "pb":
        (tmp_path / "x.pb").write_bytes(numpy_helper.from_array(x, "x").SerializeToString())
        spec = f"x={tmp_path / 'x.pb'}"
    else:
        np.savez(tmp_path / "in.npz", x=x)
        spec = str(tmp_path / "in.npz") if fmt == "npz-bare" else f"x={tmp_path / 'in.npz'}"
    ok(kiln_cli("run", runnable, "--input", spec, "--output", tmp_path / "o.npz"))
    (want,) = kiln.InferenceSession(runnable).run(None, {"x": x})
    with np.load(tmp_path / "o.npz") as f:
        np.testing.assert_allclose(f["y"], want, rtol=1e-6)


def test_run_with_torch_precision_and_compile(runnable, tmp_path):
    """--precision and --compile reach the torch session: bf16 is close to onnxruntime's
    fp32 output but not the fp32 run's, compiled fp32 matches it; on the numpy backend
    both are refused with what to do instead."""
    pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    x = np.random.default_rng(2).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    want = ort.InferenceSession(str(runnable)).run(None, {"x": x})[0]
    got, said = {}, {}
    for name, extra in (("fp32", []), ("bf16", ["--precision", "bf16"]),
                        ("compiled", ["--compile"])):
        out = tmp_path / f"{name}.npz"
        said[name] = json.loads(ok(kiln_cli(
            "run", runnable, "--input", f"x={tmp_path / 'x.npy'}", "--backend", "torch",
            *extra, "--output", out, "--json", env={"KILN_COMPILE_CACHE": "0"})))
        with np.load(out) as f:
            got[name] = f["y"]
    assert [said[k]["compiled"] for k in said] == [False, False, True]
    assert [said[k]["precision"] for k in said] == ["fp32", "bf16", "fp32"]
    np.testing.assert_allclose(got["fp32"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["compiled"], want, rtol=1e-5, atol=1e-6)
    # bf16 keeps 8 bits of mantissa: off by ~1e-3 where fp32 is off by ~1e-7
    err = np.linalg.norm(got["bf16"] - want) / np.linalg.norm(want)
    assert 1e-4 < err < 5e-2, err
    for extra in (["--precision", "bf16"], ["--compile"]):
        r = kiln_cli("run", runnable, "--random", "--backend", "numpy", *extra)
        assert r.returncode == 1 and "needs --backend torch" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_run_bad_input_is_a_failure(runnable, tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((2, 3, 8, 8), np.float64))
    r = kiln_cli("run", runnable, "--input", f"x={tmp_path / 'x.npy'}")
    assert r.returncode == 1 and "double" in r.stderr and "Traceback" not in r.stderr
    r = kiln_cli("run", runnable, "--input", f"nope={tmp_path / 'x.npy'}")
    assert r.returncode == 1 and "unknown input" in r.stderr


# -- profile and its trace ---------------------------------------------------------------

def validate_trace(trace: dict) -> list[dict]:
    """Check ``trace`` against Chrome's trace-event format (JSON object form); returns the
    complete events."""
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list)
    assert trace.get("displayTimeUnit", "ms") in ("ms", "ns")
    complete = []
    for e in trace["traceEvents"]:
        assert isinstance(e["name"], str) and e["name"]
        assert e["ph"] in ("X", "M", "B", "E", "i", "C")
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if "args" in e:
            assert isinstance(e["args"], dict)
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "thread_name") and "name" in e["args"]
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0
            assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0
            assert isinstance(e.get("cat", ""), str)
            complete.append(e)
    json.dumps(trace)  # serializable as is
    return complete


def test_profile_cli_table_and_trace(runnable, tmp_path):
    trace = tmp_path / "trace.json"
    out = ok(kiln_cli("profile", runnable, "--runs", "3", "--dim", "batch=4", "--trace", trace))
    assert "mean ms" in out and "by op type" in out and "total" in out
    assert "(4, 5)" in out  # shapes as run
    events = validate_trace(json.loads(trace.read_text()))
    runs = [e for e in events if e["cat"] == "run"]
    layers = [e for e in events if e["cat"] != "run"]
    assert len(runs) == 3 and layers and len(layers) % 3 == 0
    for e in layers:  # every layer call lies inside its run
        r = runs[e["args"]["run"]]
        assert r["ts"] <= e["ts"] + 1e-3 and e["ts"] + e["dur"] <= r["ts"] + r["dur"] + 1e-3


def test_profile_json(runnable):
    p = json.loads(ok(kiln_cli("profile", runnable, "--runs", "2", "--json")))
    assert p["runs"] == 2 and p["layers"]
    assert abs(sum(x["share"] for x in p["layers"]) - 1) < 1e-6
    assert abs(sum(o["ms"] for o in p["by_op"]) - p["layer_total_ms"]) < 1e-6
    assert p["layer_total_ms"] <= p["wall_mean_ms"]


def test_profile_totals_consistent_with_wall_time(runnable):
    """Per-layer times add up to at most each run's measured time, and to most of it (the
    rest is the plan's bookkeeping); the runs fit in the wall time of the whole call."""
    x = np.random.default_rng(0).standard_normal((64, 3, 8, 8)).astype(np.float32)
    t0 = time.perf_counter()
    p = tools.profile(runnable, {"x": x}, runs=5, warmup=1)
    outer_ms = (time.perf_counter() - t0) * 1e3
    assert len(p.wall_ms) == 5 and all(len(x.times_ms) == 5 for x in p.layers)
    inside = [sum((b - a) * 1e3 for run, _, a, b in p.events if run == r) for r in range(5)]
    for got, wall in zip(inside, p.wall_ms):
        assert got <= wall
    # most of a run is kernels (summed over runs: one preempted gap must not fail this)
    assert sum(inside) >= 0.5 * sum(p.wall_ms), (inside, p.wall_ms)
    assert p.layer_total_ms <= p.wall_mean_ms
    assert sum(p.wall_ms) <= outer_ms
    ops = p.by_op()
    assert sum(o.count for o in ops) == len(p.layers)
    assert abs(sum(o.share for o in ops) - 1) < 1e-9


def test_profile_accepts_a_session(runnable):
    sess = kiln.InferenceSession(runnable)
    p = tools.profile(sess, runs=2)
    assert [x.name for x in p.layers] == [s.node.name or f"{s.node.op_type}_{i}"
                                         for i, s in enumerate(sess.plan.steps)]
    assert p.layers[-1].shape == [1, 5]


# -- bench ------------------------------------------------------------------------------

def test_bench_vs_onnxruntime(runnable):
    pytest.importorskip("onnxruntime")
    b = json.loads(ok(kiln_cli("bench", runnable, "--vs", "onnxruntime", "--runs", "6",
                               "--warmup", "1", "--batch", "2", "--threads", "1", "--json")))
    assert b["batch"] == 2 and b["threads"] == 1
    for k in ("kiln", "other"):
        st = b[k]
        assert st["runs"] == 6
        assert 0 < st["min_ms"] <= st["p50_ms"] <= st["p90_ms"] <= st["p99_ms"]
        assert st["throughput_per_s"] > 0
    assert b["other"]["engine"] == "onnxruntime"
    # Kiln / other, as docs/performance.md has it: above 1 means Kiln takes longer
    assert b["ratio"] == pytest.approx(b["kiln"]["p50_ms"] / b["other"]["p50_ms"])
    assert b["comparison"].endswith(f"(Kiln / onnxruntime = {b['ratio']:.3f})")
    out = ok(kiln_cli("bench", runnable, "--vs", "onnxruntime", "--runs", "3", "--warmup", "0"))
    assert "p50 ms" in out and "onnxruntime" in out
    line = [x for x in out.splitlines() if x.startswith("Kiln ")]
    assert len(line) == 1 and "/ kiln" not in out, out
    m = re.search(r"\(Kiln / onnxruntime = ([0-9.]+)\)$", line[0])
    assert m, line
    ratio = float(m.group(1))
    if ratio > 1:
        words = re.search(r"Kiln takes ([0-9.]+)x as long as onnxruntime", line[0])
        assert words, line
        # the words round the exact ratio to 2 decimals, the parenthesis to 3: rounding the
        # 3-decimal figure again could differ in the last digit (9.565 -> 9.56, not 9.57)
        assert abs(float(words.group(1)) - ratio) <= 0.0051
    else:
        assert "Kiln is" in line[0] and "faster than onnxruntime" in line[0]


def test_bench_compiled_says_so(runnable):
    pytest.importorskip("torch")
    env = {"KILN_COMPILE_CACHE": "0"}
    b = json.loads(ok(kiln_cli("bench", runnable, "--backend", "torch", "--compile",
                               "--runs", "3", "--warmup", "1", "--json", env=env)))
    assert b["compile_status"].startswith("yes") and b["precision"] == "fp32"
    out = ok(kiln_cli("bench", runnable, "--backend", "torch", "--compile", "--precision",
                      "bf16", "--runs", "2", "--warmup", "1", env=env))
    assert "kiln (torch, cpu, bf16, compiled)" in out, out


@pytest.mark.parametrize("kiln_ms, ort_ms, words", [
    (4.6, 1.0, "Kiln takes 4.60x as long as onnxruntime at p50 (Kiln / onnxruntime = 4.600)"),
    (1.0, 1.3, "Kiln is 1.30x faster than onnxruntime at p50 (Kiln / onnxruntime = 0.769)"),
])
def test_bench_comparison_words(kiln_ms, ort_ms, words):
    """The ratio is Kiln / other everywhere, and said in words both ways round."""
    from kiln.cli.format import bench_text
    from kiln.tools.benchmark import BenchResult, Stats

    r = BenchResult("m", "numpy", "cpu", 1, 1, 0, Stats("kiln", [kiln_ms] * 3),
                    Stats("onnxruntime", [ort_ms] * 3))
    assert r.ratio == pytest.approx(kiln_ms / ort_ms)
    assert r.comparison() == words
    assert bench_text(r).splitlines()[-1] == words
    assert r.to_dict()["ratio"] == r.ratio


def test_bench_batch_must_fit_a_fixed_dim(tmp_path):
    p = tmp_path / "fixed.onnx"
    onnx.save(tiny_cnn(batch=1), str(p))
    r = kiln_cli("bench", p, "--batch", "4", "--runs", "1")
    assert r.returncode == 1 and "fixed first dim" in r.stderr


def test_bench_progress_without_tqdm(runnable, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    r = tools.bench(runnable, runs=4, warmup=1, progress=True)
    assert len(r.kiln.latencies_ms) == 4 and r.other is None
    assert "5/5" in capsys.readouterr().err


def test_switch_rest_rests_only_when_the_engine_changes(monkeypatch):
    """The one alternation rule of kiln bench --vs, kiln tune's harness and
    benchmarks/tune.py: a rest before a run whose engine is not the last one's."""
    from kiln.tools import benchmark

    slept: list[float] = []
    monkeypatch.setattr(benchmark, "sleep", slept.append)
    rest = benchmark.SwitchRest()
    for who in ["kiln", "kiln", "ort", "ort", "kiln", "ort"]:
        rest(who)
    assert rest.rests == 3 and slept == [benchmark.SWITCH_REST_S] * 3


def test_bench_vs_rests_at_each_engine_switch(runnable, monkeypatch):
    """Alternating order each round (kiln, ort / ort, kiln) switches engine once a round."""
    pytest.importorskip("onnxruntime")
    from kiln.tools import benchmark

    slept: list[float] = []
    monkeypatch.setattr(benchmark, "sleep", slept.append)
    r = tools.bench(runnable, runs=4, warmup=1, vs="onnxruntime")
    assert len(r.kiln.latencies_ms) == len(r.other.latencies_ms) == 4
    assert slept == [benchmark.SWITCH_REST_S] * 5


def test_bench_draws_no_bar_off_a_terminal(runnable, capsys):
    """By default the bar is drawn only on a terminal: pytest's captured stderr is not one,
    as a log file or a pipe is not."""
    tools.bench(runnable, runs=3, warmup=1)
    assert capsys.readouterr().err == ""
    tools.bench(runnable, runs=3, warmup=1, progress=True)  # asked for: drawn anyway
    assert "bench" in capsys.readouterr().err


def test_cli_bench_into_a_pipe_has_no_bar(runnable):
    r = kiln_cli("bench", runnable, "--runs", "3", "--warmup", "1")
    ok(r)
    # Only the one-line hint about the faster backend (tests/cli/test_cli_progress.py), and the
    # plain "still building" lines a session slow to build prints in a pipe (torch's import
    # on a loaded machine takes seconds)
    assert "\r" not in r.stderr
    assert all(line.startswith(("kiln: hint:", "kiln bench: building the session, "))
               for line in r.stderr.splitlines()), r.stderr


# -- optimize ---------------------------------------------------------------------------

def test_optimize(runnable, tmp_path):
    if not hasattr(kiln, "optimize"):
        pytest.skip("kiln.optimize is not implemented yet")
    out = tmp_path / "opt.onnx"
    text = ok(kiln_cli("optimize", runnable, "-o", out, "--input-shape", "x=2,3,8,8"))
    assert "nodes" in text and "->" in text
    assert "x (2, 3, 8, 8)" in text
    x = np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)
    (a,) = kiln.InferenceSession(runnable, optimize=False).run(None, {"x": x})
    (b,) = kiln.InferenceSession(str(out)).run(None, {"x": x})
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    r = kiln_cli("optimize", runnable, "-o", out, "--disable", "no_such_pass")
    assert r.returncode == 2 and "no_such_pass" in r.stderr
    ok(kiln_cli("optimize", runnable, "-o", tmp_path / "same.onnx", "--no-optimize"))
    assert len(onnx.load(str(tmp_path / "same.onnx")).graph.node) == 9


# -- report -----------------------------------------------------------------------------

def assert_self_contained(page: str) -> None:
    low = page.lower()
    for bad in ("<link rel=\"stylesheet\"", "<script src", "@import", "src=\"http",
                "href=\"http", "url(http"):
        assert bad not in low, bad


def test_report_cli(runnable, tmp_path):
    out = tmp_path / "report.html"
    text = ok(kiln_cli("report", runnable, "-o", out, "--profile", "--runs", "2"))
    assert str(out) in text
    page = out.read_text()
    assert_self_contained(page)
    n_nodes = len(kiln.InferenceSession(runnable).model.graph.nodes)  # the graph that ran
    assert page.count('class="layer"') == n_nodes
    assert "Time by op type" in page and "ms" in page


def test_report_unprofiled_draws_the_file(tiny, tmp_path):
    r = tools.report(tiny, tmp_path / "r.html")
    # a small data object about the file, not the page's text
    assert isinstance(r, tools.HtmlReport) and r.path == tmp_path / "r.html"
    assert os.fspath(r) == str(tmp_path / "r.html")
    page = r.path.read_text()
    assert r.size_bytes == len(page.encode()) and r.layers == 9 and not r.profiled
    assert r.to_dict()["path"] == str(tmp_path / "r.html") and len(repr(r)) < 300
    assert_self_contained(page)
    assert page.count('class="layer"') == 9
    assert page.count('class="edge"') >= 9
    assert "Estimated FLOPs by op type" in page


def test_report_layout_rows():
    """Rows follow the longest path: a residual Add sits below both of its inputs."""
    from kiln.tools.html_report import layout

    m = kiln.load(tiny_cnn())
    boxes, edges, ins, outs, w, h = layout(m.graph)
    row = {n.name: b.row for n, b in zip(m.graph.nodes, boxes)}
    assert row["conv1"] == 1 and row["relu1"] == 2 and row["conv2"] == 3
    assert row["residual"] == 4 and row["softmax"] == 9
    assert list(ins) == ["x"] and list(outs) == ["y"]
    assert (1, 3, "r1") in edges and (0, 1, "c1") in edges
    assert all(0 < b.x < w and 0 < b.y < h for b in boxes)
    cells = {(round(b.x), b.row) for b in boxes}
    assert len(cells) == len(boxes)  # no two boxes on top of each other


def test_report_layout_puts_constants_by_their_reader():
    from kiln.tools.html_report import layout

    c = helper.make_tensor("cv", TensorProto.FLOAT, [1], [2.0])
    nodes = [helper.make_node("Constant", [], ["c"], name="const", value=c),
             helper.make_node("Relu", ["x"], ["a"], name="r1"),
             helper.make_node("Relu", ["a"], ["b"], name="r2"),
             helper.make_node("Relu", ["b"], ["d"], name="r3"),
             helper.make_node("Add", ["d", "c"], ["y"], name="add")]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in "xy"]
    m = kiln.load(make_model(nodes, vi[:1], vi[1:]))
    boxes = layout(m.graph)[0]
    row = {n.name: b.row for n, b in zip(m.graph.nodes, boxes)}
    assert row["add"] == 4 and row["const"] == 3


# -- the first ten minutes: help, typos, missing extras, long builds -----------------------

def test_every_option_has_help():
    """Each option of each command says what it is for in ``--help``."""
    from kiln.cli import build_parser

    ap = build_parser()
    sub = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
    missing = [f"kiln {name} {'/'.join(a.option_strings) or a.dest}"
               for name, p in sub.choices.items() for a in p._actions
               if not a.help and name != "zoo"]
    assert missing == []


def test_report_output_option_is_described():
    out = " ".join(ok(kiln_cli("report", "-h")).split())
    assert "-o REPORT.html, --output REPORT.html the HTML file to write" in out


def test_inspect_backend_help_says_nothing_runs():
    inspect_help = " ".join(ok(kiln_cli("inspect", "-h")).split())
    assert "backend to run on" not in inspect_help
    assert "nothing is run" in inspect_help and "fusions" in inspect_help
    run_help = " ".join(ok(kiln_cli("run", "-h")).split())
    assert "backend to run on" in run_help  # commands that do run keep saying so


def test_zoo_name_typo_suggests_the_name(tmp_path):
    r = kiln_cli("inspect", "resnet", cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "did you mean the zoo model resnet18" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = kiln_cli("zoo", "build", "resnt18")
    assert r.returncode == 2 and "did you mean resnet18" in r.stderr, r.stderr
    # a name close to nothing gets no made-up suggestion
    r = kiln_cli("inspect", "qqqqqq", cwd=tmp_path)
    assert r.returncode == 1 and "did you mean" not in r.stderr


def blocked_modules(tmp_path, *names: str) -> dict[str, str]:
    """Environment for a subprocess in which importing each of ``names`` fails as if it
    were not installed: a module of that name first on the path raises ImportError."""
    d = tmp_path / "blocked"
    d.mkdir(exist_ok=True)
    for n in names:
        msg = f"No module named {n!r} (blocked by the test)"
        (d / f"{n}.py").write_text(f"raise ImportError({msg!r})\n")
    old = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": str(d) + (os.pathsep + old if old else "")}


def one_line_error(r: subprocess.CompletedProcess) -> str:
    """The single ``kiln: error:`` line of a failed command, without a traceback."""
    assert r.returncode == 1, f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(("kiln: error:", "kiln zoo: error:")), r.stderr
    return lines[0]


def test_missing_onnxruntime_names_the_extra(tmp_path):
    """After the README's first command (no zoo extra), asking for a zoo model that is not
    built says in one line which extra to install (it was a ModuleNotFoundError traceback,
    and ``kiln zoo build`` said only ``FAILED ModuleNotFoundError``)."""
    pytest.importorskip("torch")
    env = {**blocked_modules(tmp_path, "onnxruntime"), "KILN_ZOO_DIR": str(tmp_path / "zoo")}
    for args in (["inspect", "resnet18"], ["run", "emotion_ferplus", "--random"],
                 ["zoo", "build", "resnet18"]):
        line = one_line_error(kiln_cli(*args, env=env, cwd=tmp_path))
        assert "needs onnxruntime, which is not installed" in line, line
        assert line.endswith('pip install -e ".[zoo]"'), line
    assert not (tmp_path / "zoo" / "resnet18").exists()
    r = subprocess.run([sys.executable, "-m", "kiln.zoo", "build", "resnet18"], cwd=tmp_path,
                       capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert 'pip install -e ".[zoo]"' in one_line_error(r)


def test_missing_torch_and_onnxruntime_for_backends(tmp_path, tiny):
    env = blocked_modules(tmp_path, "torch", "onnxruntime")
    line = one_line_error(kiln_cli("inspect", tiny, "--backend", "torch", env=env))
    assert "the torch backend needs torch" in line and line.endswith('pip install -e ".[torch]"')
    line = one_line_error(kiln_cli("run", tiny, "--random", "--backend", "torch", env=env))
    assert line.endswith('pip install -e ".[torch]"'), line
    line = one_line_error(kiln_cli("bench", tiny, "--vs", "onnxruntime", env=env))
    assert "--vs onnxruntime needs onnxruntime" in line and line.endswith("pip install onnxruntime")


def test_missing_dependency_error_is_a_kiln_error_and_an_import_error():
    from kiln.errors import KilnError, MissingDependencyError

    e = MissingDependencyError("onnxruntime", 'pip install -e ".[zoo]"', "building zoo model x")
    assert isinstance(e, KilnError) and isinstance(e, ImportError) and e.name == "onnxruntime"
    assert str(e) == ('building zoo model x needs onnxruntime, which is not installed: '
                      'pip install -e ".[zoo]"')


def test_building_on_demand_says_what_it_does(tmp_path):
    """A zoo model used before it is built is built first, and stderr says so: what is being
    built, where, each step, how long it took -- as plain lines, not a redrawn bar, since
    stderr is a pipe here. stdout is the command's usual output."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    env = {"KILN_ZOO_DIR": str(tmp_path / "zoo")}
    r = kiln_cli("run", "emotion_ferplus", "--random", env=env)
    out = ok(r)
    assert out.startswith("ran ") and "logits" in out
    err = r.stderr
    assert "\r" not in err and "\x1b" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("kiln: zoo model emotion_ferplus is not built yet; building it "
                               f"into {tmp_path / 'zoo' / 'emotion_ferplus'}"), err
    steps = [x for x in lines if x.startswith("building emotion_ferplus: [")
             and "still running" not in x]  # a step past 5 s says so (test_cli_progress.py)
    assert [x.split("]")[0][-3:] for x in steps] == ["1/5", "2/5", "3/5", "4/5", "5/5"], err
    assert any("exporting to ONNX (torchscript exporter" in x for x in steps), err
    assert re.fullmatch(r"building emotion_ferplus: built in [0-9.]+ s", lines[-1]), err
    r = kiln_cli("run", "emotion_ferplus", "--random", env=env)  # now cached: nothing said
    ok(r)
    assert r.stderr == ""


def test_zoo_build_into_a_pipe_draws_no_bar(tmp_path):
    """``kiln zoo build`` in a log or a pipe: one plain line per model, no tqdm bar."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    env = {"KILN_ZOO_DIR": str(tmp_path / "zoo")}
    r = kiln_cli("zoo", "build", "emotion_ferplus", env=env)
    out = ok(r)
    assert out.strip() == str(tmp_path / "zoo" / "emotion_ferplus" / "model.onnx")
    assert "\r" not in r.stderr and "model/s" not in r.stderr and "it/s" not in r.stderr
    lines = r.stderr.strip().splitlines()
    still = [x for x in lines if "(still running), " in x]  # a step past 5 s says so
    assert all(x.startswith("emotion_ferplus: ") for x in still), r.stderr
    lines = [x for x in lines if x not in still]
    assert lines[0].startswith("emotion_ferplus") and "exporting to ONNX" in lines[0]
    assert re.match(r"emotion_ferplus\s+built in [0-9.]+s", lines[-1]), r.stderr
    r = kiln_cli("zoo", "build", "emotion_ferplus", "-q", env=env)
    assert ok(r) == out and r.stderr == ""


def test_step_reporter_ticks_on_a_terminal_and_writes_lines_off_it():
    import io
    import time as _time

    from kiln.tools.progress import StepReporter

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    with StepReporter("building m", 2, stream=tty) as rep:
        rep.step("exporting")
        _time.sleep(2.0)  # one long step: the clock keeps ticking (every 0.5 s) meanwhile
        rep.done("built")
    text = tty.getvalue()
    # drawn at the step, then redrawn in place while it runs (>= 2 of ~4 ticks, on a busy box)
    assert text.count("\rbuilding m: [1/2] exporting") >= 3, text
    assert text.endswith("building m: built\n")
    log = io.StringIO()  # not a terminal: plain lines only
    with StepReporter("building m", 2, stream=log) as rep:
        rep.step("exporting")
        rep.step("checking")
        rep.done("built")
    assert log.getvalue() == ("building m: [1/2] exporting\nbuilding m: [2/2] checking\n"
                              "building m: built\n")
