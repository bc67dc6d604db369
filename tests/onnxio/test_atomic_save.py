"""``kiln.save`` is atomic: a process killed at any moment of a save leaves the previous
model or the new one on disk, and onnxruntime (the independent reader) loads it and gives
that model's result. Also: re-saving leaves no stale data file behind."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln

N = 2048  # a 2048 x 2048 float32 weight: 16 MB, long enough a write to be killed inside


def _model(fill: float):
    w = helper.make_tensor("w", TensorProto.FLOAT, [N, N],
                           np.full((N, N), fill, np.float32).tobytes(), raw=True)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "mm",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])], [w])
    return kiln.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _result(path: Path) -> float:
    """What onnxruntime computes from the file at ``path`` (x = ones: N * fill)."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return float(sess.run(None, {"x": np.ones((1, N), np.float32)})[0][0, 0])


_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {tests!r})
    from test_atomic_save import _model
    import kiln
    m = _model(2.0)
    print("ready", flush=True)
    kiln.save(m, {path!r}, external_data={external})
    print("saved", flush=True)
""")


def _child(path: Path, external: bool) -> subprocess.Popen:
    code = _CHILD.format(tests=str(Path(__file__).parent), path=str(path), external=external)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)


@pytest.mark.parametrize("external", [False, True])
def test_a_save_killed_at_any_moment_leaves_the_old_or_the_new_model(tmp_path, external):
    path = tmp_path / "model.onnx"
    old, new = N * 1.0, N * 2.0
    # How long a whole save takes, to spread the kills over it.
    kiln.save(_model(1.0), path, external_data=external)
    p = _child(path, external)
    assert p.stdout.readline().strip() == "ready"
    t0 = time.perf_counter()
    assert p.stdout.readline().strip() == "saved"
    took = time.perf_counter() - t0
    p.wait()
    assert _result(path) == new
    rng = random.Random(7)
    seen = set()
    for i in range(10):
        kiln.save(_model(1.0), path, external_data=external)
        p = _child(path, external)
        assert p.stdout.readline().strip() == "ready"
        time.sleep(rng.uniform(0, took * 1.2) if i else 0.0)
        p.send_signal(signal.SIGKILL)
        p.wait()
        got = _result(path)
        assert got in (old, new), f"kill {i}: the file on disk computes {got}"
        seen.add(got)
    assert old in seen  # at least one kill landed before the model was replaced


def test_resaving_external_data_leaves_one_data_file_and_both_saves_load(tmp_path):
    path = tmp_path / "model.onnx"
    kiln.save(_model(1.0), path, external_data=True)
    assert _result(path) == N * 1.0
    kiln.save(_model(3.0), path, external_data=True)
    assert _result(path) == N * 3.0
    kiln.save(_model(4.0), path, external_data=True)
    assert _result(path) == N * 4.0
    data = sorted(f.name for f in tmp_path.iterdir() if f.name != "model.onnx")
    assert len(data) == 1 and data[0].endswith(".data"), data
    kiln.save(_model(5.0), path, external_data=False)
    assert _result(path) == N * 5.0
    assert [f.name for f in tmp_path.iterdir()] == ["model.onnx"]
    assert os.path.getsize(path) > N * N * 4
