"""INT8 on the real-model benchmark (``benchmarks/real_models.py --int8``): for each
trained model, what a user gets from Kiln's quantizer with default options against Kiln
fp32, onnxruntime fp32 and onnxruntime running onnxruntime's own INT8 file.

    python benchmarks/real_models.py --int8 [--models silero_vad_seq] [--batches 1,8] [--doc]

Files: Kiln's ``kiln.quantize(path, "static", cal)`` (every option at its default, so
speed-aware timing happens on the backend the quantizer defaults to, which the table
names) and onnxruntime's ``quantize_static(path, out, reader, quant_format=QDQ)`` (its
defaults), both calibrated on the same feeds (tests/trained_models.py's calibration set).
They are cached under ``--cache`` (default: the system temp dir), keyed by the model file
and Kiln's quantizer sources, so reruns time without re-quantizing. Engines, one process
per model and batch, rounds alternating (zoo_suite's ``measure``): ``onnxruntime`` (fp32),
``ort int8`` (onnxruntime on its own file), ``kiln fp32`` and ``kiln int8`` (each
``kiln.InferenceSession(path)`` given no backend: the default session). Outputs of every
engine are compared with onnxruntime fp32's by the model's task agreement.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BEGIN, END = "<!-- real-models-int8:begin -->", "<!-- real-models-int8:end -->"
ENGINES = ("onnxruntime", "ort int8", "kiln fp32", "kiln int8")
CALIBRATION = {"ppocr_det_v4": 6, "dddd_det": 8}
"""Calibration samples per model (16 otherwise): the detectors' pages are large."""


def _key(path: str) -> str:
    """The cache key: the model file and every source of Kiln's quantizer (a change
    there re-quantizes)."""
    h = hashlib.sha256()
    h.update(f"{path}:{os.path.getsize(path)}:{os.path.getmtime(path)}".encode())
    for f in sorted(glob.glob(os.path.join(ROOT, "src", "kiln", "quantize", "*.py"))):
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()[:12]


def _ort_static(src: str, cal: list[dict], out: str) -> None:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(cal)

        def get_next(self):
            return next(self.it, None)

    quantize_static(src, out, Reader(), quant_format=QuantFormat.QDQ)


def quantized_files(name: str, cache: str) -> dict:
    """Kiln's and onnxruntime's INT8 files of model ``name`` (made once, then cached) and
    what Kiln's quantizer reported."""
    import kiln
    import trained_models as tm
    from kiln.onnxio import to_proto

    m = tm.get(name)
    os.makedirs(cache, exist_ok=True)
    stem = os.path.join(cache, f"{name}-{_key(m.path)}")
    info = {"kiln": stem + ".kiln.onnx", "ort": stem + ".ort.onnx", "meta": stem + ".json"}
    if all(os.path.exists(p) for p in info.values()):
        with open(info["meta"]) as f:
            return {**info, **json.load(f)}
    cal, _ = m.make_feeds(CALIBRATION.get(name, 16), 0)
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = kiln.quantize(m.path, "static", cal)
    meta = {"kiln_seconds": round(time.perf_counter() - t0, 1),
            "measured_on": q.report.backend,
            "quantized": len(q.report.quantized), "kept": len(q.report.kept),
            "speed_timed": len(q.report.layer_times),
            "reverted_for_speed": sum("speed-aware" in str(v) for v in q.report.kept.values()),
            "notes": [str(x) for x in getattr(q.report, "notes", [])][:6]}
    with open(info["kiln"], "wb") as f:
        f.write(to_proto(q.model).SerializeToString())
    t0 = time.perf_counter()
    _ort_static(m.path, cal, info["ort"])
    meta["ort_seconds"] = round(time.perf_counter() - t0, 1)
    with open(info["meta"], "w") as f:
        json.dump(meta, f, indent=1)
    return {**info, **meta}


def bench_one(name: str, batch: int, args, files: dict) -> dict | None:
    import real_models as rm
    import zoo_suite as zs

    import trained_models as tm

    m = tm.get(name)
    feeds = tm.feed_at_batch(m, batch)
    if feeds is None:
        return None
    paths = {"onnxruntime": m.path, "ort int8": files["ort"], "kiln fp32": m.path,
             "kiln int8": files["kiln"]}
    rec: dict = {"model": name, "batch": batch, "engines": {}}
    runners, want = {}, None
    for e, path in paths.items():
        try:
            fn = (zs.make_runner("onnxruntime", path, args.threads, feeds)
                  if e.startswith("o") else rm.make_runner("default", path, args.threads,
                                                           feeds))
            got = fn(feeds)
        except Exception as exc:  # an engine that cannot run the file is a cell
            rec["engines"][e] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"  {name} b{batch} on {e}: {rec['engines'][e]['error']}", file=sys.stderr)
            continue
        runners[e] = fn
        want = got if want is None else want
        rec["engines"][e] = {"task_agreement": m.agreement([want], [got])}
    times = zs.measure(runners, feeds, args.budget, args.min_runs, args.max_runs, args.rest)
    for e, ts in times.items():
        rec["engines"][e].update(runs=len(ts), p50_ms=round(statistics.median(ts), 4),
                                 best_ms=round(min(ts), 4))
    return rec


