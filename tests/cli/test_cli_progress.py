"""Long commands say what they are doing, in a pipe too (issue 47, items 2 and 3).

Each command runs as a user's would, its stderr a pipe read line by line as it comes: the
first stage line must arrive within a few seconds, every stage is a plain line (no
carriage-return redraws in a log), and a command measured on the NumPy backend points to
the faster torch backend with the figure it measured.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kiln

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(Path(kiln.__file__).parent / "data" / "digits_cnn.onnx")
FIRST_LINE_S = 5.0  # after the command could first print anything (see _startup_s)


def _stream(args: list[str], cwd: Path) -> tuple[list[tuple[float, str]], str, int]:
    """Runs ``python -m kiln ARGS`` with pipes; returns (seconds, line) for each stderr
    line as it arrived, stdout and the exit code."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kiln", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = []  # bytes, decoded here: text mode would turn a redraw's "\r" into a newline
    assert proc.stderr is not None and proc.stdout is not None
    for line in proc.stderr:
        lines.append((time.perf_counter() - t0, line.decode()))
    out = proc.stdout.read().decode()
    return lines, out, proc.wait(timeout=600)


def _startup_s() -> float:
    """Seconds `python -m kiln --help` takes now: starting Python and importing Kiln's
    CLI, before which no command can print. 1-3 s on a quiet 2-core machine, over 10 s
    at load 30, so the first line is timed from there."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kiln", "--help"], env=env, capture_output=True,
                   timeout=300, check=True)
    return time.perf_counter() - t0


def _check_stages(lines: list[tuple[float, str]], title: str, stages: int) -> None:
    text = "".join(line for _, line in lines)
    assert "\r" not in text, f"a redrawn bar in a pipe:\n{text!r}"
    staged = [(t, line) for t, line in lines if line.startswith(f"kiln {title}: [")]
    assert len(staged) >= stages, f"expected {stages}+ stage lines:\n{text}"
    startup = _startup_s()
    assert staged[0][0] < startup + FIRST_LINE_S, \
        f"first stage line after {staged[0][0]:.1f} s (starting up takes {startup:.1f} s)"
    assert any(line.startswith(f"kiln {title}: done in") for _, line in lines), text


def test_profile_in_a_pipe_prints_a_line_per_stage(tmp_path):
    lines, out, rc = _stream(["profile", DIGITS, "--runs", "5"], tmp_path)
    assert rc == 0, lines
    _check_stages(lines, "profile", 3)
    assert "layers in run order" in out


def test_report_profile_in_a_pipe_prints_a_line_per_stage(tmp_path):
    lines, _, rc = _stream(["report", DIGITS, "-o", "r.html", "--profile"], tmp_path)
    assert rc == 0, lines
    _check_stages(lines, "report", 3)
    assert (tmp_path / "r.html").stat().st_size > 10_000


def test_quantize_in_a_pipe_prints_stages_and_the_torch_hint(tmp_path):
    images = np.load(Path(DIGITS).parent / "digits_test.npz")["images"]
    np.savez(tmp_path / "calib.npz", image=images[:64])
    lines, out, rc = _stream(["quantize", DIGITS, "-o", "q.onnx", "--mode", "static",
                              "--calibration", "calib.npz", "--backend", "numpy"], tmp_path)
    assert rc == 0, lines
    _check_stages(lines, "quantize", 4)
    text = "".join(line for _, line in lines)
    # The hint names the figure this run measured, the one the report printed.
    hint = [line for _, line in lines if line.startswith("kiln: hint:")]
    assert len(hint) == 1 and "--backend torch" in hint[0], text
    latency = [line for line in out.splitlines() if line.startswith("latency on numpy")]
    assert latency, out
    before, after = (float(s.split()[0]) for s in
                     latency[0].split(": ", 1)[1].split(" -> "))
    assert f"{after:.2f} against {before:.2f} ms" in hint[0]


@pytest.mark.parametrize("vs", [[], ["--vs", "onnxruntime"]])
def test_bench_on_numpy_points_to_torch_with_its_figure(tmp_path, vs):
    if vs:
        pytest.importorskip("onnxruntime")
    lines, out, rc = _stream(["bench", DIGITS, "--runs", "20", "--backend", "numpy", *vs],
                             tmp_path)
    assert rc == 0, lines
    hint = [line for _, line in lines if line.startswith("kiln: hint:")]
    assert len(hint) == 1 and "--backend torch" in hint[0], lines
    if vs:  # the ratio bench printed is the one the hint quotes
        # bench prints it to 3 places and the hint to 2: both round the same p50 ratio
        ratio = float(out.rsplit("= ", 1)[1].rstrip(")\n"))
        quoted = re.search(r"took ([0-9.]+)x onnxruntime's time", hint[0])
        assert quoted and abs(float(quoted.group(1)) - ratio) <= 0.0051, (hint, out)


def test_bench_on_torch_gives_no_hint(tmp_path):
    pytest.importorskip("torch")
    lines, _, rc = _stream(["bench", DIGITS, "--runs", "5", "--backend", "torch"], tmp_path)
    assert rc == 0, lines
    assert not [line for _, line in lines if "hint" in line]


def _silences(lines: list[tuple[float, str]]) -> list[float]:
    """Seconds between consecutive stderr lines, from the first one on."""
    return [b - a for (a, _), (b, _) in zip(lines, lines[1:])]


def test_a_long_bench_in_a_pipe_says_how_far_it_is(tmp_path):
    """No bar in a pipe, yet no long silence: a line every few seconds with the rounds
    done. Thousands of digits runs last well over the heartbeat's 5 s here."""
    lines, out, rc = _stream(["bench", DIGITS, "--runs", "4000", "--warmup", "1"], tmp_path)
    assert rc == 0, lines
    text = "".join(line for _, line in lines)
    assert "\r" not in text, text
    beats = [(t, line) for t, line in lines if line.startswith("kiln bench: ")]
    assert all("round" in line or "building" in line for _, line in beats), text
    ended = lines[-1][0] if lines else 0.0  # the hint, written once the runs are done
    if ended > _startup_s() + 10:  # long enough to owe a line (a quiet machine takes ~4 s)
        assert beats, text
    # one every 5 s, with a loaded machine's slack
    assert max(_silences(beats), default=0.0) < 5 + 5, text
    assert "samples/s" in out


