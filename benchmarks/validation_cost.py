"""What load-time validation (issue 39: value rules, axes, type constraints, opsets) costs
of session creation: ``kiln.InferenceSession(path)`` (load, optimize, plan) timed with the
checks of :mod:`kiln.onnxio.rules` as they are and with them replaced by no-ops, in one
process, the two alternating round by round (best of ``--rounds``; the machine is shared).

    python benchmarks/validation_cost.py --rounds 3 --chain 200000 resnet18 bert mobilenetv2
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from big_graph import relu_add_chain  # noqa: E402

import kiln  # noqa: E402
from kiln.onnxio import importer, rules  # noqa: E402
from kiln.passes import infer_shapes  # noqa: E402

_CHECKS = ("check_values", "check_axes", "check_types")


def _session_seconds(path: str, validate: bool) -> float:
    """Seconds to create a session of ``path``, the checks on or replaced by no-ops."""
    saved = {name: getattr(rules, name) for name in _CHECKS}
    saved_opsets = importer._check_opsets
    if not validate:
        for name in _CHECKS:
            setattr(rules, name, lambda *a, **k: None)
        importer._check_opsets = lambda *a, **k: None
    try:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            kiln.InferenceSession(path)
        return time.perf_counter() - t0
    finally:
        for name, fn in saved.items():
            setattr(rules, name, fn)
        importer._check_opsets = saved_opsets


def _share_inside_checks(path: str) -> tuple[float, float]:
    """(seconds inside the checks, seconds of the whole session creation) for one session:
    a direct measure that the machine's noise does not swamp as it does the A/B ratio."""
    spent = [0.0]
    saved = {name: getattr(rules, name) for name in _CHECKS}
    saved_opsets = importer._check_opsets

    def timed(fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[0] += time.perf_counter() - t
        return run

    for name, fn in saved.items():
        setattr(rules, name, timed(fn))
    importer._check_opsets = timed(saved_opsets)
    try:
        total = _session_seconds(path, True)
        return spent[0], total
    finally:
        for name, fn in saved.items():
            setattr(rules, name, fn)
        importer._check_opsets = saved_opsets


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="zoo model names (built in ~/.cache/kiln/zoo)")
    ap.add_argument("--chain", type=int, default=0, help="also a Relu/Add chain this long")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    assert infer_shapes.rules is rules  # the no-ops reach the optimizer's checks too
    paths = {m: str(Path.home() / ".cache/kiln/zoo" / m / "model.onnx") for m in args.models}
    with tempfile.TemporaryDirectory() as tmp:
        if args.chain:
            paths[f"chain{args.chain}"] = p = os.path.join(tmp, "chain.onnx")
            onnx.save(relu_add_chain(args.chain), p)
        for name, path in paths.items():
            best = {True: float("inf"), False: float("inf")}
            for _ in range(args.rounds):
                for validate in (False, True):
                    best[validate] = min(best[validate], _session_seconds(path, validate))
            inside, total = _share_inside_checks(path)
            print(f"{name}: session {best[False]:.3f} s without validation, "
                  f"{best[True]:.3f} s with ({100 * (best[True] / best[False] - 1):+.1f}%); "
                  f"inside the checks {1000 * inside:.1f} ms of {total:.3f} s "
                  f"({100 * inside / total:.1f}%)", flush=True)


if __name__ == "__main__":
    main()
