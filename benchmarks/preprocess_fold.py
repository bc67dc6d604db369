"""What embedded preprocessing costs at run time: a zoo model given uint8 NHWC frames (BGR
when it has 3 channels) three ways, in one process, timed in alternating blocks (best of each):

- outside: NumPy does cast/transpose/reverse/mean/scale, the original model runs;
- folded: ``kiln.preprocess`` (scale and reversal in the first Conv's weights, the mean a
  Sub when that Conv pads, plus the Cast and Transpose);
- unfolded: ``kiln.preprocess(..., fold=False)`` (every step a node).

Prints ms per run and each variant's ratio to "outside"; checks the outputs agree.

    python benchmarks/preprocess_fold.py --model mobilenetv2 --backend numpy
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import kiln
from kiln.zoo import path

MEAN, SCALE = np.array([123.7, 116.3, 103.5]), np.array([58.4, 57.1, 57.4])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mobilenetv2")
    ap.add_argument("--backend", default="numpy", choices=["numpy", "torch"])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5, help="runs per block")
    args = ap.parse_args()

    src = str(path(args.model, progress=False))
    model = kiln.load(src)
    x = model.graph.inputs[0]
    _, c, h, w = x.shape
    frame = np.random.default_rng(0).integers(0, 256, (1, h, w, c), dtype=np.uint8)
    mean, scale = (MEAN, SCALE) if c == 3 else (MEAN[:1].repeat(c), SCALE[:1].repeat(c))
    spec = dict(input_type="uint8", layout="NHWC", mean=mean, scale=scale,
                reverse_channels=c == 3)
    plain = kiln.InferenceSession(model, backend=args.backend)
    folded = kiln.InferenceSession(kiln.preprocess(model, **spec), backend=args.backend)
    unfolded = kiln.InferenceSession(kiln.preprocess(model, fold=False, **spec),
                                     backend=args.backend)
    m, s = mean.reshape(1, c, 1, 1), scale.reshape(1, c, 1, 1)
    flip = slice(None, None, -1 if c == 3 else 1)

    variants = {
        "outside": lambda: plain.run(None, {x.name: np.ascontiguousarray(
            (frame.transpose(0, 3, 1, 2)[:, flip] - m) / s, dtype=np.float32)}),
        "folded": lambda: folded.run(None, {x.name: frame}),
        "unfolded": lambda: unfolded.run(None, {x.name: frame}),
    }
    outs = {k: f()[0] for k, f in variants.items()}
    for k in ("folded", "unfolded"):
        np.testing.assert_allclose(outs[k], outs["outside"], rtol=1e-3, atol=1e-3)
    best = {k: float("inf") for k in variants}
    for _ in range(args.blocks):
        for k, f in variants.items():
            t0 = time.perf_counter()
            for _ in range(args.runs):
                f()
            best[k] = min(best[k], (time.perf_counter() - t0) / args.runs)
    for k, t in best.items():
        print(f"{args.model} {args.backend} {k:9s} {t * 1e3:8.2f} ms  "
              f"{t / best['outside']:.3f}x outside")


if __name__ == "__main__":
    main()
