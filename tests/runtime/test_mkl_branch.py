"""The torch backend runs MKL in its CNR mode AUTO on AMD CPUs and never overrides a
user's MKL_CBWR. The oracle is MKL's own verbose line, which names the CNR mode each call
ran under."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

_PROBE = """
from kiln.ops import registry
registry.load_backend("torch")
import torch
with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
    torch.randn(64, 64) @ torch.randn(64, 64)
"""


def _cnr_mode(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if env_value is not None:
        env["MKL_CBWR"] = env_value
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    modes = re.findall(r"SGEMM\(.*CNR:(\S+)", out.stdout + out.stderr)
    if not modes:
        pytest.skip("torch's BLAS is not MKL, or MKL printed no verbose line")
    return modes[0]


def _vendor() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo to tell the CPU's vendor")
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", text, re.M)
    return vendor.group(1) if vendor else ""


def test_mkl_runs_in_cnr_mode_auto_on_amd_cpus():
    mode = _cnr_mode(None)
    if _vendor() in ("AuthenticAMD", "HygonGenuine"):
        assert mode == "AUTO"
    else:
        assert mode == "OFF"


def test_a_users_mkl_cbwr_is_kept():
    assert _cnr_mode("COMPATIBLE") == "COMPATIBLE"


def test_mkl_runs_in_cnr_mode_auto_when_torch_was_imported_first():
    probe = "import torch\n" + _PROBE
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    modes = re.findall(r"SGEMM\(.*CNR:(\S+)", out.stdout + out.stderr)
    if not modes:
        pytest.skip("torch's BLAS is not MKL, or MKL printed no verbose line")
    assert modes[0] == ("AUTO" if _vendor() in ("AuthenticAMD", "HygonGenuine") else "OFF")
