"""Real libraries written for onnxruntime run unmodified on Kiln through the switch
``python -m kiln.onnxruntime``: each probe in tests/ort_libs uses one library as its docs
do and prints what it computed; it runs once with the real onnxruntime and once on Kiln,
and the two must agree. The libraries come with the ``test`` extra (also ``ortlibs``);
without them the tests skip."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent / "ort_libs"
SRC = str(Path(__file__).resolve().parents[2] / "src")

# probe -> (modules it needs, relative tolerance for its numbers)
PROBES = {
    "magika": (["magika"], 1e-4),
    "ddddocr": (["ddddocr", "PIL"], 1e-3),
    "onnxmltools": (["onnxmltools", "lightgbm", "xgboost", "sklearn"], 1e-5),
}


def _run(probe: str, on_kiln: bool) -> dict:
    cmd = [sys.executable] + (["-m", "kiln.onnxruntime"] if on_kiln else []) + \
        [str(HERE / f"{probe}_probe.py")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [SRC] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def _same(got, want, rtol: float, where: str = "") -> None:
    if isinstance(want, dict):
        assert sorted(got) == sorted(want), where
        for k in want:
            _same(got[k], want[k], rtol, f"{where}/{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _same(g, w, rtol, f"{where}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=rtol, abs_tol=rtol * 1e-2), (where, got, want)
    else:
        assert got == want, (where, got, want)


@pytest.mark.parametrize("probe", list(PROBES))
def test_library_runs_on_kiln_as_on_onnxruntime(probe):
    modules, rtol = PROBES[probe]
    for m in ["onnxruntime", *modules]:
        pytest.importorskip(m)
    want = _run(probe, on_kiln=False)
    got = _run(probe, on_kiln=True)
    assert want.pop("ort") == "onnxruntime"
    assert got.pop("ort") == "kiln.onnxruntime"  # the library ran on Kiln
    _same(got, want, rtol)
