"""INT8 on the real-model benchmark (``benchmarks/real_models.py --int8``): for each
trained model, what a user gets from Kiln's quantizer with default options against Kiln
fp32, onnxruntime fp32 and onnxruntime running onnxruntime's own INT8 file.

    python benchmarks/real_models.py --int8 [--models silero_vad_seq] [--batches 1,8] [--doc]
    python benchmarks/run.py real-models-int8 [the same options]

Files: Kiln's ``kiln.quantize(path, "static", cal)`` with every option at its default
(the quantizer then calibrates and measures on the backend a default session runs the
file on, speed-aware timing of each layer and of the whole model there: the table names
the backend), the same with ``speed_aware=False`` (every layer the plan allows
quantized: what the default gave when it measured on NumPy), and onnxruntime's
``quantize_static(path, out, reader,
quant_format=QDQ)`` with its defaults, all calibrated on the same feeds
(tests/trained_models.py's calibration set). They are cached under ``--cache`` (default:
the system temp dir), keyed by the model file and Kiln's quantizer sources, so reruns
time without re-quantizing. Engines, in one process, rounds alternating (zoo_suite's
``measure``): ``onnxruntime`` on the fp32 file and on its own INT8 file, and Kiln's
default session (``kiln.InferenceSession(path)``, no backend named) on the fp32 file and
on both of Kiln's INT8 files. Each engine's outputs are scored against onnxruntime fp32's
by the model's task agreement.
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
ENGINES = ("onnxruntime", "ort int8", "kiln fp32", "kiln int8", "kiln int8 all")
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
    info = {"kiln": stem + ".kiln.onnx", "kiln all": stem + ".kiln-all.onnx",
            "ort": stem + ".ort.onnx", "meta": stem + ".json"}
    if all(os.path.exists(p) for p in info.values()):
        with open(info["meta"]) as f:
            return {**info, **json.load(f)}
    cal, _ = m.make_feeds(CALIBRATION.get(name, 16), 1)
    meta = {}
    # default options, then every layer quantized (the speed-aware decisions' baseline)
    for key, opts in (("kiln", {}), ("kiln all", {"speed_aware": False})):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = kiln.quantize(m.path, "static", cal, **opts)
        kept = [str(v) for v in q.report.kept.values()]
        meta[key + " report"] = {"seconds": round(time.perf_counter() - t0, 1),
                     "measured_on": q.report.backend, "quantized": len(q.report.quantized),
                     "kept": len(kept), "speed_timed": len(q.report.layer_times),
                     "reverted_for_speed": sum("speed-aware" in v and "the model with" not in v
                                               for v in kept),
                     "whole_model_reverted": sum("the model with" in v for v in kept),
                     # where the time goes, for the docs: each timed layer's float and
                     # quantized ms, the layers left quantized, the whole-model verdict
                     "layer_ms": {k: [round(f, 4), round(x, 4)]
                                  for k, (f, x) in q.report.layer_times.items()},
                     "quantized_layers": list(q.report.quantized),
                     "whole_model": next((v for v in kept if "the model with" in v), "")}
        with open(info[key], "wb") as f:
            f.write(to_proto(q.model).SerializeToString())
    t0 = time.perf_counter()
    _ort_static(m.path, cal, info["ort"])
    meta["ort seconds"] = round(time.perf_counter() - t0, 1)
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
             "kiln int8": files["kiln"], "kiln int8 all": files["kiln all"]}
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
    """The speed table (ms and ratios per model and batch), then what each file holds."""
    runs = env.get("runs") or [_run_line(env, sorted({r["model"] for r in records}))]
    lines = [f"Run on {env['cpu']} ({env['machine']}), {env['threads']} threads "
             "for onnxruntime; " + ", ".join(f"{k} {env[k]}" for k in
                                             ("python", "numpy", "onnxruntime", "torch")
                                             if k in env) +
             f". Kiln's sessions run on its `{env['default_backend']}` backend (the default). "
             "Speed-up = fp32 ms / INT8 ms on the same engine (above 1: INT8 faster); "
             "\"kiln / ort int8\" = Kiln's INT8 ms / onnxruntime's INT8 ms (below 1: Kiln "
             "faster). Load average (1, 5, 15 min) at each locked run's start and end: " +
             "; ".join(runs) + ".", "",
             "| model | batch | ort fp32 ms | ort int8 ms | kiln fp32 ms | kiln int8 ms "
             "| kiln int8 `speed_aware=False` ms | ort int8 speed-up "
             "| kiln int8 speed-up | `speed_aware=False` speed-up | kiln / ort int8 "
             "| `speed_aware=False` / ort int8 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        ms = {e: _ms(r, e) for e in ENGINES}
        cells = ["—" if v is None else f"{v:.3g}" for v in ms.values()]
        lines.append(f"| {r['model']} | {r['batch']} | " + " | ".join(cells) + " | " +
                     " | ".join(_ratio(a, b) for a, b in (
                         (ms["onnxruntime"], ms["ort int8"]),
                         (ms["kiln fp32"], ms["kiln int8"]),
                         (ms["kiln fp32"], ms["kiln int8 all"]),
                         (ms["kiln int8"], ms["ort int8"]),
                         (ms["kiln int8 all"], ms["ort int8"]))) + " |")
    lines += ["", "| model | Kiln default file: measured on, quantized / kept, timed layers "
              "reverted, whole-model check reverted | `speed_aware=False`: quantized / kept "
              "| task agreement with ort fp32 at batch 1: kiln / `speed_aware=False` / ort "
              "int8 | quantize s: kiln / `speed_aware=False` / ort |",
              "|---|---|---|---|---|"]
    first = {r["model"]: r for r in reversed(records)}
    for name, q in meta.items():
        k, every = q["kiln report"], q["kiln all report"]
        r = first.get(name, {"engines": {}})
        agree = " / ".join("—" if "task_agreement" not in r["engines"].get(e, {}) else
                           f"{r['engines'][e]['task_agreement']:.0%}"
                           for e in ("kiln int8", "kiln int8 all", "ort int8"))
        lines.append(f"| {name} | {k['measured_on']}, {k['quantized']} / {k['kept']}, "
                     f"{k['reverted_for_speed']} of {k['speed_timed']}, "
                     f"{k['whole_model_reverted']} | {every['quantized']} / {every['kept']} | "
                     f"{agree} | {k['seconds']:.0f} / {every['seconds']:.0f} / "
                     f"{q['ort seconds']:.0f} |")
    return "\n".join(lines)


def _run_line(env: dict, models: list[str]) -> str:
    return f"{env['date']} ({', '.join(models)}) {env['load']} -> {env.get('load_end', '?')}"


def merge(paths: list[str]) -> tuple[dict, list[dict], dict]:
    """The environment, records and file reports of runs saved with ``--json`` (one run
    per locked command), as one table's: each run's date and load listed."""
    env, records, meta, runs = {}, [], {}, []
    for p in paths:
        with open(p) as f:
            run = json.load(f)
        env = env or dict(run["environment"])
        records += run["records"]
        meta.update(run["files"])
        runs.append(_run_line(run["environment"], list(run["files"])))
    env["runs"] = runs
    return env, records, meta


def main(args, models: list[str], write_docs) -> int:
    """``real_models.py --int8``: quantize (or read the cache), then time each model and
    batch; the table goes to docs/performance.md's ``real-models-int8`` markers with
    ``--doc``."""
    import real_models as rm
    import zoo_suite as zs
    from threadpoolctl import threadpool_limits

    if args.merge:
        md = markdown(*merge(args.merge.split(",")))
        print(md)
        if args.doc:
            write_docs(md, os.path.join(ROOT, "docs", "performance.md"), BEGIN, END)
        return 0
    cache = args.cache or os.path.join(tempfile.gettempdir(), "kiln-real-models-int8")
    meta, records = {}, []
    with threadpool_limits(args.threads):
        env = zs.environment(argparse_ns(args.threads))
        env["load"] = rm.load_now()
        env["default_backend"] = rm.default_backend()
        for name in models:
            files = quantized_files(name, cache)
            meta[name] = files
            print(f"{name}: " + json.dumps({k: files[k + " report"]
                                            for k in ("kiln", "kiln all")}), flush=True)
            for b in (int(x) for x in args.batches.split(",")):
                rec = bench_one(name, b, args, files)
                if rec is None:
                    continue
                records.append(rec)
                print(f"{name} b{b}: " + "  ".join(
                    f"{e} {x['p50_ms']:.3f} ms" for e, x in rec["engines"].items()
                    if "p50_ms" in x), flush=True)
    env["load_end"] = rm.load_now()
    md = markdown(env, records, meta)
    print(md)
    if args.doc:
        write_docs(md, os.path.join(ROOT, "docs", "performance.md"), BEGIN, END)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "records": records,
                       "files": {k: {x: y for x, y in v.items()
                                     if x.endswith(("report", "seconds"))}
                                 for k, v in meta.items()}}, f, indent=1)
    return 0


def argparse_ns(threads: int):
    import argparse
    return argparse.Namespace(threads=threads, seq=None)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    import real_models
    sys.exit(real_models.main(["--int8", *sys.argv[1:]]))
