"""What the torch backend needs from torch's native runtimes holds whatever was imported
first, and importing or using Kiln leaves the process environment as the user gave it.

The oracle for the OpenMP spin is libgomp's own documented setting: a process started with
``GOMP_SPINCOUNT`` at Kiln's count in its environment, against one with libgomp's default
spin. The
figure compared is how busy the process keeps the CPU while its main thread sleeps between
short parallel regions (spinning worker threads burn CPU then)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

_BUSY = r"""
import json, sys, time
import torch
if sys.argv[1] == "kiln":
    import kiln
    from kiln.ops.torch import native
    kiln.Session(sys.argv[2], backend="torch", threads=2)
    settled = native.SETTLED["openmp"]
else:
    settled = ""
torch.set_num_threads(2)
a = torch.randn(1 << 20)

def busy():
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(200):
        a.sum()  # a parallel region of a few microseconds
        time.sleep(0.002)
    return (time.process_time() - c0) / (time.perf_counter() - w0)

busy()
print(json.dumps([min(busy() for _ in range(3)), settled]))
"""


def _busy(mode: str, extra_env: dict, model: str) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KILN_OMP_SPIN")}
    env.update(extra_env)
    out = subprocess.run([sys.executable, "-c", _BUSY, mode, model], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    cpu, settled = json.loads(out.stdout.strip().splitlines()[-1])
    return cpu, settled


def _tiny_model(tmp_path) -> str:
    from onnx import TensorProto, helper, save

    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    path = str(tmp_path / "relu.onnx")
    save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_openmp_threads_sleep_soon_even_when_torch_was_imported_first(tmp_path):
    if (os.cpu_count() or 1) < 2:
        pytest.skip("one core: OpenMP runs no worker thread to spin")
    model = _tiny_model(tmp_path)
    kiln_cpu, settled = _busy("kiln", {}, model)
    if "left OpenMP's spin" in settled:
        pytest.skip(f"this torch's OpenMP: {settled}")
    from kiln.ops.torch.native import SPIN_COUNT

    short, _ = _busy("plain", {"GOMP_SPINCOUNT": str(SPIN_COUNT)}, model)
    default, _ = _busy("plain", {}, model)
    assert default > short + 0.1, "libgomp's default spin is not measurable here"
    assert kiln_cpu < (short + default) / 2, (kiln_cpu, short, default)


_ENV = r"""
import json, os, sys
before = dict(os.environ)
import torch
import kiln
kiln.Session(sys.argv[1], backend="torch").run(None, {"x": __import__("numpy").ones(2, "f")})
kiln.Session(sys.argv[1]).run(None, {"x": __import__("numpy").ones(2, "f")})
print(json.dumps({k: v for k, v in os.environ.items() if before.get(k) != v}))
"""


def test_importing_and_using_kiln_leaves_the_environment_alone(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("GOMP_SPINCOUNT", "MKL_CBWR", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", _ENV, _tiny_model(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}
