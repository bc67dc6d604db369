"""Quantization and half precision on trained models that pip packages ship
(tests/trained_models.py): task agreement with fp32 on an evaluation set kept apart from
the calibration set, for Kiln's static/dynamic INT8, fp16, bf16 and onnxruntime's
quantize_static/quantize_dynamic on the same calibration data; file sizes, what Kiln's
defaults chose, and the accuracy-budget mode's result and time.

    PYTHONPATH=src python benchmarks/quantization_trained.py [MODEL ...] [--budget]
    PYTHONPATH=src python benchmarks/quantization_trained.py [MODEL ...] --speed

``--speed``: Kiln's default static INT8 (``backend="torch"``, so speed-aware timing on
the torch backend) against the fp32 file, both on Kiln's torch backend, batch 1 and 8,
in one process, alternating rounds, best of 25: the ratio fp32 time / INT8 time (above 1:
INT8 faster), and how many layers the speed-aware step kept in float.

Prints one markdown table per model (docs/quantization.md keeps them). INT8 and fp32 files
run on onnxruntime (the deployment engine); fp16/bf16 files run on Kiln's NumPy backend
(onnxruntime runs fp16 mostly in float32 and has no bfloat16 kernels for most ops).
The fp16 rows: without data; with the calibration feeds (the conversion measures itself
against float32 on them and warns the figures); and with a 2-point budget in the task's
terms on them (layers adding the most error kept float32).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
import warnings

import numpy as np
import onnxruntime as ort

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import kiln  # noqa: E402
import trained_models as tm  # noqa: E402
from kiln.onnxio import to_proto  # noqa: E402
from kiln.quantize import Budget  # noqa: E402

# (calibration samples, evaluation samples, accuracy budget)
SIZES = {"magika": (96, 160, "top1=0.99"), "silero_vad_seq": (64, 96, "rel=0.05"),
         "ppocr_det_v4": (6, 10, "rel=0.05"), "ppocr_rec_v4": (24, 40, "top1=0.98"),
         "ppocr_cls": (48, 96, "top1=0.99")}
ENGINE = None
"""What Kiln's quantizer calibrates and measures on: None is its default, the default
backend (torch when installed), so "Kiln static" is the file a user gets from
``kiln.quantize(path, calibration=...)``; the files then run on onnxruntime here."""


def _ort_runs(model, feeds):
    s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
    return [s.run(None, f) for f in feeds]


def _kiln_runs(blob, feeds):
    s = kiln.InferenceSession(blob, backend="numpy")
    return [s.run(None, f) for f in feeds]


def run(name: str, use_budget: bool) -> list[str]:
    m = tm.get(name)
    if m.path is None:
        return [f"{name}: {m.package} not installed"]
    n_cal, n_eval, budget = SIZES.get(name, (64, 128, "top1=0.99"))
    budget = budget if use_budget else None
    cal, ev = m.make_feeds(n_cal, n_eval)
    ref = _ort_runs(m.path, ev)
    rows = [("fp32 (onnxruntime)", 1.0, os.path.getsize(m.path), "", "")]
    tmp = tempfile.mkdtemp()

    def kiln_row(label, **kw):
        t0 = time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q = kiln.quantize(m.path, calibration=cal if kw.get("mode") == "static"
                                  else None, validation=ev[:4] if "budget" in kw else None,
                                  measure_latency=False, backend=ENGINE, **kw)
        except Exception as e:  # a row saying why beats no table
            rows.append((label, float("nan"), 0, f"failed: {type(e).__name__}: "
                         f"{str(e)[:80]}", ""))
            return
        secs = time.perf_counter() - t0
        blob = to_proto(q.model).SerializeToString()
        chose = f"{q.report.weight_bits}-bit weights; {len(q.report.quantized)} quantized, " \
                f"{len(q.report.kept)} kept"
        if q.report.budget_log:
            chose += "; " + q.report.budget_log[-1]
        try:
            agree = m.agreement(ref, _ort_runs(blob, ev))
        except Exception as e:  # onnxruntime refusing Kiln's file is a finding: say it
            agree, chose = float("nan"), f"onnxruntime refused it: {str(e)[:90]}"
        rows.append((label, agree, len(blob), chose, f"{secs:.0f} s"))

    kiln_row("Kiln static", mode="static")
    kiln_row("Kiln static, every layer (speed-aware off)", mode="static", speed_aware=False)
    kiln_row("Kiln dynamic", mode="dynamic")
    if budget:
        kiln_row(f"Kiln static, budget {budget} (on 4 evaluation batches)", mode="static",
                 budget=budget, budget_seconds=600)
    task_budget = Budget(agreement=m.agreement, min_agreement=0.98)
    for label, bf16, kw in (
            ("Kiln fp16", False, {}), ("Kiln bf16", True, {}),
            ("Kiln fp16, calibrated", False, {"calibration": cal}),
            ("Kiln fp16, calibrated, 2-point task budget", False,
             {"calibration": cal, "budget": task_budget})):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                half = kiln.convert_float16(m.path, bf16=bf16, **kw)
            blob = to_proto(half).SerializeToString()
            notes = "; ".join(_half_note(str(w.message)) for w in caught
                              if "convert_float16" in str(w.message)
                              and "was not measured" not in str(w.message))
            rows.append((label + " (Kiln NumPy)", m.agreement(ref, _kiln_runs(blob, ev)),
                         len(blob), notes, ""))
        except Exception as e:
            rows.append((label, float("nan"), 0, f"failed: {type(e).__name__}: "
                         f"{str(e)[:80]}", ""))
    path = os.path.join(tmp, "ort.onnx")
    for label, write in ort_quantized(m.path, cal, path):
        t0 = time.perf_counter()
        try:
            write()
            rows.append((label, m.agreement(ref, _ort_runs(path, ev)), os.path.getsize(path),
                         "defaults", f"{time.perf_counter() - t0:.0f} s"))
        except Exception as e:  # report what onnxruntime's tool said
            rows.append((label, float("nan"), 0, f"failed: {str(e)[:60]}", ""))
    out = [f"### {name} ({m.task}; {n_cal} calibration / {n_eval} evaluation samples)", "",
           "| file | agreement with fp32 | size (MB) | what it chose | time |",
           "| --- | --- | --- | --- | --- |"]
    out += [f"| {a} | {b:.1%} | {c / 1e6:.2f} | {d} | {e} |" for a, b, c, d, e in rows]
    return out


def _half_note(text: str) -> str:
    """A convert_float16 warning cut to a table cell: the counts and the measured figures
    (task agreement on the calibration feeds), not every layer's name."""
    text = text.split(":", 1)[1].strip()
    kept = re.search(r"so (\d+) layer\(s\) adding the most error stay float32( \(every "
                     r"layer that converted: this is the float32 model\))?", text)
    agree = re.findall(r"task agreement (\d+\.\d%)", text)
    if "measured against float32" in text:
        out = "measured on calibration feeds"
        if agree:
            out += f": task agreement {agree[0]}"
        if kept:
            out += (f"; {kept.group(1)} more layer(s) kept float32"
                    + (" (all: the float32 model)" if kept.group(2) else "")
                    + (f", then {agree[-1]}" if len(agree) > 1 else ""))
        return out
    sensitive = re.match(r"kept (\d+) range-sensitive layer\(s\)", text)
    if sensitive:
        return f"{sensitive.group(1)} range-sensitive layer(s) kept float32"
    return text[:70]