def _ms(r: dict, e: str) -> float | None:
    return r["engines"].get(e, {}).get("p50_ms")


def _ratio(a: float | None, b: float | None) -> str:
    return "—" if a is None or b is None else f"**{a / b:.2f}**"


def markdown(env: dict, records: list[dict], meta: dict) -> str:
    lines = [f"Run {env['date']} on {env['cpu']} ({env['machine']}), load {env['load']} at "
             f"the start and {env.get('load_end', '?')} at the end, {env['threads']} threads "
             "for onnxruntime; " + ", ".join(f"{k} {env[k]}" for k in
                                             ("python", "numpy", "onnxruntime", "torch")
                                             if k in env) +
             f". Kiln's sessions run on its `{env['default_backend']}` backend (the default).",
             "", "| model | batch | ort fp32 ms | ort int8 ms | kiln fp32 ms | kiln int8 ms "
             "| kiln int8 speed-up (fp32 / int8) | ort int8 speed-up | kiln int8 / ort int8 "
             "| int8 agreement kiln / ort | Kiln's file: quantized, kept (speed-aware on) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ms = {e: _ms(r, e) for e in ENGINES}
        cells = ["—" if v is None else f"{v:.3g}" for v in ms.values()]
        agree = " / ".join("—" if "task_agreement" not in r["engines"].get(e, {}) else
                           f"{r['engines'][e]['task_agreement']:.0%}"
                           for e in ("kiln int8", "ort int8"))
        q = meta[r["model"]]
        lines.append(f"| {r['model']} | {r['batch']} | " + " | ".join(cells) + " | " +
                     f"{_ratio(ms['kiln fp32'], ms['kiln int8'])} | "
                     f"{_ratio(ms['onnxruntime'], ms['ort int8'])} | "
                     f"{_ratio(ms['kiln int8'], ms['ort int8'])} | {agree} | "
                     f"{q['quantized']}, {q['kept']} ({q['measured_on']}: "
                     f"{q['reverted_for_speed']} of {q['speed_timed']} timed reverted) |")
    return "\n".join(lines)


def main(args, models: list[str], write_docs) -> int:
    """``real_models.py --int8``: quantize (or read the cache), then time each model and
    batch; the table goes to docs/performance.md's ``real-models-int8`` markers with
    ``--doc``."""
    import real_models as rm
    import zoo_suite as zs
    from threadpoolctl import threadpool_limits

    cache = args.cache or os.path.join(tempfile.gettempdir(), "kiln-real-models-int8")
    meta, records = {}, []
    with threadpool_limits(args.threads):
        env = zs.environment(argparse_ns(args.threads))
        env["load"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
        env["default_backend"] = rm.default_backend()
        for name in models:
            files = quantized_files(name, cache)
            meta[name] = files
            print(f"{name}: Kiln's file measured on {files['measured_on']}, "
                  f"{files['quantized']} quantized, {files['kept']} kept, "
                  f"{files['reverted_for_speed']} of {files['speed_timed']} timed reverted",
                  flush=True)
            for b in (int(x) for x in args.batches.split(",")):
                rec = bench_one(name, b, args, files)
                if rec is None:
                    continue
                records.append(rec)
                print(f"{name} b{b}: " + "  ".join(
                    f"{e} {x['p50_ms']:.3f} ms" for e, x in rec["engines"].items()
                    if "p50_ms" in x), flush=True)
    env["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    md = markdown(env, records, meta)
    print(md)
    if args.doc:
        write_docs(md, os.path.join(ROOT, "docs", "performance.md"), BEGIN, END)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "records": records,
                       "files": {k: {x: y for x, y in v.items() if x not in ENGINES}
                                 for k, v in meta.items()}}, f, indent=1)
    return 0


def argparse_ns(threads: int):
    import argparse
    return argparse.Namespace(threads=threads, seq=None)


if __name__ == "__main__":
    sys.exit("run it as: python benchmarks/real_models.py --int8")
