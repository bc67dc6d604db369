"""torch.compile of kiln.to_torch modules against the PyTorch modules they were exported
from, both compiled the same way (inductor), side by side in one process: graphs and graph
breaks (``torch._dynamo.explain``), the first compiled training step (compiling included)
and the best of --reps later steps (forward + backward + SGD), the median over the rounds
of each round's Kiln / PyTorch ratio (the two modules step one after the other in a round,
taking turns going first) and that ratio's range, and the peak memory of a compiled step
(the resident set's rise, as benchmarks/training.py measures it), CPU.

    python benchmarks/training_compiled.py [--reps 5] [--models resnet18,mobilenetv2,bert,gpt2]
        [--batch 2] [--seq 32] [--image 64]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys

import numpy as np
import torch
from training import exported, peak_bytes, step  # benchmarks/training.py: the same measures

import kiln
from kiln.zoo.registry import get_entry, make_inputs


def main() -> None:
    if "MALLOC_MMAP_THRESHOLD_" not in os.environ and sys.platform == "linux":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # as benchmarks/training.py: re-exec
        os.execv(sys.executable, [sys.executable, *sys.argv])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", default="resnet18,mobilenetv2,bert,gpt2")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--image", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"torch {torch.__version__}, {a.threads} threads, batch {a.batch}, best of {a.reps}")
    print(
        f"{'model':<10} {'graphs torch/kiln':>17} {'first torch s':>13} {'first kiln s':>12} "
        f"{'ratio':>6} {'step torch s':>12} {'step kiln s':>11} {'ratio':>6} "
        f"{'median ratio':>12} {'ratio range':>11} {'torch peak MB':>13} {'kiln peak MB':>12} "
        f"{'ratio':>6} {'load':>9}"
    )
    for name in a.models.split(","):
        entry = get_entry(name)
        if entry.is_text:
            feeds = make_inputs(entry, batch=a.batch, seq=a.seq)
        else:
            feeds = {
                "input": np.random.default_rng(0)
                .standard_normal((a.batch, 3, a.image, a.image))
                .astype(np.float32)
            }
        args = tuple(torch.from_numpy(v) for v in feeds.values())
        net, blob = exported(name, args, entry)
        mods = {"torch": copy.deepcopy(net).train(), "kiln": kiln.to_torch(blob).train()}
        load0 = os.getloadavg()[0]  # the figures move with the load: print it beside them
        graphs = {}
        for k, m in mods.items():
            torch._dynamo.reset()
            graphs[k] = torch._dynamo.explain(m)(*args).graph_count
        torch._dynamo.reset()
        comp = {k: torch.compile(m) for k, m in mods.items()}
        opts = {k: torch.optim.SGD(m.parameters(), lr=1e-4) for k, m in mods.items()}
        first = {k: step(comp[k], opts[k], args) for k in mods}
        times: dict[str, list[float]] = {k: [] for k in mods}
        for r in range(a.reps):  # each goes first in every other round: no order effect
            for k in list(mods)[:: 1 if r % 2 == 0 else -1]:
                times[k].append(step(comp[k], opts[k], args))
        peak: dict[str, list[int]] = {k: [] for k in mods}
        for _ in range(2):
            for k in mods:
                peak[k].append(peak_bytes(comp[k], opts[k], args))
        t0, t1 = min(times["torch"]), min(times["kiln"])
        # one system hiccup moves one round: the median of per-round ratios is what to read
        ratios = [k / t for t, k in zip(times["torch"], times["kiln"])]
        med, lo, hi = statistics.median(ratios), min(ratios), max(ratios)
        p0, p1 = min(peak["torch"]) / 2**20, min(peak["kiln"]) / 2**20
        print(
            f"{name:<10} {graphs['torch']:>8}/{graphs['kiln']:<8} {first['torch']:>13.1f} "
            f"{first['kiln']:>12.1f} {first['kiln'] / first['torch']:>6.2f} {t0:>12.4f} "
            f"{t1:>11.4f} {t1 / t0:>6.2f} {med:>12.3f} {f'{lo:.2f}-{hi:.2f}':>11} {p0:>13.1f} "
            f"{p1:>12.1f} {p1 / p0:>6.2f} "
            f"{load0:>4.1f}-{os.getloadavg()[0]:<4.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
