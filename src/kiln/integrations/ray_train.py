"""Fine-tuning an imported ONNX model across processes with Ray Train.

    from kiln.integrations.ray_train import fine_tune
    result = fine_tune("model.onnx", x, y, workers=2, steps=100, batch=64,
                       storage_path="/shared/runs", name="digits")
    best = result.checkpoint   # a directory holding model.onnx and optimizer.pt

Every worker builds ``kiln.to_torch(model)`` under DistributedDataParallel (gloo on CPU)
and takes its share of each global batch, so N workers step exactly as one process with
the whole batch would (with the default ``dist_option="fp32"``, plain all-reduce; SINGA's
compressed, partial and sparse exchanges are the other options). Checkpoints go through
Ray Train's Checkpoint API as the model in ONNX (``kiln.save``) plus the optimizer's state
(``torch.save``); when a worker dies, Ray Train restarts the group (``max_failures``
times) and :func:`train_loop` resumes from the last checkpoint. Ray is optional:
``pip install -e ".[ray]"``.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import MissingDependencyError, OptionError

RAY_INSTALL = 'pip install -e ".[ray]"'
PRECISIONS = ("fp32", "bf16", "fp16")
MODEL_FILE = "model.onnx"
STATE_FILE = "optimizer.pt"


def fine_tune(
    model: str | os.PathLike | bytes,
    x: np.ndarray,
    y: np.ndarray,
    *,
    workers: int = 2,
    steps: int = 100,
    batch: int = 64,
    lr: float = 0.05,
    momentum: float = 0.9,
    checkpoint_every: int = 10,
    seed: int = 0,
    storage_path: str | os.PathLike,
    name: str = "kiln-fine-tune",
    max_failures: int = 1,
    after_step: Callable[[int, int], None] | None = None,
    optimizer: Callable[[list], Any] | None = None,
    loss: Callable[[Any, Any], Any] | None = None,
    trainable: str | None = None,
    precision: str = "fp32",
    dist_option: str = "fp32",
    dist_settings: dict | None = None,
) -> Any:
    """Fine-tune ``model`` on ``(x, y)`` under Ray Train's ``TorchTrainer`` with ``workers``
    CPU processes; returns Ray's ``Result`` (``result.checkpoint`` is the last one).

    Batches are drawn in one fixed order (``seed``), ``batch`` rows globally, each worker
    taking ``batch / workers`` of them. ``storage_path`` must be reachable by every node
    (a local folder on one machine). ``after_step(step, rank)`` runs in each worker after
    every step and checkpoint (progress, or fault injection in tests). Uses the running
    Ray cluster, or starts a local one.

    ``optimizer(params)`` builds the optimizer over the trainable parameters (default SGD
    with ``lr`` and ``momentum``); ``loss(outputs, labels)`` the loss (default
    cross-entropy); ``trainable``: a regular expression, only parameters whose names it
    matches (``re.search``) train, the others are frozen (SINGA's partial update by
    layer); ``precision``: "fp32", or "bf16"/"fp16" to run forward and loss under
    ``torch.autocast("cpu", dtype)``; ``dist_option``: SINGA's option for exchanging
    gradients (:func:`kiln.train.distributed.dist_option`, settings in ``dist_settings``).
    The metrics reported at each checkpoint add ``payload_bytes_per_step`` (what the
    option's hook handed to collectives; 0 for "fp32", DDP's own all-reduce) and
    ``bytes_written_per_step`` (the worker's measured socket writes, which include Ray's
    own traffic). A resumed run restarts the option's state (error-feedback residuals,
    the partial update's rotation).
    """
    from kiln.train.distributed import OPTIONS

    if dist_option not in OPTIONS:
        raise OptionError(
            f"unknown dist_option {dist_option!r}; choose one of {', '.join(OPTIONS)}"
        )
    if precision not in PRECISIONS:
        raise OptionError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    try:
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError as e:
        raise MissingDependencyError(f"Ray Train is not installed: {RAY_INSTALL}") from e
    if workers < 1 or batch % workers:
        raise OptionError(
            f"batch {batch} does not split over {workers} workers; "
            "pick a batch that is a multiple of workers"
        )
    if len(x) != len(y) or len(x) <= batch:
        raise OptionError(
            f"need more rows than one batch ({batch}) and as many labels as "
            f"rows; got {len(x)} rows and {len(y)} labels"
        )
    if not isinstance(model, bytes):
        model = Path(model).read_bytes()
    config = {
        "model": model,
        "x": np.ascontiguousarray(x, np.float32),
        "y": np.ascontiguousarray(y, np.int64),
        "steps": steps,
        "batch": batch,
        "lr": lr,
        "momentum": momentum,
        "checkpoint_every": checkpoint_every,
        "seed": seed,
        "after_step": after_step,
        "optimizer": optimizer,
        "loss": loss,
        "trainable": trainable,
        "precision": precision,
        "dist_option": dist_option,
        "dist_settings": dict(dist_settings or {}),
    }
    trainer = TorchTrainer(
        train_loop,
        train_loop_config=config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=False),
        run_config=RunConfig(
            storage_path=str(storage_path),
            name=name,
            failure_config=FailureConfig(max_failures=max_failures),
        ),
    )
    return trainer.fit()


def _wchar() -> int:
    """Bytes this process has written (files and sockets), from /proc/self/io; 0 where
    there is none."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except OSError:
        return 0


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
    from kiln.train.distributed import dist_option

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
    if config.get("trainable") is not None:
        pattern = re.compile(config["trainable"])
        for key, p in module.named_parameters():
            p.requires_grad_(bool(pattern.search(key)))
    ddp = DistributedDataParallel(module)
    hook = dist_option(ddp, config.get("dist_option", "fp32"), **config.get("dist_settings", {}))
    params = [p for p in ddp.parameters() if p.requires_grad]
    make_opt = config.get("optimizer")
    opt = (
        make_opt(params)
        if make_opt is not None
        else torch.optim.SGD(params, lr=config["lr"], momentum=config["momentum"])
    )
    if state is not None:
        opt.load_state_dict(state["optimizer"])
    loss_fn = config.get("loss") or nn.functional.cross_entropy
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.get("precision", "fp32"))
    x, y, batch = config["x"], config["y"], config["batch"]
    order = np.random.default_rng(config["seed"]).permutation(len(x))  # same on every rank
    share = batch // world
    after = config["after_step"]
    written = 0
    for step in range(start, config["steps"]):
        first = (step * batch) % (len(order) - batch)
        idx = order[first + rank * share : first + (rank + 1) * share]
        before = _wchar()
        opt.zero_grad()
        with torch.autocast("cpu", dtype=low, enabled=low is not None):
            loss = loss_fn(ddp(torch.from_numpy(x[idx])), torch.from_numpy(y[idx]))
        loss.backward()  # DDP exchanges the gradients here, as dist_option says
        opt.step()
        written += _wchar() - before
        done = step + 1
        if done % config["checkpoint_every"] == 0 or done == config["steps"]:
            ran = done - start
            metrics = {
                "step": done,
                "loss": loss.item(),
                "payload_bytes_per_step": hook.payload_bytes / ran,
                "bytes_written_per_step": written / ran,
            }
            # every worker reports; rank 0 alone writes the (identical) weights
            with tempfile.TemporaryDirectory() as d:
                checkpoint = None
                if rank == 0:
                    save(module, str(Path(d) / MODEL_FILE))
                    torch.save({"step": done, "optimizer": opt.state_dict()}, Path(d) / STATE_FILE)
                    checkpoint = ray.train.Checkpoint.from_directory(d)
                ray.train.report(metrics, checkpoint=checkpoint)
        if after is not None:
            after(step, rank)
