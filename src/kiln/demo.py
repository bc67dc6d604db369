"""The demo: a CNN trained on scikit-learn's 8x8 handwritten digits (see
examples/train_digits.py), run by Kiln on the 450 held-out images it never saw.

    python -m kiln.demo [--backend numpy|torch]
"""

from __future__ import annotations

import argparse
import time
from importlib import resources

import numpy as np

import kiln
from kiln.runtime.backends import backend_names

_SHADES = " .:-=+*#%@"


def ascii_digit(img: np.ndarray) -> list[str]:
    """An 8x8 image in [0, 1] as 8 lines of text."""
    return ["".join(_SHADES[min(int(v * 9.99), 9)] * 2 for v in row) for row in img]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kiln.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=None, choices=backend_names(),
                    help="default: a session's default, torch when installed, else numpy")
    args = ap.parse_args(argv)
    data = resources.files("kiln") / "data"
    with resources.as_file(data / "digits_cnn.onnx") as path:
        sess = kiln.InferenceSession(str(path), backend=args.backend)
    test = np.load(str(data / "digits_test.npz"))
    images, labels = test["images"], test["labels"]
    inp = sess.get_inputs()[0]
    print(f"model: digits_cnn.onnx  input {inp.name} {inp.shape} {inp.type}  "
          f"backend: {sess.backend.name}")

    t0 = time.perf_counter()
    (logits,) = sess.run(None, {inp.name: images})
    batch_ms = (time.perf_counter() - t0) * 1e3
    pred = logits.argmax(1)
    print(f"accuracy on {len(labels)} held-out digits: {(pred == labels).mean():.2%} "
          f"({batch_ms:.1f} ms for the whole batch)")

    times = []
    for i in range(50):
        t0 = time.perf_counter()
        sess.run(None, {inp.name: images[i % len(images)][None]})
        times.append(time.perf_counter() - t0)
    print(f"latency, batch 1: median {np.median(times) * 1e3:.3f} ms over {len(times)} runs")

    shown = list(range(4)) + [int(i) for i in np.flatnonzero(pred != labels)[:2]]
    print("\nsome predictions (two mistakes last, if any):")
    for i in shown:
        p = np.exp(logits[i] - logits[i].max())
        p /= p.sum()
        lines = ascii_digit(images[i, 0])
        lines[3] += f"   label {labels[i]}  predicted {pred[i]}  ({p[pred[i]]:.1%})"
        print("\n".join(lines), "\n")
    try:
        import onnxruntime as ort
    except ImportError:
        return 0
    with resources.as_file(data / "digits_cnn.onnx") as path:
        ref = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (want,) = ref.run(None, {inp.name: images})
    print(f"onnxruntime agrees: max |difference| of logits {np.abs(want - logits).max():.2e}, "
          f"same predictions: {bool((want.argmax(1) == pred).all())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
