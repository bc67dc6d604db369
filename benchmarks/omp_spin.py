"""What Kiln's short OpenMP spin costs on a quiet machine.

    python benchmarks/omp_spin.py --models mobilenetv2,resnet18,bert --rounds 3
    python benchmarks/omp_spin.py --spins 2000,20000,default --seq 16
    python benchmarks/omp_spin.py --spins 2000,20000 --neighbours 2 --rounds 6

Kiln's torch backend sets libgomp's spin count to 2000 (torch's OpenMP threads then sleep
soon after a parallel region instead of spinning ~300k iterations), which saved 4x on a busy machine
(docs/performance.md). On a quiet one, sleeping threads must be woken for the next layer.
For each model, fresh processes alternate between the ``--spins`` settings (a number is a
``GOMP_SPINCOUNT``, ``shipped`` is Kiln's own choice, ``default`` is
``KILN_OMP_SPIN=default``: torch's own spin); each process runs only Kiln's torch backend
at its default threads, back to back like a serving loop, and reports the median of
``--runs`` runs after a warm-up. Prints each setting's medians per round and their ratio
to the first setting's. ``--neighbours N`` keeps N other processes busy meanwhile, each
running PyTorch products in bursts on two threads with torch's own spin: other jobs'
OpenMP threads, which take the cores in a way plain busy loops do not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time, warnings
warnings.simplefilter("ignore")
import numpy as np
import kiln
from kiln import zoo
from kiln.zoo.registry import make_inputs
name, runs, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
feed = make_inputs(name, batch=1, seq=seq or None, seed=0) if seq else \
    make_inputs(name, batch=1, seed=0)
s = kiln.InferenceSession(str(zoo.path(name, progress=False)), backend="torch")
for _ in range(10):
    s.run(None, feed)
times = []
for _ in range(runs):
    t0 = time.perf_counter()
    s.run(None, feed)
    times.append(time.perf_counter() - t0)
print(json.dumps(float(np.median(times))))
"""

NEIGHBOUR = r"""
import time, torch
torch.set_num_threads(2)
a, b = torch.randn(192, 192), torch.randn(192, 192)
while True:
    for _ in range(200):
        torch.mm(a, b)
    time.sleep(0.002)
"""

TEXT = ("bert", "roberta", "gpt2")


def child(name: str, runs: int, seq: int, env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, name, str(runs), str(seq)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mobilenetv2,resnet18,bert")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--seq", type=int, default=128, help="text models' sequence length")
    ap.add_argument("--spins", default="shipped,default",
                    help="settings to compare: shipped, default, or GOMP_SPINCOUNT values")
    ap.add_argument("--neighbours", type=int, default=0,
                    help="other processes running PyTorch products meanwhile")
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "KILN_OMP_SPIN")}
    others = [subprocess.Popen([sys.executable, "-c", NEIGHBOUR], env=base)
              for _ in range(args.neighbours)]
    try:
        compare(args, base)
    finally:
        for p in others:
            p.kill()


def compare(args, base: dict) -> None:
    """Fresh child processes per setting, alternating, for each model."""
    settings = {}
    for spin in args.spins.split(","):
        settings[spin] = base if spin == "shipped" else \
            {**base, "KILN_OMP_SPIN": "default"} if spin == "default" else \
            {**base, "GOMP_SPINCOUNT": spin}
    time.sleep(2 if args.neighbours else 0)
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores, {args.neighbours} neighbour(s); median ms per run, batch 1")
    for name in args.models.split(","):
        seq = args.seq if name.split("_")[0] in TEXT else 0
        got: dict[str, list[float]] = {k: [] for k in settings}
        for _ in range(args.rounds):
            for label, env in settings.items():
                got[label].append(child(name, args.runs, seq, env) * 1e3)
        first = statistics.median(next(iter(got.values())))
        print(f"{name:14s} " + " | ".join(
            f"{label} {statistics.median(ts):7.2f} ms ({', '.join(f'{t:.2f}' for t in ts)}) "
            f"{statistics.median(ts) / first:.2f}x" for label, ts in got.items()), flush=True)


if __name__ == "__main__":
    main()
