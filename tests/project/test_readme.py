"""The README's set-up commands and what it says about them: exactly two commands, and
the test command (scripts/test.sh) does what the README says it does."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def setup_commands() -> list[str]:
    """The commands of the README's first ```bash block (comments dropped)."""
    block = re.search(r"```bash\n(.*?)```", README, re.S)
    assert block, "the README has no bash block"
    return [line.split("#")[0].strip() for line in block.group(1).splitlines()
            if line.split("#")[0].strip()]


def test_readme_has_exactly_the_two_setup_commands():
    assert setup_commands() == ["pip install -e . && python -m kiln.demo",
                                "bash scripts/test.sh"]


def test_readme_says_what_the_test_command_does():
    text = " ".join(README.split())
    assert "apt-get" in text and "chromium" in text  # it installs system packages
    assert 'pip install -e ".[test]"' in text
    assert 'pytest -m "not slow"' in text and "deselects the tests marked slow" in text
    assert "bash scripts/test.sh --slow" in text  # and how to run those too
    comment = re.search(r"bash scripts/test\.sh\s+#(.*)", README).group(1)
    assert "whole" not in comment and "fast tests" in comment


@pytest.fixture
def fake_tools(tmp_path) -> dict[str, str]:
    """PATH with stand-ins: chromium/chromedriver present (so no apt-get runs) and a
    ``python3`` that records its arguments instead of installing or testing anything."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.txt"
    for name in ("chromium", "chromedriver"):
        (bin_dir / name).write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "python3").write_text(f'#!/bin/sh\nfor a in "$@"; do printf "%s\\t" "$a" '
                                     f'>> {shlex.quote(str(log))}; done\n'
                                     f'echo >> {shlex.quote(str(log))}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "CALLS": str(log)}


def run_test_sh(env: dict[str, str], *args: str) -> list[list[str]]:
    """Run scripts/test.sh with the stand-ins; returns each python3 call's arguments."""
    r = subprocess.run(["bash", "scripts/test.sh", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [line.rstrip("\t").split("\t") for line in Path(env["CALLS"]).read_text()
            .splitlines()]


def test_test_sh_runs_the_fast_tests_and_slow_ones_on_request(fake_tools):
    install, pytest_call = run_test_sh(fake_tools)
    assert install == ["-m", "pip", "install", "--progress-bar", "off", "-e", ".[test]"]
    assert pytest_call == ["-m", "pytest", "-q", "-m", "not slow"]
    Path(fake_tools["CALLS"]).unlink()
    _, pytest_call = run_test_sh(fake_tools, "--slow", "-x", "tests/cli/test_cli.py")
    assert pytest_call == ["-m", "pytest", "-q", "-x", "tests/cli/test_cli.py"]


# Where files that are data, results or build output may be committed: the model and test
# images Kiln ships, raw benchmark results, the docs' pictures. Anywhere else (a wheel at the
# root, JSON dumps in docs/, an out.npz a command left) they are clutter a visitor sees.
_DATA = re.compile(r"\.(whl|egg|tar\.gz|zip|so|pyc|onnx|npz|npy|pt|pb|parquet|html|json|"
                   r"png|jpg|svg)$")
_DATA_HOMES = ("src/kiln/data/", "benchmarks/results/", "docs/images/")


def test_data_and_build_output_are_committed_only_where_they_belong():
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True,
                           text=True, check=True).stdout.split("\n")
    stray = [f for f in files if _DATA.search(f) and not f.startswith(_DATA_HOMES)]
    assert not stray, f"data or build output outside {_DATA_HOMES}: {stray}"
