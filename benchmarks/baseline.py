"""Speed baseline of the NumPy backend: Kiln and onnxruntime side by side in one process.

    python benchmarks/baseline.py                 # light ResNet-50 and the zoo's ResNet-18
    python benchmarks/baseline.py --threads 1 --budget 30

Both engines get the same thread count (NumPy's BLAS capped with threadpoolctl,
onnxruntime's intra-op threads) and run in alternating blocks after a rest, as in
``zoo_suite.py``. Prints each engine's median latency and the ratio Kiln / onnxruntime.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import numpy as np
import onnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_suite import make_runner, measure  # noqa: E402


def models() -> list[tuple[str, str, dict]]:
    """(label, path, feeds) for the light ResNet-50 and the zoo's ResNet-18, batch 1."""
    import kiln.zoo as zoo
    from kiln.zoo.registry import make_inputs

    light = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light",
                         "light_resnet50.onnx")
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224), dtype=np.float32)
    name = onnx.load(light, load_external_data=False).graph.input[0].name
    return [("light ResNet-50 (onnx backend tests)", light, {name: x}),
            ("ResNet-18 (zoo, exported from PyTorch)", str(zoo.path("resnet18")),
             make_inputs("resnet18", batch=1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds of timed rounds")
    ap.add_argument("--backend", default="numpy")
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    with threadpool_limits(args.threads):
        for label, path, feeds in models():
            runners = {"onnxruntime": make_runner("onnxruntime", path, args.threads),
                       args.backend: make_runner(args.backend, path, args.threads)}
            times = measure(runners, feeds, args.budget, min_runs=10, max_runs=400, rest_s=0.2)
            ort, ours = (statistics.median(times[k]) for k in runners)
            print(f"{label}: onnxruntime {ort:.1f} ms, kiln-{args.backend} {ours:.1f} ms "
                  f"({len(times[args.backend])} runs each) -> ratio {ours / ort:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
