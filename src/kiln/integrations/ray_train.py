"""Fine-tuning an imported ONNX model across processes with Ray Train.

    from kiln.integrations.ray_train import fine_tune
    result = fine_tune("model.onnx", x, y, workers=2, steps=100, batch=64,
                       storage_path="/shared/runs", name="digits")
    best = result.checkpoint   # a directory holding model.onnx and optimizer.pt

Every worker builds ``kiln.to_torch(model)`` under DistributedDataParallel (gloo on CPU)
and takes its share of each global batch, so N workers step exactly as one process with
the whole batch would. Checkpoints go through Ray Train's Checkpoint API as the model in
ONNX (``kiln.save``) plus the optimizer's state (``torch.save``); when a worker dies, Ray
Train restarts the group (``max_failures`` times) and :func:`train_loop` resumes from the
last checkpoint. Ray is optional: ``pip install -e ".[ray]"``.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import MissingDependencyError, OptionError

RAY_INSTALL = 'pip install -e ".[ray]"'
MODEL_FILE = "model.onnx"
STATE_FILE = "optimizer.pt"


def fine_tune(model: str | os.PathLike | bytes, x: np.ndarray, y: np.ndarray, *,
              workers: int = 2, steps: int = 100, batch: int = 64, lr: float = 0.05,
              momentum: float = 0.9, checkpoint_every: int = 10, seed: int = 0,
              storage_path: str | os.PathLike, name: str = "kiln-fine-tune",
              max_failures: int = 1,
              after_step: Callable[[int, int], None] | None = None) -> Any:
    """Fine-tune ``model`` with SGD (momentum) and cross-entropy on ``(x, y)`` under Ray
    Train's ``TorchTrainer`` with ``workers`` CPU processes; returns Ray's ``Result``
    (``result.checkpoint`` is the last one).

    Batches are drawn in one fixed order (``seed``), ``batch`` rows globally, each worker
    taking ``batch / workers`` of them. ``storage_path`` must be reachable by every node
    (a local folder on one machine). ``after_step(step, rank)`` runs in each worker after
    every step and checkpoint (progress, or fault injection in tests). Uses the running
    Ray cluster, or starts a local one.
    """
    try:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as e:
        raise MissingDependencyError(f"Ray Train is not installed: {RAY_INSTALL}") from e
    if workers < 1 or batch % workers:
        raise OptionError(f"batch {batch} does not split over {workers} workers; "
                          "pick a batch that is a multiple of workers")
    if len(x) != len(y) or len(x) <= batch:
        raise OptionError(f"need more rows than one batch ({batch}) and as many labels as "
                          f"rows; got {len(x)} rows and {len(y)} labels")
    if not isinstance(model, bytes):
        model = Path(model).read_bytes()
    config = {"model": model, "x": np.ascontiguousarray(x, np.float32),
              "y": np.ascontiguousarray(y, np.int64), "steps": steps, "batch": batch,
              "lr": lr, "momentum": momentum, "checkpoint_every": checkpoint_every,
              "seed": seed, "after_step": after_step}
    trainer = TorchTrainer(
        train_loop, train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(storage_path=str(storage_path), name=name,
                             failure_config=FailureConfig(max_failures=max_failures)))
    return trainer.fit()


def train_loop(config: dict) -> None:
    """One Ray Train worker's loop (the ``train_loop_per_worker`` of :func:`fine_tune`;
    ``config`` holds its arguments). Resumes from ``ray.train.get_checkpoint()`` if any."""
    import ray.train
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    from kiln.onnxio import save
    from kiln.train import to_torch

    torch.set_num_threads(1)  # one CPU per worker: more threads only contend
    rank, world = dist.get_rank(), dist.get_world_size()
    start, state = 0, None
    resume = ray.train.get_checkpoint()
    if resume is None:
        module = to_torch(config["model"])
    else:
        with resume.as_directory() as d:
            module = to_torch(str(Path(d) / MODEL_FILE))
            state = torch.load(Path(d) / STATE_FILE)
        start = state["step"]
    ddp = DistributedDataParallel(module)
    opt = torch.optim.SGD(ddp.parameters(), lr=config["lr"], momentum=config["momentum"])
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    x, y, batch = config["x"], config["y"], config["batch"]
    order = np.random.default_rng(config["seed"]).permutation(len(x))  # same on every rank
    share = batch // world
    after = config["after_step"]
    for step in range(start, config["steps"]):
        first = (step * batch) % (len(order) - batch)
        idx = order[first + rank * share: first + (rank + 1) * share]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(torch.from_numpy(x[idx])),
                                           torch.from_numpy(y[idx]))
        loss.backward()  # DDP averages the gradients over the workers here
        opt.step()
        done = step + 1
        if done % config["checkpoint_every"] == 0 or done == config["steps"]:
            metrics = {"step": done, "loss": loss.item()}
            # every worker reports; rank 0 alone writes the (identical) weights
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    save(module, str(Path(d) / MODEL_FILE))
                    torch.save({"step": done, "optimizer": opt.state_dict()},
                               Path(d) / STATE_FILE)
                    checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report(metrics, checkpoint=checkpoint)
        if after is not None:
            after(step, rank)
