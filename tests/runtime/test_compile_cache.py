"""compile=True programs kept on disk: a second process loads the first one's compiled
package instead of compiling again, and its results still match onnxruntime's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

CHILD = r"""
import json, sys, numpy as np, kiln
sess = kiln.InferenceSession(sys.argv[1], backend="torch", compile=True)
x = np.load(sys.argv[2])
y = sess.run(None, {"x": x})[0]
np.save(sys.argv[3], y)
print(json.dumps({"log": sess.backend.compile_log, "status": sess.placement().compiled,
                  "inductor": "torch._inductor" in sys.modules}))
"""


def _child(model: str, x: str, out: str, cache: str) -> dict:
    env = {**os.environ, "KILN_COMPILE_CACHE": cache}
    done = subprocess.run([sys.executable, "-c", CHILD, model, x, out], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_compiled_program_from_disk(mlp_model, tmp_path):
    model, x_path, cache = tmp_path / "mlp.onnx", tmp_path / "x.npy", tmp_path / "cache"
    onnx.save(mlp_model, model)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.save(x_path, x)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]

    first = _child(str(model), str(x_path), str(tmp_path / "y1.npy"), str(cache))
    assert [e.split()[0] for e in first["log"]] == ["compiled"], first
    assert first["status"].startswith("yes: AOTInductor")
    packages = sorted(p.name for p in cache.iterdir())
    assert len(packages) == 1 and packages[0].endswith(".pt2")  # no temporary left behind

    second = _child(str(model), str(x_path), str(tmp_path / "y2.npy"), str(cache))
    assert [e.split()[0] for e in second["log"]] == ["loaded"], second
    # Loading needs no compiler: importing inductor and its ISA probes took seconds a process
    assert not second["inductor"], second
    assert sorted(p.name for p in cache.iterdir()) == packages
    for out in ("y1.npy", "y2.npy"):
        np.testing.assert_allclose(np.load(tmp_path / out), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # a third compile; the key's coverage of weights, end to end
def test_other_weights_never_reuse_a_cached_program(mlp_model, tmp_path):
    model, x_path, cache = tmp_path / "mlp.onnx", tmp_path / "x.npy", tmp_path / "cache"
    onnx.save(mlp_model, model)
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    np.save(x_path, x)
    assert _child(str(model), str(x_path), str(tmp_path / "y1.npy"), str(cache))["log"]
    changed = onnx.load(model)
    w = onnx.numpy_helper.to_array(changed.graph.initializer[0]) * 2
    changed.graph.initializer[0].CopyFrom(onnx.numpy_helper.from_array(w, "w1"))
    onnx.save(changed, model)
    third = _child(str(model), str(x_path), str(tmp_path / "y3.npy"), str(cache))
    assert [e.split()[0] for e in third["log"]] == ["compiled"], third
    want3 = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_allclose(np.load(tmp_path / "y3.npy"), want3, rtol=1e-5, atol=1e-6)


def test_a_failed_compile_is_not_tried_again_by_the_next_session(mlp_model, tmp_path,
                                                                 monkeypatch):
    """A program AOTInductor fails on (PaddleOCR's detector spent its 13 s compile in every
    process) is noted under its key: the next session runs eagerly at once, with the
    results onnxruntime gives, and deleting the note tries again."""
    import warnings

    import torch._inductor

    import kiln

    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_COMPILE_CACHE", str(cache))
    calls = []

    def fails(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("expected bias to be 1-dimensional")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fails)
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    want = ort.InferenceSession(mlp_model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]

    def run() -> np.ndarray:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            sess = kiln.InferenceSession(mlp_model, backend="torch", compile=True)
            return sess.run(None, {"x": x})[0]

    np.testing.assert_allclose(run(), want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1
    notes = list(cache.glob("*.failed"))
    assert len(notes) == 1 and "1-dimensional" in notes[0].read_text()
    np.testing.assert_allclose(run(), want, rtol=1e-5, atol=1e-6)
    assert len(calls) == 1  # not compiled again
    notes[0].unlink()
    run()
    assert len(calls) == 2
