"""What a session costs besides its runs.

Per run: the session API's hooks, as the per-run time of two Kiln source trees (before and
after a change) on a chain of small elementwise nodes, where the time is dispatch, not
arithmetic; and, in the new tree, the same runs made cancellable (with a RunOptions, so
the stop check runs after every layer). One worker process per tree, alternating blocks,
so other load on the machine hits all. Prints the best block's median microseconds per
run (best-of: the machine is shared) and ratios.

    python benchmarks/session_overhead.py OLD_SRC NEW_SRC --nodes 200 --backend numpy

Per session (``--zoo``): creating a session on each zoo model's file (built into the zoo
cache first if missing) with onnxruntime, Kiln numpy and Kiln torch, each in a fresh
process: the seconds the constructor takes, and the peak RSS it adds (the peak resident
set, ``VmHWM``, after the constructor minus the resident set once the engine and its array
library are imported; Linux's ``ru_maxrss`` would not do: a child starts with its
parent's).
Best of ``--rounds`` fresh processes per engine, the engines alternating; ratios to
onnxruntime. The Kiln tree is byte-compiled first, as an installed Kiln is.

    python benchmarks/session_overhead.py --zoo [resnet18 bert ...] --rounds 3 [--src TREE]
"""

from __future__ import annotations

import argparse
import compileall
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

CREATE = r"""
import sys, time, warnings
warnings.simplefilter("ignore")
import numpy as np
engine, path = sys.argv[1], sys.argv[2]
if engine == "onnxruntime":
    import onnxruntime as ort
    make = lambda: ort.InferenceSession(path, providers=["CPUExecutionProvider"])
else:
    import kiln
    if engine == "torch":
        import torch  # noqa: F401 - the array library is part of the imports, as numpy is
    make = lambda: kiln.InferenceSession(path, backend=engine)
def status(key):  # KiB; this process's own (ru_maxrss would start at the parent's, from fork)
    return next(int(x.split()[1]) for x in open("/proc/self/status") if x.startswith(key))
base = status("VmRSS:")
t = time.perf_counter()
sess = make()
seconds = time.perf_counter() - t
print(f"{seconds:.4f} {(status('VmHWM:') - base) / 1024:.1f}")
"""
ENGINES = ("onnxruntime", "numpy", "torch")


def zoo_report(names: list[str], rounds: int, src: str | None = None) -> None:
    """Session creation seconds and added peak RSS (MiB) per zoo model and engine (Kiln
    from the source tree ``src`` if given)."""
    import kiln.zoo
    from kiln.zoo.registry import REGISTRY

    names = names or [n for n in REGISTRY if not n.endswith("_dynamo")]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"))
    if src:
        env["PYTHONPATH"] = src
    # Each fresh process would compile any module whose .pyc is stale (and, with
    # PYTHONDONTWRITEBYTECODE set, never write it): up to 6 ms a module on a first session.
    # Installed Kiln has current bytecode, so the tree measured gets it too.
    compileall.compile_dir(src or os.path.dirname(os.path.dirname(kiln.zoo.__file__)),
                           quiet=1)
    print(f"{'model':<16}" + "".join(f"{e + ' s':>15}{'MiB':>8}" for e in ENGINES) +
          f"{'numpy/ort s':>13}{'torch/ort s':>13}{'numpy/ort mem':>15}{'torch/ort mem':>15}")
    for name in names:
        path = str(kiln.zoo.path(name, progress=False))
        best = {e: [float("inf"), float("inf")] for e in ENGINES}
        for r in range(rounds):
            for e in ENGINES[r % 3:] + ENGINES[:r % 3]:
                out = subprocess.run([sys.executable, "-c", CREATE, e, path], env=env,
                                     capture_output=True, text=True, check=True).stdout
                seconds, mib = map(float, out.split()[-2:])
                best[e] = [min(best[e][0], seconds), min(best[e][1], mib)]
        o = best["onnxruntime"]
        print(f"{name:<16}" + "".join(f"{best[e][0]:>15.3f}{best[e][1]:>8.0f}" for e in ENGINES)
              + f"{best['numpy'][0] / o[0]:>13.2f}{best['torch'][0] / o[0]:>13.2f}"
              f"{best['numpy'][1] / o[1]:>15.2f}{best['torch'][1] / o[1]:>15.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old", nargs="?")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--zoo", nargs="*", metavar="MODEL",
                    help="session creation time and memory per zoo model (all if none named)")
    ap.add_argument("--src", help="with --zoo: the Kiln source tree to measure")
    ap.add_argument("--nodes", type=int, default=200)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--rounds", type=int, help="default: 30 blocks per run, 3 processes "
                    "per session")
    ap.add_argument("--block", type=int, default=50)
    args = ap.parse_args()
    if args.zoo is not None:
        zoo_report(args.zoo, args.rounds or 3, args.src)
        return
    if args.old is None or args.new is None:
        ap.error("OLD and NEW source trees are needed (or --zoo)")
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
        for r in range(args.rounds or 30):
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
