"""``kiln tune`` and the run settings a tuned file carries.

Oracles: onnxruntime runs the tuned file (it must stay a standard ONNX file, and its
outputs are what Kiln's must match within the chosen precision's tolerance); the
settings are read back from the file with ``onnx`` itself, not through Kiln."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from conftest import make_model, ort_run
from kiln.errors import InputError, OptionError

pytest.importorskip("torch")

DIGITS = Path(kiln.__file__).parent / "data"
KEY = "kiln.run_settings"
# Worst |kiln - onnxruntime| / max |onnxruntime| the tuned file may show, by what it runs:
# fp32 reorders sums only; bf16 keeps 8 bits of mantissa in products; int8 layers round
# differently in each engine (one quantization step of an activation at most, mostly).
TOLERANCE = {"fp32": 1e-4, "bf16": 3e-2, "int8": 5e-2}


def _settings(path: Path) -> dict:
    props = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    return json.loads(props[KEY])


def _digits_data(tmp_path: Path, rows: int = 64) -> tuple[Path, np.ndarray]:
    images = np.load(DIGITS / "digits_test.npz")["images"][:rows]
    data = tmp_path / "calib.npz"
    np.savez(data, image=images)
    return data, images


def test_tune_writes_the_winner_with_its_settings_and_onnxruntime_agrees(tmp_path):
    data, images = _digits_data(tmp_path)
    out = tmp_path / "tuned.onnx"
    r = kiln.tune(DIGITS / "digits_cnn.onnx", str(data), batch=4, time_budget=20,
                  output=out)
    onnx.checker.check_model(str(out))
    settings = _settings(out)
    assert settings["backend"] == r.winner.backend
    assert settings["options"] == r.winner.settings()
    # Every candidate measured is listed; the winner meets the budget and is the fastest
    # of those that do.
    ok = [c for c in r.candidates if c.status == "ok" and c.latencies_ms]
    assert r.winner in ok and r.winner.ms == min(c.ms for c in ok)
    assert r.rounds >= 3 and all(len(c.latencies_ms) == r.rounds for c in ok)
    assert "fastest" in str(r) and str(r.budget) in str(r)

    sess = kiln.InferenceSession(str(out))  # one line: the stored settings are used
    assert sess.backend.name == settings["backend"]
    opts = settings["options"]
    assert getattr(sess.backend, "precision", "fp32") == opts.get("precision", "fp32")
    assert getattr(sess.backend, "compile", False) == opts.get("compile", False)
    x = images[:8]
    got = sess.run(None, {"image": x})[0]
    want = ort_run(str(out), {"image": x})[0]
    kind = "int8" if r.winner.int8 else opts.get("precision", "fp32")
    assert np.abs(got - want).max() / np.abs(want).max() <= TOLERANCE[kind]
    # Explicit arguments win over the stored ones.
    assert kiln.InferenceSession(str(out), backend="numpy").backend.name == "numpy"


def test_stored_settings_are_picked_up_and_explicit_ones_win(tmp_path, mlp_model):
    mlp_model.metadata_props.add(key=KEY, value=json.dumps(
        {"backend": "torch", "options": {"precision": "bf16", "threads": 1}}))
    path = tmp_path / "m.onnx"
    onnx.save(mlp_model, str(path))
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    sess = kiln.InferenceSession(str(path))
    assert (sess.backend.name, sess.backend.precision) == ("torch", "bf16")
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], ort_run(str(path), {"x": x})[0],
                               atol=3e-2)
    # An option given wins over the stored one; a backend given ignores the stored ones.
    assert kiln.InferenceSession(str(path), precision="fp32").backend.precision == "fp32"
    assert kiln.InferenceSession(str(path), backend="numpy").backend.name == "numpy"
    # `kiln run` with no --backend uses them too.
    cp = subprocess.run([sys.executable, "-m", "kiln", "run", str(path), "--random",
                         "--json"], capture_output=True, text=True, check=True)
    got = json.loads(cp.stdout)
    assert (got["backend"], got["precision"]) == ("torch", "bf16")


def test_tune_without_data_tries_exact_transformations_only(tmp_path):
    out = tmp_path / "t.onnx"
    cp = subprocess.run([sys.executable, "-m", "kiln", "tune", str(DIGITS / "digits_cnn.onnx"),
                         "-o", str(out), "--time-budget", "8", "--json"],
                        capture_output=True, text=True, check=True)
    r = json.loads(cp.stdout)
    assert r["budget"] is None
    names = [c["name"] for c in r["candidates"]]
    assert not any("int8" in n or "bf16" in n for n in names)
    assert "tune:" in cp.stderr  # progress lines
    x = np.load(DIGITS / "digits_test.npz")["images"][:2]
    np.testing.assert_allclose(kiln.InferenceSession(str(out)).run(None, {"image": x})[0],
                               ort_run(str(out), {"image": x})[0], rtol=1e-4, atol=1e-4)


def test_tune_refuses_what_it_cannot_check(tmp_path):
    m = make_model([helper.make_node("Relu", ["x"], ["y"])],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])
    path = tmp_path / "relu.onnx"
    onnx.save(m, str(path))
    with pytest.raises(OptionError, match="rel="):
        kiln.tune(str(path), {"x": np.ones(3, np.float32)}, budget="top1=0.99")
    with pytest.raises(InputError, match="no data file"):
        kiln.tune(str(path), str(tmp_path / "missing.npz"))


def test_a_short_time_budget_skips_candidates_and_says_where_the_time_went(tmp_path):
    """With 4 s, the baseline (numpy and torch fp32 eager) is built and measured; the
    candidates needing a calibration or a compile are skipped and named as such; the report
    accounts for the time by stage and per candidate."""
    data, _ = _digits_data(tmp_path, rows=16)
    r = kiln.tune(DIGITS / "digits_cnn.onnx", str(data), batch=2, time_budget=4)
    by = {c.name: c for c in r.candidates}
    for name in ("torch int8 dynamic", "torch int8 static", "torch fp32 compiled"):
        assert by[name].status.startswith("skipped: out of time"), by[name].status
        assert not by[name].latencies_ms and name in r.why()
    # numpy fp32 is the fp32 reference itself: its session and outputs are reused
    for name, stages in (("numpy fp32", {"build", "measure"}),
                         ("torch fp32 eager", {"build", "check", "measure"})):
        c = by[name]
        assert c.latencies_ms and c.status == "ok"
        assert set(c.seconds) == stages
        # each turn: an untimed run and BLOCK timed ones, the latency their median, so at
        # least the median and the slowest run: twice the recorded latency
        assert c.seconds["measure"] >= 2 * sum(c.latencies_ms) / 1e3
    assert sum(c.seconds["measure"] for c in r.candidates if c.latencies_ms) <= \
        r.stages["measure"]
    assert by["numpy fp32"].accuracy() == "rel 0, top-1 100.00%"
    assert set(r.stages) == {"load", "build", "measure"}
    assert sum(r.stages.values()) <= r.seconds
    text = str(r)
    assert "time:" in text and "torch fp32 eager: build" in text
    assert r.to_dict()["candidates"][0]["seconds"] == by["numpy fp32"].seconds


@pytest.mark.parametrize("mode", ["dynamic", "static"])
def test_an_int8_candidate_that_quantized_no_layer_is_not_measured(mode):
    """A model with nothing to quantize (no Conv/MatMul/Gemm) comes back from
    ``kiln.quantize`` as the fp32 model: measured as an int8 candidate it could only "win"
    on noise (PaddleOCR's classifier at batch 8 won as "int8 dynamic" with no layer
    quantized, then ran 1.15x fp32 eager's time when timed again)."""
    from kiln.errors import KilnError
    from kiln.quantize.api import Budget
    from kiln.tools.common import load_model
    from kiln.tools.tune import NO_LAYER, Candidate, _build

    m = make_model([helper.make_node("Relu", ["x"], ["a"]),
                    helper.make_node("Softmax", ["a"], ["y"], axis=-1)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 10])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 10])])
    feeds = [{"x": np.random.default_rng(i).standard_normal((8, 10)).astype(np.float32)}
             for i in range(2)]
    c = Candidate(f"torch int8 {mode}", "torch", {}, exact=False, int8=mode)
    with pytest.raises(KilnError, match=f"skipped: {NO_LAYER}"):
        _build(c, load_model(m.SerializeToString()), feeds, feeds, Budget(max_rel=0.01),
               feeds[0], 60.0)
    assert c.session is None and "calibrate" in c.seconds


