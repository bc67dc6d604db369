"""Trained models that pip packages ship, on realistic inputs: Kiln against onnxruntime.

    python benchmarks/real_models.py                         # every installed model, batch 1, 8
    python benchmarks/real_models.py --models silero_vad,magika --batches 1 --budget 3

The models and their inputs are tests/trained_models.py's (speech-like audio for the voice
and wake-word models, rendered text lines and pages for PaddleOCR, characters drawn over
scikit-learn's sample photos for ddddocr's detector, real files of this Python installation
for Magika). Each model runs in a process of its own (in one process onnxruntime's later models ran
slower). For each model and batch, that process holds an onnxruntime session, Kiln's
default session (``kiln.InferenceSession(path)``, no backend named: what a user who never
reads the docs gets), Kiln on the ``torch`` and ``numpy`` backends, and OpenVINO when it is
installed, all with the same thread count; outputs are checked against onnxruntime's first,
then rounds alternate between engines (benchmarks/zoo_suite.py's ``measure``). Reported:
median latency per engine and its ratio to onnxruntime's (< 1: faster than onnxruntime).

With ``--doc`` (or for a full run) writes the table between the ``real-models`` markers of
docs/performance.md and ``benchmarks/results/real_models.json``.

    python benchmarks/real_models.py --engines torch,compiled --batches 1 [--doc]
        [--first-compile cold.json]

adds the ``compiled`` engine (torch with ``compile=True``): its first run, which compiles
the programs (or loads them from the compile cache, ``KILN_COMPILE_CACHE``), is timed
apart, and the table (``compiled-models`` markers) says how each model ran.

    python benchmarks/real_models.py --int8 [--models ...] [--doc] [--cache DIR] [--json F]
    python benchmarks/real_models.py --int8 --merge a.json,b.json [--doc]

instead times INT8: Kiln's quantizer with default options against Kiln fp32, onnxruntime
fp32 and onnxruntime running its own ``quantize_static`` file (benchmarks/real_models_int8.py),
into the ``real-models-int8`` markers.

    python benchmarks/real_models.py --recurrent [--doc]

instead times one LSTM, GRU and RNN layer (hidden 128, input 64, 50 steps, batch 1, random
weights, built here with onnx.helper: the recurrent layers the voice and wake-word models
hold, alone) on the same engines, into the ``recurrent`` markers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)
import zoo_suite as zs  # noqa: E402

import trained_models as tm  # noqa: E402
from kiln.tools.benchmark import SWITCH_REST_S  # noqa: E402

BEGIN, END = "<!-- real-models:begin -->", "<!-- real-models:end -->"
RNN_BEGIN, RNN_END = "<!-- recurrent:begin -->", "<!-- recurrent:end -->"
COMPILED_BEGIN, COMPILED_END = "<!-- compiled-models:begin -->", "<!-- compiled-models:end -->"
ENGINES = ("default", "torch", "numpy", "openvino")


def make_runner(engine: str, path: str, threads: int, feeds: dict):
    """zoo_suite's runners, plus ``default``: a Kiln session given no backend, and
    ``compiled``: the torch backend with ``compile=True`` (its programs are built, or
    loaded from the compile cache, at the first run: :func:`bench_one` times that run
    apart)."""
    if engine not in ("default", "compiled"):
        return zs.make_runner(engine, path, threads, feeds)
    import kiln
    opts = {"backend": "torch", "compile": True, "threads": threads} \
        if engine == "compiled" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = kiln.InferenceSession(path, **opts)

    def run(f):
        return sess.run(None, f)
    run.session = sess  # type: ignore[attr-defined]
    return run


def default_backend() -> str:
    """The backend kiln.InferenceSession picks when none is named."""
    import kiln
    return kiln.InferenceSession(os.path.join(ROOT, "src/kiln/data/digits_cnn.onnx")
                                 ).backend.name


def bench_one(name: str, batch: int, args, engines: list[str]) -> dict | None:
    m = tm.get(name)
    feeds = tm.feed_at_batch(m, batch)
    if feeds is None:
        return None
    rec: dict = {"model": name, "batch": batch, "engines": {},
                 "feeds": {k: list(v.shape) for k, v in feeds.items()}}
    runners, want = {}, None
    for e in engines:
        try:
            t0 = time.perf_counter()
            fn = make_runner(e, m.path, args.threads, feeds)
            got = fn(feeds)
            first_s = time.perf_counter() - t0
        except Exception as exc:  # an engine that cannot run the model is a cell, not a crash
            rec["engines"][e] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"  {name} b{batch} on {e}: {rec['engines'][e]['error']}", file=sys.stderr)
            continue
        runners[e] = fn
        want = got if want is None else want
        rec["engines"][e] = {
            "max_abs_diff_vs_ort": max((float(np.max(np.abs(np.asarray(g, np.float64) -
                                                            np.asarray(w, np.float64))))
                                        if np.asarray(w).size else 0.0)
                                       for g, w in zip(got, want)),
            "task_agreement": m.agreement([want], [got])}
        if e == "compiled":  # the session and its first run: compiling or loading programs
            sess = fn.session
            log = sess.backend.compile_log
            rec["engines"][e].update(
                first_run_s=round(first_s, 2), compiled_now=sum(x.startswith("compiled")
                                                                for x in log),
                loaded=sum(x.startswith("loaded") for x in log),
                status=sess.placement().compiled,
                ran_compiled=bool(sess.backend.last_run_stats().compiled))
    times = zs.measure(runners, feeds, args.budget, args.min_runs, args.max_runs, args.rest)
    base = statistics.median(times["onnxruntime"])
    for e, ts in times.items():
        med = statistics.median(ts)
        rec["engines"][e].update(runs=len(ts), p50_ms=round(med, 4),
                                 best_ms=round(min(ts), 4), ratio_vs_ort=round(med / base, 3))
    return rec


def recurrent_model(op: str, folder: str, hidden: int = 128, size: int = 64,
                    steps: int = 50) -> tuple[str, dict]:
    """One ``op`` layer (LSTM, GRU or RNN) saved under ``folder``, and its feeds."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    gates = {"LSTM": 4, "GRU": 3, "RNN": 1}[op]
    rng = np.random.default_rng(0)
    w = {"W": (1, gates * hidden, size), "R": (1, gates * hidden, hidden),
         "B": (1, 2 * gates * hidden)}
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.1).astype(np.float32), k)
             for k, s in w.items()]
    node = helper.make_node(op, ["X", "W", "R", "B"], ["Y", "Y_h"], hidden_size=hidden)
    graph = helper.make_graph(
        [node], op.lower(), [helper.make_tensor_value_info("X", TensorProto.FLOAT,
                                                           [steps, 1, size])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, None)], inits)
    path = os.path.join(folder, f"{op.lower()}.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path, {"X": rng.standard_normal((steps, 1, size)).astype(np.float32)}


def bench_recurrent(args, engines: list[str]) -> list[dict]:
    """Each recurrent layer on every engine, as bench_one does a trained model."""
    import tempfile

    records = []
    with tempfile.TemporaryDirectory() as folder:
        for op in ("LSTM", "GRU", "RNN"):
            path, feeds = recurrent_model(op, folder)
            rec: dict = {"model": op, "batch": 1, "engines": {}}
            runners, want = {}, None
            for e in engines:
                try:
                    fn = make_runner(e, path, args.threads, feeds)
                    got = fn(feeds)
                except Exception as exc:  # an engine that cannot run it is a cell
                    rec["engines"][e] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
                    continue
                runners[e] = fn
                want = got if want is None else want
                rec["engines"][e] = {"max_abs_diff_vs_ort": max(
                    float(np.max(np.abs(g - w))) for g, w in zip(got, want))}
            times = zs.measure(runners, feeds, args.budget, args.min_runs, args.max_runs,
                               args.rest)
            base = statistics.median(times["onnxruntime"])
            for e, ts in times.items():
                med = statistics.median(ts)
                rec["engines"][e].update(runs=len(ts), p50_ms=round(med, 4),
                                         ratio_vs_ort=round(med / base, 3))
            records.append(rec)
            print(f"{op}: " + "  ".join(f"{e} {x['ratio_vs_ort']:.2f}x" for e, x in
                                         rec["engines"].items()), flush=True)
    return records


def markdown(env: dict, records: list[dict], engines: list[str]) -> str:
    others = [e for e in engines if e != "onnxruntime"]
    lines = [f"Run {env['date']} on {env['cpu']} ({env['machine']}), load {env['load']}, "
             f"{env['threads']} threads per engine; " +
             ", ".join(f"{k} {env[k]}" for k in ("python", "numpy", "onnxruntime", "torch",
                                                 "openvino") if k in env) +
             f". Kiln's default session runs on its `{env['default_backend']}` backend.", "",
             "| model | batch | onnxruntime ms | " +
             " | ".join(f"{e} ms | {e} ×ort" for e in others) + " |",
             "|---|---|---|" + "---|---|" * len(others)]
    for r in records:
        cells = []
        for e in others:
            x = r["engines"].get(e, {})
            if "p50_ms" not in x:
                cells += ["—", "—"]
            else:
                cells += [f"{x['p50_ms']:.3g}", f"**{x['ratio_vs_ort']:.2f}**"]
        ort_ms = r["engines"]["onnxruntime"]["p50_ms"]
        lines.append(f"| {r['model']} | {r['batch']} | {ort_ms:.3g} | " + " | ".join(cells)
                     + " |")
    return "\n".join(lines)


def compiled_markdown(env: dict, records: list[dict], cold: dict | None = None) -> str:
    """``--engines torch,compiled``'s table: eager and compiled torch against onnxruntime,
    each model's first run (compiling its programs, or loading them from the cache) and
    how it ran (one program, or in parts). ``cold``: an earlier run's JSON whose first
    runs compiled (an empty cache): their seconds get a column of their own."""
    lines = [f"Run {env['date']} on {env['cpu']} ({env['machine']}), load {env['load']}, "
             f"{env['threads']} threads per engine; " +
             ", ".join(f"{k} {env[k]}" for k in ("python", "numpy", "onnxruntime", "torch")
                       if k in env) + ".", "",
             "| model | batch | onnxruntime ms | torch ms | torch ×ort | compiled ms | "
             "compiled ×ort | first run s | programs compiled / loaded | how |"
             + (" first compile s |" if cold else ""),
             "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if cold else "")]
    first = {(r["model"], r["batch"]): r["engines"].get("compiled", {}).get("first_run_s", "—")
             for r in (cold or {}).get("records", [])}
    for r in records:
        ort_ms = r["engines"]["onnxruntime"]["p50_ms"]
        t, c = r["engines"].get("torch", {}), r["engines"].get("compiled", {})
        cells = [f"{x['p50_ms']:.3g} | **{x['ratio_vs_ort']:.2f}**" if "p50_ms" in x
                 else "— | —" for x in (t, c)]
        status = c.get("status", "")
        how = "eager (not compiled)" if not c.get("ran_compiled") else \
            status.split(";")[0].removeprefix("yes, in parts: ") \
            if status.startswith("yes, in parts") else "one program"
        lines.append(f"| {r['model']} | {r['batch']} | {ort_ms:.3g} | {cells[0]} | {cells[1]} "
                     f"| {c.get('first_run_s', '—')} | {c.get('compiled_now', '—')} / "
                     f"{c.get('loaded', '—')} | {how} |"
                     + (f" {first.get((r['model'], r['batch']), '—')} |" if cold else ""))
    return "\n".join(lines)


def write_docs(md: str, doc: str, begin: str = BEGIN, end: str = END) -> None:
    with open(doc) as f:
        text = f.read()
    if begin not in text:
        print(f"no {begin} marker in {doc}; the table was not written", file=sys.stderr)
        return
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    with open(doc, "w") as f:
        f.write(f"{head}{begin}\n{md}\n{end}{tail}")


def load_now() -> str:
    """The 1, 5 and 15-minute load averages, for a run's environment."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def in_child(script: str, name: str, argv: list[str], tmp: str) -> dict:
    """``script`` (a benchmark with ``--models`` and ``--json``) run on model ``name``
    alone in a fresh process with ``argv``; its saved run. In one process, onnxruntime
    ran PaddleOCR's models at twice their time alone after Magika (the per-model runs of
    docs/performance.md), so each model gets a process of its own."""
    out = os.path.join(tmp, f"{name}.json")
    subprocess.run([sys.executable, script, "--models", name, "--json", out, *argv],
                   check=True)
    with open(out) as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(tm.available()))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=4.0, help="seconds per model and batch")
    ap.add_argument("--min-runs", type=int, default=20)
    ap.add_argument("--max-runs", type=int, default=400)
    ap.add_argument("--rest", type=float, default=SWITCH_REST_S,
                    help="seconds of rest whenever the engine changes (kiln bench's)")
    ap.add_argument("--doc", action="store_true", help="write docs/performance.md's table")
    ap.add_argument("--json", default=None)
    ap.add_argument("--first-compile", default=None, metavar="JSON",
                    help="with the compiled engine: an earlier run's JSON (made with an "
                    "empty compile cache) whose first-run seconds are the first compiles")
    ap.add_argument("--recurrent", action="store_true",
                    help="time one LSTM, GRU and RNN layer instead of the trained models")
    ap.add_argument("--int8", action="store_true",
                    help="INT8 files (Kiln's and onnxruntime's) against fp32 instead")
    ap.add_argument("--cache", default=None,
                    help="with --int8: where the quantized files are kept between runs")
    ap.add_argument("--merge", default=None, metavar="JSON,JSON",
                    help="with --int8: one table from runs saved with --json (one per "
                    "locked command), into the docs with --doc")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    models = [n for n in args.models.split(",") if n]
    missing = [n for n in models if n not in tm.MODELS or tm.get(n).path is None]
    if missing:
        print(f"not available here: {', '.join(missing)} (installed: "
              f"{', '.join(tm.available())})", file=sys.stderr)
        return 2
    if args.int8:
        import real_models_int8
        return real_models_int8.main(args, models, write_docs)
    engines = zs.engine_names([e for e in args.engines.split(",") if e])
    records = []
    with threadpool_limits(args.threads):
        env = zs.environment(argparse.Namespace(threads=args.threads, seq=None))
        env["load"] = load_now()
        env["default_backend"] = default_backend()
        if args.recurrent:
            records = bench_recurrent(args, engines)
            md = markdown(env, records, engines)
            print(md)
            if args.doc:
                write_docs(md, os.path.join(ROOT, "docs", "performance.md"), RNN_BEGIN,
                           RNN_END)
            return 0
        if len(models) > 1:  # each model in a process of its own (in_child says why)
            argv = ["--batches", args.batches, "--engines", args.engines,
                    "--threads", str(args.threads), "--budget", str(args.budget),
                    "--min-runs", str(args.min_runs), "--max-runs", str(args.max_runs),
                    "--rest", str(args.rest)]
            with tempfile.TemporaryDirectory() as tmp:
                records = [r for name in models for r in
                           in_child(os.path.abspath(__file__), name, argv, tmp)["records"]]
            env["load"] += " to " + load_now()
        else:
            for b in (int(x) for x in args.batches.split(",")):
                rec = bench_one(models[0], b, args, engines)
                if rec is None:
                    continue
                records.append(rec)
                row = "  ".join(f"{e} {x['ratio_vs_ort']:.2f}x" for e, x in
                                rec["engines"].items() if "ratio_vs_ort" in x)
                print(f"{models[0]} b{b}: onnxruntime "
                      f"{rec['engines']['onnxruntime']['p50_ms']:.3f} ms  {row}", flush=True)
    compiled = "compiled" in engines
    cold = None
    if args.first_compile:
        with open(args.first_compile) as f:
            cold = json.load(f)
    md = compiled_markdown(env, records, cold) if compiled else markdown(env, records, engines)
    print(md)
    full = set(models) == set(tm.available())
    if args.doc or (full and not compiled):
        write_docs(md, os.path.join(ROOT, "docs", "performance.md"),
                   *((COMPILED_BEGIN, COMPILED_END) if compiled else (BEGIN, END)))
    name = "real_models_compiled.json" if compiled else "real_models.json"
    path = args.json or (os.path.join(HERE, "results", name) if args.doc or (full and not compiled)
                         else None)
    if path:
        with open(path, "w") as f:
            json.dump({"environment": env, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
