"""Training step (forward + backward + SGD) of kiln.to_torch modules against the PyTorch
modules they were exported from, side by side in one process: ResNet-18 and MobileNetV2
(224x224) and the zoo's small BERT (4 layers, hidden 256, seq 128), batch 8, CPU.

Per model: step time (best of --reps alternating steps; the machine is shared, so best-of)
and the memory autograd keeps for backward (bytes of the tensors saved by the forward,
counted with torch.autograd.graph.saved_tensors_hooks: the part of a training step's peak
that depends on how the forward is run; parameters and gradients are the same in both).
Peak memory: how far the process's resident set rises during one step (VmHWM after the
step minus VmRSS before it, the high-water mark reset through /proc/self/clear_refs; Linux
only). glibc is told to map every block over 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so
freed tensors leave the resident set and one engine's step does not reuse the other's heap.
Prints ratios Kiln / PyTorch. onnx2torch is compared by benchmarks/onnx2torch_compare.py.

    python benchmarks/training.py [--reps 5] [--threads 2] [--models resnet18,mobilenetv2,bert,gpt2]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import numpy as np
import torch
from torch import nn

import kiln
from kiln.zoo.build import export_trainable
from kiln.zoo.registry import get_entry, make_inputs


def exported(name: str, args: tuple, entry) -> tuple[nn.Module, bytes]:
    net = entry.make_model()
    for m in net.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0  # the ONNX graph has no dropout; keep the work the same
    return net, export_trainable(entry, net, args)


def step(model: nn.Module, opt, args: tuple) -> float:
    t = time.perf_counter()
    opt.zero_grad()
    out = model(*args)
    out = out if isinstance(out, tuple) else (out,)
    sum(o.float().square().mean() for o in out).backward()
    opt.step()
    return time.perf_counter() - t


def saved_bytes(model: nn.Module, args: tuple) -> int:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(*args)
    del out
    return total[0]


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def peak_bytes(model: nn.Module, opt, args: tuple) -> int:
    """How far the resident set rises during one training step (from the point where the
    last step's gradients are freed, as the step's own zero_grad would)."""
    opt.zero_grad()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident set
    base = _status("VmRSS")
    step(model, opt, args)
    return _status("VmHWM") - base


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and sys.platform == "linux":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by glibc at start: re-exec
        os.execv(sys.executable, [sys.executable, *sys.argv])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="resnet18,mobilenetv2,bert,gpt2")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} threads, batch 8, best of {a.reps}")
    print(
        f"{'model':<11} {'torch step s':>12} {'kiln step s':>11} {'ratio':>6} "
        f"{'torch saved MB':>14} {'kiln saved MB':>13} {'ratio':>6} "
        f"{'torch peak MB':>13} {'kiln peak MB':>12} {'ratio':>6} {'load':>9}"
    )
    for name in a.models.split(","):
        entry = get_entry(name)
        if entry.is_text:
            feeds = make_inputs(entry, batch=8, seq=128)
        else:
            feeds = {
                "input": np.random.default_rng(0)
                .standard_normal((8, 3, 224, 224))
                .astype(np.float32)
            }
        args = tuple(torch.from_numpy(v) for v in feeds.values())
        net, blob = exported(name, args, entry)
        mods = {"torch": copy.deepcopy(net).train(), "kiln": kiln.to_torch(blob).train()}
        load0 = os.getloadavg()[0]  # the figures move with the load: print it beside them
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in mods.items()}
        times: dict[str, list[float]] = {k: [] for k in mods}
        for k in mods:
            step(mods[k], opts[k], args)  # warm-up
        for r in range(a.reps):  # each goes first in every other round: no order effect
            for k in list(mods)[:: 1 if r % 2 == 0 else -1]:
                times[k].append(step(mods[k], opts[k], args))
        mem = {k: saved_bytes(m, args) for k, m in mods.items()}
        peak: dict[str, list[int]] = {k: [] for k in mods}
        for _ in range(2):
            for k in mods:
                peak[k].append(peak_bytes(mods[k], opts[k], args))
        t0, t1 = min(times["torch"]), min(times["kiln"])
        print(
            f"{name:<11} {t0:>12.3f} {t1:>11.3f} {t1 / t0:>6.2f} {mem['torch'] / 2**20:>14.1f} "
            f"{mem['kiln'] / 2**20:>13.1f} {mem['kiln'] / mem['torch']:>6.2f} "
            f"{min(peak['torch']) / 2**20:>13.1f} {min(peak['kiln']) / 2**20:>12.1f} "
            f"{min(peak['kiln']) / min(peak['torch']):>6.2f} "
            f"{load0:>4.1f}-{os.getloadavg()[0]:<4.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
