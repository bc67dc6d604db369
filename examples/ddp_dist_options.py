"""SINGA's distributed options on DistributedDataParallel over the shipped digits CNN:
each option trains the same damaged start for the same steps as plain all-reduce, and
rank 0 prints the held-out loss and accuracy and the bytes each process sent per step.

    torchrun --standalone --nproc_per_node 2 examples/ddp_dist_options.py [--steps 40]

Bytes sent are measured, not computed: the growth of this process's ``wchar`` in
/proc/self/io over a step (gloo writes its messages to sockets; nothing else writes during
a step), averaged over the steps after the first. ``payload`` is what the hook handed to
collectives (none for fp32: DDP's own all-reduce). With ``--json`` rank 0 writes the
figures there (the test reads them).
"""

from __future__ import annotations

import argparse
import json
import os
from importlib import resources

import numpy as np
import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import kiln
from kiln.train.distributed import dist_option

MODEL = resources.files("kiln") / "data" / "digits_cnn.onnx"
# option -> settings: 1% of the elements for top-K, and a magnitude that the measured
# gradients exceed in about that share for the threshold; four partitions of the
# 38,282 parameters for the partial update
RUNS = {
    "fp32": {},
    "fp16": {},
    "bf16": {},
    "partialUpdate": {"threshold": 10000},
    "sparseTopK": {"spars": 0.01},
    "sparseThreshold": {"spars": 0.03},
}


def _wchar() -> int:
    for line in open("/proc/self/io"):
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise KeyError("wchar")


def run(option: str, settings: dict, data: tuple, steps: int, batch: int) -> dict:
    """Train ``steps`` steps under ``option`` from the damaged start; rank 0's figures."""
    x_tr, x_te, y_tr, y_te = data
    rank, world = dist.get_rank(), dist.get_world_size()
    with resources.as_file(MODEL) as path:
        model = kiln.to_torch(path)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the same damaged start on every rank and for every option
        for p in model.parameters():
            p.mul_(1 + 0.5 * torch.randn(p.shape, generator=gen))
    ddp = DistributedDataParallel(model)
    state = dist_option(ddp, option, **settings)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    order = np.random.default_rng(0).permutation(len(x_tr))
    share = batch // world
    sent = []
    for step in range(steps):
        start = (step * batch) % (len(order) - batch)
        idx = order[start + rank * share : start + (rank + 1) * share]
        before = _wchar()
        opt.zero_grad()
        nn.functional.cross_entropy(
            ddp(torch.from_numpy(x_tr[idx])), torch.from_numpy(y_tr[idx])
        ).backward()
        opt.step()
        sent.append(_wchar() - before)
    model.eval()
    with torch.no_grad():
        logits = model(torch.from_numpy(x_te))
        loss = float(nn.functional.cross_entropy(logits, torch.from_numpy(y_te)))
    acc = float((logits.argmax(1).numpy() == y_te).mean())
    # how far the replicas are apart (partialUpdate lets them drift between syncs)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    other = flat.clone()
    dist.broadcast(other, 1 % world)
    return {
        "option": option,
        "settings": settings,
        "held_out_loss": loss,
        "held_out_accuracy": acc,
        "bytes_sent_per_step": float(np.mean(sent[1:])),
        "payload_per_step": state.payload_bytes / steps,
        "replica_gap": float((flat - other).norm() / flat.norm()),
        "weights": flat.tolist() if rank == 0 else None,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=64, help="global batch (split over ranks)")
    ap.add_argument("--options", default=",".join(RUNS))
    ap.add_argument("--json", default=None, help="rank 0 writes the results here")
    args = ap.parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    data = train_test_split(x, d.target, test_size=0.25, random_state=0, stratify=d.target)
    results = [run(o, RUNS[o], data, args.steps, args.batch) for o in args.options.split(",")]
    if dist.get_rank() == 0:
        print(f"{dist.get_world_size()} processes, {args.steps} steps, global batch {args.batch}")
        print(
            f"{'option':<16} {'loss':>7} {'accuracy':>8} {'bytes sent/step':>15} "
            f"{'payload/step':>12} {'replica gap':>11}"
        )
        for r in results:
            payload = f"{r['payload_per_step']:.0f}" if r["option"] != "fp32" else "-"
            print(
                f"{r['option']:<16} {r['held_out_loss']:>7.4f} {r['held_out_accuracy']:>8.4f} "
                f"{r['bytes_sent_per_step']:>15.0f} {payload:>12} "
                f"{r['replica_gap']:>11.2e}"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
