"""What Kiln's short OpenMP spin costs on a quiet machine.

    python benchmarks/omp_spin.py --models mobilenetv2,resnet18,bert --rounds 3

Importing Kiln sets ``GOMP_SPINCOUNT=2000`` (torch's OpenMP threads then sleep soon after
a parallel region instead of spinning ~300k iterations), which saved 4x on a busy machine
(docs/performance.md). On a quiet one, sleeping threads must be woken for the next layer.
For each model, fresh processes alternate between Kiln as shipped and
``KILN_OMP_SPIN=default`` (torch's own spin); each process runs only Kiln's torch backend
at its default threads, back to back like a serving loop, and reports the median of
``--runs`` runs after a warm-up. Prints both medians per round and their ratio.
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
    args = ap.parse_args()
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "KILN_OMP_SPIN")}
    settings = {"shipped": base, "torch spin": {**base, "KILN_OMP_SPIN": "default"}}
    print(f"{time.strftime('%Y-%m-%d %H:%M')}, load {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores; median ms per run, batch 1")
    for name in args.models.split(","):
        seq = args.seq if name.split("_")[0] in TEXT else 0
        got: dict[str, list[float]] = {k: [] for k in settings}
        for _ in range(args.rounds):
            for label, env in settings.items():
                got[label].append(child(name, args.runs, seq, env) * 1e3)
        a, b = statistics.median(got["shipped"]), statistics.median(got["torch spin"])
        print(f"{name:14s} shipped {a:7.2f} ms ({', '.join(f'{t:.2f}' for t in got['shipped'])})"
              f" | torch spin {b:7.2f} ms ({', '.join(f'{t:.2f}' for t in got['torch spin'])})"
              f" | shipped / torch spin {a / b:.2f}", flush=True)


if __name__ == "__main__":
    main()
