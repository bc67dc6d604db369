"""Data-parallel fine-tuning of an imported ONNX model: the shipped digits CNN under
torch.nn.parallel.DistributedDataParallel: CPU processes talking gloo, or with CUDA one GPU
per process talking nccl. Each process takes
its share of every batch; DDP averages the gradients, so N processes with batch/N each
take the same steps as one process with the whole batch.

    torchrun --standalone --nproc_per_node 2 examples/ddp_digits.py [--steps 20] [--batch 64]

Rank 0 prints the held-out accuracy, saves the model (``--out``) and, with ``--weights``,
the final state_dict (the equivalence test compares those).
"""

from __future__ import annotations

import argparse
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

MODEL = resources.files("kiln") / "data" / "digits_cnn.onnx"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=64, help="global batch (split over ranks)")
    ap.add_argument("--out", default="digits_ddp.onnx")
    ap.add_argument("--weights", default=None, help="also save the final state_dict here")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu"
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} does not split over {world} processes")
    torch.set_num_threads(1)
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    x_tr, x_te, y_tr, y_te = train_test_split(x, d.target, test_size=0.25, random_state=0,
                                              stratify=d.target)
    with resources.as_file(MODEL) as path:
        model = kiln.to_torch(path, device=device)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # the same damaged start on every rank
        for p in model.parameters():
            p.mul_(1 + 0.5 * torch.randn(p.shape, generator=gen).to(device))
    ddp = DistributedDataParallel(model, device_ids=[device] if cuda else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    order = np.random.default_rng(0).permutation(len(x_tr))  # same batches on every rank
    share = args.batch // world
    for step in range(args.steps):
        start = (step * args.batch) % (len(order) - args.batch)
        idx = order[start + rank * share: start + (rank + 1) * share]
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ddp(torch.from_numpy(x_tr[idx]).to(device)),
                                           torch.from_numpy(y_tr[idx]).to(device))
        loss.backward()  # DDP all-reduces (averages) the gradients here
        opt.step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if rank == 0:
        model.eval()
        with torch.no_grad():
            logits = model(torch.from_numpy(x_te).to(device))
        acc = float((logits.argmax(1).cpu().numpy() == y_te).mean())
        print(f"{world} process(es), global batch {args.batch}: held-out accuracy {acc:.4f}")
        kiln.save(model, args.out)
        if args.weights:
            torch.save(model.state_dict(), args.weights)
    # Leave together: a rank tearing gloo down while rank 0 still evaluates and saves
    # aborted now and then ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
