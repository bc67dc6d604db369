"""benchmarks/ is one suite with one entry point (issue 47, item 7): every script in it is
reachable from ``benchmarks/run.py``, and the entry point runs one."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"


def _suite() -> dict[str, tuple[str, str]]:
    sys.path.insert(0, str(BENCH))
    try:
        import run
    finally:
        sys.path.remove(str(BENCH))
    return run.SUITE


def test_every_benchmark_script_is_in_the_suite():
    listed = {script for script, _ in _suite().values()}
    scripts = {p.name for p in BENCH.iterdir()
               if p.suffix in (".py", ".sh") and p.name != "run.py"}
    assert scripts <= listed, f"not reachable from benchmarks/run.py: {scripts - listed}"


def test_the_entry_point_lists_and_runs_a_benchmark():
    pytest.importorskip("onnxruntime")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    listing = subprocess.run([sys.executable, str(BENCH / "run.py")], capture_output=True,
                             text=True, env=env, timeout=60)
    assert listing.returncode == 0 and "layer_overhead.py" in listing.stdout
    r = subprocess.run([sys.executable, str(BENCH / "run.py"), "layers", "--nodes", "20",
                        "--rounds", "1", "--runs", "3"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "onnxruntime" in r.stdout
    bad = subprocess.run([sys.executable, str(BENCH / "run.py"), "nope"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and "choose one of" in bad.stderr
