"""What the session API's hooks cost a run: per-run time of two Kiln source trees (before
and after a change) on a chain of small elementwise nodes, where the time is dispatch, not
arithmetic; and, in the new tree, the same runs made cancellable (with a RunOptions, so
the stop check runs after every layer). One worker process per tree, alternating blocks,
so other load on the machine hits all. Prints the best block's median microseconds per
run (best-of: the machine is shared) and ratios.

    python benchmarks/session_overhead.py OLD_SRC NEW_SRC --nodes 200 --backend numpy
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from layer_overhead import chain_model

WORKER = r"""
import sys, time, warnings
warnings.simplefilter("ignore")
import numpy as np
import kiln
path, backend, mode = sys.argv[1], sys.argv[2], sys.argv[3]
sess = kiln.InferenceSession(path, backend=backend)
feeds = {"x": np.ones((1, 16), np.float32)}
args = (None, feeds) if mode == "plain" else (None, feeds, kiln.RunOptions())
sess.run(*args)
print("ready", flush=True)
for line in sys.stdin:
    out = []
    for _ in range(int(line)):
        t = time.perf_counter(); sess.run(*args); out.append(time.perf_counter() - t)
    print(" ".join(f"{x:.7f}" for x in out), flush=True)
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--block", type=int, default=50)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "chain.onnx")
        with open(path, "wb") as f:
            f.write(chain_model(args.nodes).SerializeToString())
        workers = {"old": (args.old, "plain"), "new": (args.new, "plain"),
                   "new+RunOptions": (args.new, "run_options")}
        procs = {}
        for tag, (src, mode) in workers.items():
            env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
            procs[tag] = subprocess.Popen([sys.executable, "-c", WORKER, path, args.backend,
                                           mode], env=env, text=True,
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert procs[tag].stdout.readline().strip() == "ready"
        blocks: dict[str, list[float]] = {t: [] for t in procs}  # each block's median
        order = list(procs)
        for r in range(args.rounds):
            for tag in order[r % 3:] + order[:r % 3]:
                p = procs[tag]
                p.stdin.write(f"{args.block}\n")
                p.stdin.flush()
                blocks[tag].append(statistics.median(
                    float(x) for x in p.stdout.readline().split()))
        for p in procs.values():
            p.stdin.close()
            p.wait()
    med = {t: min(v) * 1e6 for t, v in blocks.items()}
    print(f"{args.nodes} nodes, {args.backend}: " + ", ".join(
        f"{t} {m:.1f} us" for t, m in med.items()))
    print(f"new/old {med['new'] / med['old']:.3f}; cancellable/new "
          f"{med['new+RunOptions'] / med['new']:.3f} "
          f"({(med['new+RunOptions'] - med['new']) / args.nodes * 1e3:.0f} ns per layer)")


if __name__ == "__main__":
    main()
