"""Load, optimize and session-creation time of a very long graph (issue 14: linear in the
model's size). Two chains: Relu/Add with a constant (nothing folds or fuses, every node is
typed) and Add/Mul/Relu/Sigmoid (benchmarks/layer_overhead.py's mix). Each measurement is
a fresh process per Kiln source tree, the trees alternating; prints the best wall and CPU
seconds of each step (best-of: the machine is shared).

    python benchmarks/big_graph.py --nodes 200000 --rounds 2 [--old OLD_SRC] [--new NEW_SRC]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np
from layer_overhead import chain_model
from onnx import TensorProto, helper

WORKER = r"""
import sys, time, warnings
warnings.simplefilter("ignore")
import kiln
from kiln.optimize import optimize_with_report
marks = []
def mark():
    marks.append((time.perf_counter(), time.process_time()))
mark(); m = kiln.load(sys.argv[1]); mark()
om, _ = optimize_with_report(m, inplace=True); mark()
kiln.InferenceSession(om, optimize=False); mark()
print(" ".join(f"{b[0] - a[0]:.3f} {b[1] - a[1]:.3f}" for a, b in zip(marks, marks[1:])))
"""
STEPS = ("load", "optimize", "session")


def relu_add_chain(n: int):
    """Relu, Add 1, Relu, Add 1... on a (N, 8) input."""
    nodes, prev = [], "x"
    for i in range(n):
        out = f"v{i}" if i < n - 1 else "y"
        nodes.append(helper.make_node("Relu", [prev], [out]) if i % 2 == 0 else
                     helper.make_node("Add", [prev, "one"], [out]))
        prev = out
    one = helper.make_tensor("one", TensorProto.FLOAT, [8], np.ones(8))
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, ["N", 8])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, None)], [one])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--old", help="a Kiln source tree to compare with")
    ap.add_argument("--new", help="the Kiln source tree to measure (default: installed)")
    args = ap.parse_args()
    trees = {"old": args.old, "new": args.new} if args.old else {"new": args.new}
    with tempfile.TemporaryDirectory() as d:
        for label, make in (("Relu/Add", relu_add_chain), ("Add/Mul/Relu/Sigmoid",
                                                             chain_model)):
            path = os.path.join(d, "m.onnx")
            with open(path, "wb") as f:
                f.write(make(args.nodes).SerializeToString())
            best = {t: [[float("inf")] * 2 for _ in STEPS] for t in trees}
            for _ in range(args.rounds):
                for tree, src in trees.items():
                    env = dict(os.environ)
                    if src:
                        env["PYTHONPATH"] = src
                    out = subprocess.run([sys.executable, "-c", WORKER, path], env=env,
                                         check=True, capture_output=True, text=True).stdout
                    xs = [float(x) for x in out.split()]
                    for i in range(len(STEPS)):
                        best[tree][i] = [min(best[tree][i][0], xs[2 * i]),
                                         min(best[tree][i][1], xs[2 * i + 1])]
            for tree, b in best.items():
                total = [sum(x[k] for x in b) for k in (0, 1)]
                print(f"{label} x{args.nodes} [{tree}]: " + ", ".join(
                    f"{s} {w:.1f} s ({c:.1f} s CPU)" for s, (w, c) in zip(STEPS, b)) +
                    f"; total {total[0]:.1f} s ({total[1]:.1f} s CPU)", flush=True)


if __name__ == "__main__":
    main()
