"""kiln tune's winner against onnxruntime: fp32, and onnxruntime running its own quantized
file (quantize_static, QDQ, per-channel weights, the same calibration data) of the same
model, and Kiln's torch fp32 eager session (the winner must not be slower). Models: the
shipped digits CNN, any zoo model by name (random weights: its accuracy figures say
little) and the trained models of tests/trained_models.py (the real-model benchmark's:
magika, ppocr_cls, ppocr_rec_v4, ppocr_det_v4, oww_melspec, ...), each with its own
calibration and check data (their calibration feeds, 64 samples); batch 1 and 8 (a file
whose batch dimension is fixed runs at the batches it accepts). Each engine runs a block
per round (after a rest when the engine changes, one untimed run, three timed), the order
reversed every other round, in one process; medians and the ratios Kiln / onnxruntime
(below 1: Kiln faster, as in docs/performance.md).

    PYTHONPATH=src python benchmarks/tune.py [--models digits resnet18 magika ppocr_cls]
        [--batches 1 8] [--time-budget 300] [--rounds 20]

Each tune runs with a budget of top-1 agreement >= 99% where the output is rows of class
scores, relative error <= 1% (:data:`BUDGETS`) where it is not (the table's "budget"
column says which).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import onnxruntime as ort

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import kiln  # noqa: E402
from kiln.tools.benchmark import SWITCH_REST_S, SwitchRest, spin_rest  # noqa: E402

DIGITS = os.path.join(os.path.dirname(kiln.__file__), "data")
# Outputs that are not rows of class scores (a text mask's probabilities, log-mel bins, an
# embedding, detection boxes, speech probabilities per window): tune's default would read
# their last axis as classes.
BUDGETS = {"ppocr_det_v4": "rel=0.01", "oww_melspec": "rel=0.01",
           "oww_embedding": "rel=0.01", "dddd_det": "rel=0.01", "silero_vad_seq": "rel=0.01"}


def _feeds(name: str) -> tuple[str, list[dict]]:
    """The model file and its calibration/check feeds (batches of up to 16 rows)."""
    import trained_models as tm
    if name == "digits":
        x = np.load(os.path.join(DIGITS, "digits_test.npz"))["images"][:128]
        return os.path.join(DIGITS, "digits_cnn.onnx"), [
            {"image": x[i:i + 16]} for i in range(0, len(x), 16)]
    if name in tm.MODELS:
        m = tm.get(name)
        if m.path is None:
            raise SystemExit(f"{name} is not installed (pip install {m.package})")
        if m.batch_axes is not None and any(a != 0 for a in m.batch_axes.values()):
            # kiln.tune stacks every input's rows along axis 0 for its timed batch
            raise SystemExit(f"{name}: an input's batch axis is not 0 ({m.batch_axes})")
        cal, _ = m.make_feeds(64, 8)
        return m.path, cal
    from kiln.zoo import path
    from kiln.zoo.registry import make_inputs
    return str(path(name)), [make_inputs(name, batch=8, seed=s) for s in range(4)]


def _max_batch(name: str) -> int | None:
    import trained_models as tm
    return tm.get(name).max_batch if name in tm.MODELS else None


def _rows(feed: dict, batch: int) -> dict:
    out = {}
    for k, v in feed.items():
        reps = -(-batch // len(v))
        out[k] = np.concatenate([v] * reps)[:batch]
    return out


def _ort_int8(src: str, feeds: list[dict], dst: str) -> str:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(feeds)

        def get_next(self):
            return next(self.it, None)

    quantize_static(src, dst, Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    return dst


def _alternate(runs: dict, feed: dict, rounds: int, threads: dict[str, int],
               spins: dict[str, float]) -> dict[str, float]:
    """Median ms per engine. ``threads``: torch's thread count for each Kiln engine's
    block (process-wide: the tuned session's one thread would otherwise hold for the
    eager session too); ``spins``: how long each engine's pool spins after a run."""
    import torch

    times: dict[str, list[float]] = {k: [] for k in runs}
    for fn in runs.values():
        fn(None, feed)
    names = list(runs)
    rest = SwitchRest()
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            # A block per engine after a rest (onnxruntime's worker threads spin for tens
            # of ms after a run and slowed the next two-thread run up to 2x on 2 cores; one
            # untimed run was not enough), its first run still untimed.
            rest(k, spins.get(k, SWITCH_REST_S))
            if k in threads:
                torch.set_num_threads(threads[k])
            runs[k](None, feed)
            for _ in range(3):
                t = time.perf_counter()
                runs[k](None, feed)
                times[k].append((time.perf_counter() - t) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["digits", "resnet18", "magika"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--time-budget", type=float, default=300.0)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    ort.set_default_logger_severity(3)  # quantize_static's unused-initializer lines
    with tempfile.TemporaryDirectory() as tmp:  # the tuned and quantized files
        _table(args, tmp)


def _table(args: argparse.Namespace, tmp: str) -> None:
    print("| model | batch | budget | tune's winner | its accuracy | Kiln ms | ORT fp32 ms "
          "| ORT int8 ms | Kiln fp32 eager ms | Kiln / ORT fp32 | Kiln / ORT int8 "
          "| Kiln / fp32 eager | tune s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        src, feeds = _feeds(name)
        q = _ort_int8(src, feeds, os.path.join(tmp, f"{name}.ort-int8.onnx"))
        for b in args.batches:
            if (_max_batch(name) or b) < b:
                continue
            out = os.path.join(tmp, f"{name}.b{b}.tuned.onnx")
            r = kiln.tune(src, feeds, batch=b, time_budget=args.time_budget, output=out,
                          budget=BUDGETS.get(name),
                          on_stage=lambda s, tag=f"{name} b{b}": print(f"  [{tag}] {s}",
                                                                  file=sys.stderr))
            print(r, file=sys.stderr)
            import torch
            default = torch.get_num_threads()  # tune restored it after measuring
            k = kiln.InferenceSession(out)
            eager = kiln.InferenceSession(src, backend="torch", threads=default)
            threads = {"kiln": r.winner.threads or default, "eager": default}
            spins = {"kiln": spin_rest(r.winner.backend)}
            so = ort.SessionOptions()  # as kiln bench --vs and time_by_op.py set it
            so.intra_op_num_threads, so.inter_op_num_threads = default, 1
            o32 = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
            runs = {"kiln": k.run, "ort32": o32.run, "eager": eager.run}
            try:
                runs["ort8"] = ort.InferenceSession(q, so, providers=["CPUExecutionProvider"]).run
            except Exception as e:  # onnxruntime refusing the file its own tool wrote
                print(f"  [{name}] onnxruntime refuses its quantize_static file: {e}",
                      file=sys.stderr)
            med = _alternate(runs, _rows(feeds[0], b), args.rounds, threads, spins)
            acc = r.winner.accuracy() if r.winner.errors else "exact"
            o8 = (f"{med['ort8']:.3g}", f"{med['kiln'] / med['ort8']:.2f}") if "ort8" in med \
                else ("refused by onnxruntime", "-")
            print(f"| {name} | {b} | {r.budget} | {r.winner.name} | {acc} | "
                  f"{med['kiln']:.3g} | {med['ort32']:.3g} | {o8[0]} | "
                  f"{med['eager']:.3g} | {med['kiln'] / med['ort32']:.2f} | "
                  f"{o8[1]} | {med['kiln'] / med['eager']:.2f} | "
                  f"{r.seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
