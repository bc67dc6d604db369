"""Per-layer overhead: a chain of small elementwise nodes (Add/Mul/Relu/Sigmoid on a
(1, 16) tensor), so the time per node is dispatch, not arithmetic. onnxruntime and both
Kiln backends run it in one process, alternating blocks; prints microseconds per node.
Beside them, each library's floor: the same chain as one straight-line Python function
calling NumPy's or torch's ops by hand (what any Python engine pays at least), so that
Kiln minus its floor is Kiln's own overhead per layer.

    python benchmarks/layer_overhead.py --nodes 500 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from onnx import TensorProto, helper, numpy_helper


def chain_model(n: int):
    """``n`` nodes cycling Add, Mul, Relu, Sigmoid; the optimizer cannot fuse them away."""
    ops = ["Add", "Mul", "Relu", "Sigmoid"]
    nodes, prev = [], "x"
    for i in range(n):
        op = ops[i % 4]
        ins = [prev, "c"] if op in ("Add", "Mul") else [prev]
        nodes.append(helper.make_node(op, ins, [f"v{i}"], name=f"n{i}"))
        prev = f"v{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    c = numpy_helper.from_array(np.full((1, 16), 0.5, np.float32), "c")
    g = helper.make_graph(nodes, "chain",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])], [c])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def floor(n: int, lib: str):
    """The chain as one generated function calling ``lib``'s ops directly, ``fn(x)``."""
    import torch
    from scipy.special import expit

    c = np.full((1, 16), 0.5, np.float32)
    if lib == "torch":
        glb = {"c": torch.from_numpy(c), "relu": torch.relu, "sigmoid": torch.sigmoid}
    else:
        glb = {"c": c, "relu": lambda x: np.maximum(x, np.float32(0)), "sigmoid": expit}
    body = ["v = v + c", "v = v * c", "v = relu(v)", "v = sigmoid(v)"]
    src = "def run(v):\n" + "".join(f"    {body[i % 4]}\n" for i in range(n)) + \
        "    return v\n"
    exec(src, glb)
    return glb["run"]


class _Floor:
    """A floor function behind ``sess.run``'s signature."""

    def __init__(self, fn, torch_in: bool):
        self.fn, self.torch_in = fn, torch_in

    def run(self, _names, feed):
        import torch

        x = feed["x"]
        y = self.fn(torch.from_numpy(x) if self.torch_in else x)
        return [y.numpy() if self.torch_in else y]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=500)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--runs", type=int, default=50)
    args = ap.parse_args()

    import onnxruntime as ort
    import torch

    import kiln

    torch.set_num_threads(args.threads)
    model = chain_model(args.nodes)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    engines = {
        "onnxruntime": ort.InferenceSession(model.SerializeToString(), so,
                                            providers=["CPUExecutionProvider"]),
        # named: a session given no backend gets torch wherever torch imports
        "kiln numpy": kiln.InferenceSession(model, backend="numpy"),
        "kiln torch": kiln.InferenceSession(model, backend="torch"),
        "numpy floor": _Floor(floor(args.nodes, "numpy"), False),
        "torch floor": _Floor(floor(args.nodes, "torch"), True),
    }
    feed = {"x": np.random.default_rng(0).standard_normal((1, 16)).astype(np.float32)}
    want = engines["onnxruntime"].run(None, feed)[0]
    best: dict[str, list[float]] = {k: [] for k in engines}
    for sess in engines.values():
        np.testing.assert_allclose(sess.run(None, feed)[0], want, rtol=1e-5, atol=1e-6)
    for _ in range(args.rounds):
        for name, sess in engines.items():
            sess.run(None, feed)
            t = time.perf_counter()
            for _ in range(args.runs):
                sess.run(None, feed)
            best[name].append((time.perf_counter() - t) / args.runs)
    print(f"{args.nodes}-node chain, {args.threads} thread(s): microseconds per node "
          "(median of rounds)")
    per = {name: statistics.median(ts) / args.nodes * 1e6 for name, ts in best.items()}
    for name, us in per.items():
        print(f"  {name:12s} {us:6.2f}")
    for lib in ("numpy", "torch"):
        print(f"  Kiln's own overhead on {lib}: {per[f'kiln {lib}'] - per[f'{lib} floor']:.2f}")


if __name__ == "__main__":
    main()
