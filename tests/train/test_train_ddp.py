"""DistributedDataParallel over kiln.to_torch modules, with real torchrun processes (gloo on
CPU): 2 processes with half of every batch end with the weights of 1 process with the
whole batch (DDP averages the gradients; the digits CNN has no batch statistics, so only
the order of float additions differs: tolerance 1e-5 absolute on weights up to ~4)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

import kiln  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp_digits.py"


def _run(tmp_path: Path, procs: int) -> dict:
    weights = tmp_path / f"w{procs}.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={procs}", str(EXAMPLE), "--steps", "4", "--batch", "32",
           "--weights", str(weights), "--out", str(tmp_path / f"m{procs}.onnx")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{procs} process(es), global batch 32" in done.stdout
    return torch.load(weights)


@pytest.mark.slow  # three Python processes importing torch and kiln: ~1-2 min on 2 cores
def test_two_processes_with_half_batches_match_one_with_the_whole_batch(tmp_path):
    one, two = _run(tmp_path, 1), _run(tmp_path, 2)
    assert one.keys() == two.keys()
    start = kiln.to_torch(str(Path(kiln.__file__).parent / "data" / "digits_cnn.onnx"))
    for k in one:
        torch.testing.assert_close(two[k], one[k], rtol=0, atol=1e-5)
        assert not torch.equal(one[k], start.state_dict()[k])  # training moved them
