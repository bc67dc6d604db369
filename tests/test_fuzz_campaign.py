"""The seeded fuzz campaign CI runs (issue 14): 300 mutated models through load -> session
-> run on both backends, each in a forked worker under memory and time limits; any outcome
but a result equal to onnxruntime's or a KilnError fails (docs/reliability.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

FUZZER = Path(__file__).resolve().parents[1] / "fuzz" / "fuzz_kiln.py"


def test_seeded_fuzz_campaign_finds_no_failure():
    pytest.importorskip("onnxruntime")  # the campaign's oracle
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(FUZZER), "--seed", "0", "--cases", "300"],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])
