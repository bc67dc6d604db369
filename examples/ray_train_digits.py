"""Fine-tune the shipped digits CNN under Ray Train: 2 CPU workers (DDP, gloo) on a local
Ray cluster, checkpoints as ONNX plus optimizer state, the held-out accuracy of the last
checkpoint checked in onnxruntime.

    python examples/ray_train_digits.py [--workers 2] [--steps 60] [--batch 64]
                                        [--storage runs/] [--kill-at STEP]

``--kill-at STEP`` kills worker 1's process (SIGKILL) once after that step to show the run
resuming from its last checkpoint. Needs ``pip install -e ".[ray]"`` and scikit-learn.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from importlib import resources
from pathlib import Path

import numpy as np
import onnxruntime as ort
import ray
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from kiln.integrations.ray_train import MODEL_FILE, fine_tune

MODEL = resources.files("kiln") / "data" / "digits_cnn.onnx"


def damaged_model(path: Path) -> None:
    """The shipped CNN with its weights scaled by random factors, so there is something to
    recover (the example starts from it)."""
    import kiln

    module = kiln.to_torch(str(MODEL))
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    kiln.save(module, str(path))


def killer(step_to_kill: int, marker: str):
    """An ``after_step`` hook killing worker 1 for real, once."""
    def after_step(step: int, rank: int) -> None:
        if step == step_to_kill and rank == 1 and not os.path.exists(marker):
            Path(marker).touch()
            os.kill(os.getpid(), signal.SIGKILL)
    return after_step


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=64, help="global batch (split over workers)")
    ap.add_argument("--storage", default="ray_train_runs")
    ap.add_argument("--kill-at", type=int, default=None)
    args = ap.parse_args(argv)
    storage = Path(args.storage).resolve()
    storage.mkdir(parents=True, exist_ok=True)
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    x_tr, x_te, y_tr, y_te = train_test_split(x, d.target, test_size=0.25, random_state=0,
                                              stratify=d.target)
    start = storage / "damaged.onnx"
    damaged_model(start)
    before = ort.InferenceSession(str(start)).run(None, {"image": x_te})[0].argmax(1)
    print(f"held-out accuracy before: {(before == y_te).mean():.4f}")
    hook = None
    if args.kill_at is not None:
        marker = storage / "killed"
        marker.unlink(missing_ok=True)
        hook = killer(args.kill_at, str(marker))
    ray.init(num_cpus=args.workers, include_dashboard=False, log_to_driver=False)
    t0 = time.perf_counter()
    result = fine_tune(start, x_tr, y_tr, workers=args.workers, steps=args.steps,
                       batch=args.batch, checkpoint_every=10, storage_path=storage,
                       name="digits", after_step=hook)
    seconds = time.perf_counter() - t0
    ray.shutdown()
    if result.error is not None:
        raise SystemExit(f"training failed: {result.error}")
    with result.checkpoint.as_directory() as ckpt:
        after = ort.InferenceSession(str(Path(ckpt) / MODEL_FILE)).run(
            None, {"image": x_te})[0].argmax(1)
    print(f"{args.workers} workers, {args.steps} steps of {args.batch}: {seconds:.1f} s "
          f"(Ray start-up included); last checkpoint {result.checkpoint.path}")
    print(f"held-out accuracy after (onnxruntime on the checkpoint): {(after == y_te).mean():.4f}")


if __name__ == "__main__":
    main()