def test_step_lines_in_a_pipe_say_a_long_step_is_still_running():
    import io

    from kiln.tools.progress import StepReporter

    log = io.StringIO()
    rep = StepReporter("kiln x", 2, stream=log)
    rep.quiet_s = 0.3
    with rep:
        rep.step("timing")
        rep.update("round 3/9")
        time.sleep(1.0)
        rep.done("done")
    lines = log.getvalue().splitlines()
    assert lines[0] == "kiln x: [1/2] timing" and lines[-1] == "kiln x: done", lines
    still = lines[1:-1]
    assert 2 <= len(still) <= 4, lines  # one per 0.3 s of silence, not more
    assert all(s.startswith("kiln x: [1/2] timing (round 3/9): still running, ")
               for s in still), lines


def test_a_heartbeat_says_nothing_for_a_short_job_and_a_line_per_period_for_a_long_one():
    import io

    from kiln.tools.progress import Heartbeat

    log = io.StringIO()
    with Heartbeat("kiln x", every=0.3, stream=log) as beat:
        beat.update("round 1/9")
    assert log.getvalue() == ""  # done before the first period: the output stays as it was
    with Heartbeat("kiln x", every=0.3, stream=log) as beat:
        beat.update("round 2/9")
        time.sleep(1.0)
    lines = log.getvalue().splitlines()
    assert 2 <= len(lines) <= 4 and all(x.startswith("kiln x: round 2/9, ") for x in lines)
    with Heartbeat("kiln x", every=0.1, enabled=False, stream=log):
        time.sleep(0.3)
    assert len(log.getvalue().splitlines()) == len(lines)