def ort_quantized(src: str, cal: list[dict], out: str):
    """onnxruntime's own quantization tool on the same calibration feeds, as the baseline
    rows: yields (label, write), where write() quantizes `src` into `out` (static QDQ
    per-channel, then dynamic), each with the tool's defaults otherwise."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        quantize_dynamic,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(cal)

        def get_next(self):
            return next(self.it, None)

    yield "onnxruntime static (QDQ, per-channel)", lambda: quantize_static(
        src, out, Reader(), quant_format=QuantFormat.QDQ, per_channel=True)
    yield "onnxruntime dynamic", lambda: quantize_dynamic(src, out)


def _feed_at(feed: dict, batch: int) -> dict:
    """``feed`` with its batched inputs (those whose first axis is the sample) repeated or
    cut to ``batch`` rows; recurrent states and scalars kept."""
    out = {}
    for k, v in feed.items():
        v = np.asarray(v)
        if v.ndim >= 2 and k not in ("state", "h", "c"):
            v = np.concatenate([v] * (batch // len(v) + 1))[:batch]
        out[k] = v
    return out


def speed(name: str, rounds: int = 25) -> list[str]:
    m = tm.get(name)
    if m.path is None:
        return [f"| {name} | {m.package} not installed | | | |"]
    n_cal, _, _ = SIZES.get(name, (64, 128, ""))
    cal, ev = m.make_feeds(min(n_cal, 16), 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = kiln.quantize(m.path, calibration=cal, backend="torch", measure_latency=False)
    timed = len(q.report.layer_times)
    slower = sum(1 for f, t in q.report.layer_times.values() if t >= f)
    f32 = kiln.InferenceSession(m.path, backend="torch")
    i8 = kiln.InferenceSession(q.model, backend="torch")
    cells = []
    for batch in (1, 8):
        feed = _feed_at(ev[0], batch)
        try:
            f32.run(None, feed), i8.run(None, feed)
        except Exception as e:  # a model whose other inputs fix the batch
            cells.append(f"- ({type(e).__name__})")
            continue
        tf = tq = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            f32.run(None, feed)
            t1 = time.perf_counter()
            i8.run(None, feed)
            t2 = time.perf_counter()
            tf, tq = min(tf, t1 - t0), min(tq, t2 - t1)
        cells.append(f"{tf / tq:.2f}x ({tf * 1e3:.2f} / {tq * 1e3:.2f} ms)")
    return [f"| {name} | {cells[0]} | {cells[1]} | {slower} of {timed} | "
            f"{len(q.report.quantized)} |"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("models", nargs="*", default=list(SIZES))
    p.add_argument("--budget", action="store_true",
                   help="add the accuracy-budget row (SIZES names each model's budget)")
    p.add_argument("--speed", action="store_true",
                   help="Kiln INT8 (defaults, torch) against Kiln fp32 on the torch backend")
    a = p.parse_args()
    if a.speed:
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load "
              f"{os.getloadavg()[0]:.2f}\n")
        print("| model | batch 1: fp32 / INT8 (ms) | batch 8 | layers timed slower, kept "
              "float | quantized nodes |\n| --- | --- | --- | --- | --- |")
        for name in a.models:
            print("\n".join(speed(name)), flush=True)
        return
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, kiln "
          f"{getattr(kiln, '__version__', '?')}, onnxruntime {ort.__version__}, numpy "
          f"{np.__version__}, load {os.getloadavg()[0]:.2f}")
    for name in a.models:
        print("\n".join(run(name, a.budget)), flush=True)
        print()


if __name__ == "__main__":
    main()
