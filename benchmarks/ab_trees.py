"""A/B latency of two Kiln source trees (say, before and after a change) on zoo models:
one worker process per tree, each holding a session, timed in alternating blocks so that
a slow-down from other work on the machine hits both. Prints median ms and new/old.

    python benchmarks/ab_trees.py OLD_SRC NEW_SRC --models resnet18,bert --backend torch
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys

WORKER = r"""
import sys, time, warnings
warnings.simplefilter("ignore")
import numpy as np, torch
import kiln
from kiln.zoo import path
from kiln.zoo.registry import get_entry
torch.set_num_threads(int(sys.argv[3]))
name, backend = sys.argv[1], sys.argv[2]
sess = kiln.InferenceSession(str(path(name)), backend=backend)
rng = np.random.default_rng(0)
feeds = {}
for spec in get_entry(name).inputs:
    shape = [int(sys.argv[5]) if d == "batch" else int(sys.argv[4]) if isinstance(d, str) else d
             for d in spec.shape]
    if spec.kind == "ids":
        feeds[spec.name] = rng.integers(1000, 8000, shape).astype(spec.dtype)
    elif spec.kind == "mask":
        feeds[spec.name] = np.ones(shape, spec.dtype)
    elif spec.kind == "image":
        feeds[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
    else:
        feeds[spec.name] = np.zeros(shape, spec.dtype)
sess.run(None, feeds)
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    out = []
    for _ in range(n):
        t = time.perf_counter(); sess.run(None, feeds); out.append(time.perf_counter() - t)
    print(" ".join(f"{x:.6f}" for x in out), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--models", default="resnet18,mobilenetv2,bert,gpt2")
    ap.add_argument("--backend", default="torch")
    ap.add_argument("--threads", default="2")
    ap.add_argument("--seq", default="128")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--block", type=int, default=3)
    args = ap.parse_args()
    for name in args.models.split(","):
        procs = {}
        for tag, src in (("old", args.old), ("new", args.new)):
            env = dict(os.environ, PYTHONPATH=src)
            procs[tag] = subprocess.Popen([sys.executable, "-c", WORKER, name, args.backend,
                                           args.threads, args.seq, args.batch], env=env,
                                          text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert procs[tag].stdout.readline().strip() == "ready"
        times: dict[str, list[float]] = {"old": [], "new": []}
        for r in range(args.rounds):
            for tag in (("old", "new") if r % 2 == 0 else ("new", "old")):
                p = procs[tag]
                p.stdin.write(f"{args.block}\n")
                p.stdin.flush()
                times[tag] += [float(x) for x in p.stdout.readline().split()]
        for p in procs.values():
            p.stdin.close()
            p.wait()
        o, n = (statistics.median(times[t]) * 1e3 for t in ("old", "new"))
        print(f"{name:14s} {args.backend:6s} b{args.batch} old {o:8.2f} ms  new {n:8.2f} ms  "
              f"new/old {n / o:5.2f}", flush=True)


if __name__ == "__main__":
    main()