def test_measuring_rests_before_a_run_whose_backend_changed(monkeypatch):
    """NumPy's OpenBLAS workers spin after its run and slowed the torch run timed next
    (docs/performance.md, "Rests between engines and candidates"): tune's rounds rest
    before a run whose backend is not the last run's, longer after NumPy, and not between
    runs of one backend (one thread or two); each candidate's turn is an untimed run and a
    block of timed ones."""
    from kiln.tools import benchmark
    from kiln.tools.tune import BLOCK, Candidate, _measure

    events: list = []
    monkeypatch.setattr(benchmark, "sleep", lambda s: events.append(s))

    class Stub:
        def __init__(self, name):
            self.name = name

        def run(self, names, feed):
            events.append(self.name)

    runs = [Candidate("numpy fp32", "numpy", {}, session=Stub("np")),
            Candidate("torch fp32 eager", "torch", {}, session=Stub("t")),
            Candidate("torch fp32 eager, 1 thread", "torch", {}, threads=1,
                      session=Stub("t1"))]
    assert _measure(runs, {}, deadline=time.perf_counter() + 60, stage=lambda s: None,
                    most=4) == 4
    blas, other = benchmark.BLAS_REST_S, benchmark.SWITCH_REST_S
    assert blas > other
    n = 1 + BLOCK  # one untimed run, then BLOCK timed ones, per candidate and round
    np_, t, t1 = ["np"] * n, ["t"] * n, ["t1"] * n
    assert events == [*np_, blas, *t, *t1, *t1, *t, other, *np_,
                      *np_, blas, *t, *t1, *t1, *t, other, *np_]
    assert all(len(c.latencies_ms) == 4 for c in runs)
