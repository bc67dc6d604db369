"""Every zoo model on every engine: latency, throughput and peak memory, side by side.

    python benchmarks/zoo_suite.py                       # all zoo models, batch 1 and 8
    python benchmarks/zoo_suite.py --models resnet18,bert --batches 1 --budget 5

For each model and batch size, one process holds an onnxruntime session, a Kiln session per
backend (``numpy``, ``torch``), and OpenVINO and tract ones when they are installed
(``pip install -e ".[bench]"``), all with the same thread count (tract: its default).
Outputs are first checked against onnxruntime's. Then rounds alternate between the
engines: each round runs a short block per engine, after a rest so that the previous
engine's spinning worker threads (onnxruntime, OpenMP and OpenBLAS all spin after a
parallel region) do not compete with the next one. Reported per engine:
median and p90 latency per run, throughput (samples/s at the median), and the ratio of its
median to onnxruntime's (< 1: faster than onnxruntime).

Peak memory is measured apart, one child process per engine (a process's high-water mark
cannot be reset per engine): each child imports every engine, notes its resident size,
loads the model and runs it once; reported is the high-water mark above that baseline
(weights, plans, activations, workspace).

For a run of all models, writes ``benchmarks/results/zoo_benchmark.json`` and the table
between the ``zoo-suite`` markers of ``docs/performance.md`` (elsewhere with
``--json``/``--doc``): a partial run does not replace the full table.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEGIN, END = "<!-- zoo-suite:begin -->", "<!-- zoo-suite:end -->"
OPTIONAL = ("openvino", "tract")  # anchors, measured when installed (pip install .[bench])


def _import_engines() -> None:
    """Imports every engine's library, so that all memory children start from one baseline."""
    import onnxruntime  # noqa: F401
    import torch  # noqa: F401

    import kiln  # noqa: F401
    for anchor in OPTIONAL:
        _anchor(anchor)


def _anchor(name: str):
    """The optional engine's module, or None where it is not installed."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def engine_names(requested: list[str]) -> list[str]:
    """The requested engines that are installed here, onnxruntime first."""
    return ["onnxruntime"] + [e for e in requested if e != "onnxruntime"
                              and (e not in OPTIONAL or _anchor(e) is not None)]


def make_runner(engine: str, path: str, threads: int, feeds: dict):
    """A function feeds -> list of arrays for ``engine`` (tract plans for ``feeds``'
    shapes; the others take any)."""
    if engine == "onnxruntime":
        from kiln.tools.benchmark import _ort_session
        sess = _ort_session(path, threads, "cpu")
        return lambda feeds: sess.run(None, feeds)
    if engine == "openvino":
        import openvino as ov
        # f32 asked for: on CPUs with AVX512_BF16 or AMX OpenVINO otherwise computes in bf16
        # (outputs 1e-2 to 3.5 away from onnxruntime's on the zoo), no fp32 anchor
        compiled = ov.Core().compile_model(path, "CPU", {"INFERENCE_NUM_THREADS": threads,
                                                         "INFERENCE_PRECISION_HINT": "f32"})
        request = compiled.create_infer_request()

        def run_ov(feeds):
            request.infer(feeds)
            return [request.get_output_tensor(i).data.copy()
                    for i in range(len(compiled.outputs))]
        return run_ov
    if engine == "tract":
        return _tract_runner(path, feeds)
    import kiln
    opts = {"threads": threads} if engine == "torch" else {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = kiln.InferenceSession(path, backend=engine, **opts)
    return lambda feeds: sess.run(None, feeds)


_TRACT_TYPES = {"float32": "f32", "float64": "f64", "int64": "i64", "int32": "i32",
                "bool": "bool"}


def _tract_runner(path: str, feeds: dict):
    """tract, optimized for the shapes of ``feeds`` (its default threads: it has no
    per-model thread setting)."""
    import tract
    model = tract.onnx().load(path)
    names = [model.input_name(i) for i in range(model.input_count())]
    for i, name in enumerate(names):
        a = feeds[name]
        model.set_input_fact(i, ",".join([*map(str, a.shape), _TRACT_TYPES[a.dtype.name]]))
    runnable = model.into_model().into_runnable()
    return lambda f: [o.to_numpy() for o in runnable.run([f[n] for n in names])]


def peak_memory_child(engine: str, path: str, feeds_path: str, threads: int) -> None:
    """Child-process mode: prints the MB of resident memory one load + run adds."""
    from threadpoolctl import threadpool_limits
    _import_engines()
    feeds = dict(np.load(feeds_path))
    base = _status_kb("VmRSS")
    with threadpool_limits(threads):
        make_runner(engine, path, threads, feeds)(feeds)
    print(json.dumps({"peak_mb": (_status_kb("VmHWM") - base) / 1024}))


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def peak_memory(engine: str, path: str, feeds_path: str, threads: int) -> float | None:
    """MB one load + run of ``path`` on ``engine`` adds, in a fresh child process."""
    proc = subprocess.run([sys.executable, __file__, "--memory-child", engine, path, feeds_path,
                           str(threads)], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  memory child for {engine} failed: {proc.stderr.strip()[-300:]}",
              file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]


def measure(runners: dict, feeds: dict, budget_s: float, min_runs: int, max_runs: int,
            rest_s: float) -> dict[str, list[float]]:
    """Alternating blocks of timed runs until every engine has ``min_runs`` and the time
    budget is spent (or ``max_runs`` reached). Each block starts after a rest, with one
    untimed run when a run is short enough that this costs little."""
    est = {}
    for name, fn in runners.items():  # warm-up, and a first estimate of each run's time
        time.sleep(rest_s)  # the previous engine's workers may still spin: rest here too
        fn(feeds)
        t = time.perf_counter()
        fn(feeds)
        est[name] = time.perf_counter() - t
    times: dict[str, list[float]] = {k: [] for k in runners}
    start = time.perf_counter()
    while True:
        for name, fn in runners.items():
            time.sleep(rest_s)
            if est[name] < 0.05:
                fn(feeds)
            block = max(1, min(10, int(0.3 / max(est[name], 1e-4))))
            for _ in range(block):
                t = time.perf_counter()
                fn(feeds)
                times[name].append((time.perf_counter() - t) * 1e3)
        n = min(len(v) for v in times.values())
        if n >= max_runs or (n >= min_runs and time.perf_counter() - start > budget_s):
            return times


def bench_one(name: str, batch: int, args, engines: list[str]) -> dict:
    import kiln.zoo as zoo
    from kiln.zoo.registry import get_entry, make_inputs

    path = str(zoo.path(name))
    entry = get_entry(name)
    feeds = make_inputs(entry, batch=batch, seq=args.seq, seed=0)
    rec: dict = {"model": name, "batch": batch, "feeds": {k: list(v.shape) for k, v in
                                                          feeds.items()}, "engines": {}}
    runners = {}
    want = None
    for e in engines:  # an engine that cannot run the model is recorded, not fatal
        try:
            fn = make_runner(e, path, args.threads, feeds)
            got = fn(feeds)
        except Exception as exc:
            rec["engines"][e] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            print(f"  {name} b{batch} on {e}: {rec['engines'][e]['error']}", file=sys.stderr)
            continue
        runners[e] = fn
        want = got if want is None else want
        err = max(float(np.max(np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))))
                  if np.asarray(w).size else 0.0 for g, w in zip(got, want))
        rec["engines"][e] = {"max_abs_diff_vs_ort": err}
    times = measure(runners, feeds, args.budget, args.min_runs, args.max_runs, args.rest)
    del runners
    base = statistics.median(times["onnxruntime"])
    for e, ts in times.items():
        med = statistics.median(ts)
        rec["engines"][e].update(
            runs=len(ts), p50_ms=round(med, 3), p90_ms=round(float(np.percentile(ts, 90)), 3),
            throughput_per_s=round(batch * 1e3 / med, 2), ratio_vs_ort=round(med / base, 3))
    if not args.no_memory:
        feeds_path = os.path.join(args.tmp, "feeds.npz")
        np.savez(feeds_path, **feeds)
        for e in times:
            mb = peak_memory(e, path, feeds_path, args.threads)
            rec["engines"][e]["peak_mb"] = None if mb is None else round(mb, 1)
    return rec


def environment(args) -> dict:
    import onnx
    import onnxruntime
    import torch

    import kiln
    env = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
           "machine": f"{platform.processor() or platform.machine()}, "
                      f"{len(os.sched_getaffinity(0))} cores",
           "cpu": _cpu_model(), "threads": args.threads, "seq": args.seq,
           "python": platform.python_version(), "numpy": np.__version__,
           "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__,
           "torch": torch.__version__, "kiln": getattr(kiln, "__version__", "?"),
           "numpy BLAS": _numpy_blas()}
    for anchor in OPTIONAL:
        mod = _anchor(anchor)
        if mod is not None:
            env[anchor] = mod.version() if anchor == "tract" else mod.__version__
    return env


def _numpy_blas() -> str:
    """NumPy's BLAS and the kernel family it runs, which sets the NumPy backend's speed
    (an OPENBLAS_CORETYPE in the environment overrides OpenBLAS's own choice: Haswell
    kernels on an AVX-512 CPU made Kiln's NumPy backend up to 1.6x slower)."""
    from threadpoolctl import threadpool_info

    libs = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    if not libs:
        return "unknown"
    lib = libs[0]
    forced = os.environ.get("OPENBLAS_CORETYPE")
    return (f"{lib.get('internal_api')} {lib.get('version')} ({lib.get('architecture')} "
            f"kernels{', set by OPENBLAS_CORETYPE' if forced else ''})")


def _cpu_model() -> str:
    """The CPU's model name and the vector extensions that change these numbers most."""
    name, flags, ids = platform.processor(), set(), {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("cpu family", "model"):  # a VM's name can be just "AMD EPYC"
                    ids[key] = line.split(":", 1)[1].strip()
                elif line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    have = [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni",
                                "amx_tile")
            if f in flags]
    if len(ids) == 2:
        name += f" (family {ids['cpu family']} model {ids['model']})"
    return f"{name}; {' '.join(have) or 'no AVX2'}" if flags else name


def _cell(rec: dict, e: str, key: str, fmt: str) -> str:
    v = rec["engines"].get(e, {}).get(key)
    return "—" if v is None else format(v, fmt)


def markdown(env: dict, records: list[dict], engines: list[str]) -> str:
    others = [e for e in engines if e != "onnxruntime"]
    head = ["model", "batch", "onnxruntime p50 / p90 ms"]
    for e in others:
        head += [f"{e} p50 / p90 ms", f"{e} ×ort"]
    head += [f"samples/s ({' · '.join(engines)})", f"peak MB ({' · '.join(engines)})"]
    lines = [f"Run {env['date']} on {env['cpu']} ({env['machine']}), {env['threads']} "
             f"threads per engine, text models at sequence length {env['seq']}; "
             + ", ".join(f"{k} {env[k]}" for k in ("python", "numpy", "numpy BLAS", "onnx",
                                                   "onnxruntime", "torch", "openvino", "tract")
                         if k in env) + ".",
             "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in records:
        row = [r["model"], str(r["batch"]),
               f"{_cell(r, 'onnxruntime', 'p50_ms', '.2f')} / "
               f"{_cell(r, 'onnxruntime', 'p90_ms', '.2f')}"]
        for e in others:
            row += [f"{_cell(r, e, 'p50_ms', '.2f')} / {_cell(r, e, 'p90_ms', '.2f')}",
                    f"**{_cell(r, e, 'ratio_vs_ort', '.2f')}**"]
        row += [" · ".join(_cell(r, e, "throughput_per_s", ".1f") for e in engines),
                " · ".join(_cell(r, e, "peak_mb", ".0f") for e in engines)]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_docs(md: str, doc: str) -> None:
    text = open(doc).read() if os.path.exists(doc) else "# Performance\n"
    block = f"{BEGIN}\n{md}\n{END}"
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    with open(doc, "w") as f:
        f.write(text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--memory-child"]:
        peak_memory_child(argv[1], argv[2], argv[3], int(argv[4]))
        return 0
    import kiln.zoo as zoo
    from kiln.tools.benchmark import progress_bar
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="all", help="comma-separated zoo names, or 'all'")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--engines", default="numpy,torch,openvino,tract")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128, help="sequence length for text models")
    ap.add_argument("--budget", type=float, default=6.0,
                    help="seconds of timed rounds per model and batch (at least --min-runs)")
    ap.add_argument("--min-runs", type=int, default=5)
    ap.add_argument("--max-runs", type=int, default=60)
    ap.add_argument("--rest", type=float, default=0.2, help="seconds of rest before a block")
    ap.add_argument("--no-memory", action="store_true")
    ap.add_argument("--json", help="where to write the results "
                    "(default: benchmarks/results/zoo_benchmark.json when --models all)")
    ap.add_argument("--doc", help="markdown file whose zoo-suite table to replace "
                    "(default: docs/performance.md when --models all)")
    ap.add_argument("--tmp", default="/tmp")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    names = ([e.name for e in zoo.list_models()] if args.models == "all"
             else args.models.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    engines = engine_names(args.engines.split(","))
    full = args.models == "all"
    default_json = os.path.join(ROOT, "benchmarks", "results", "zoo_benchmark.json")
    json_path = args.json or (default_json if full else None)
    env = environment(args)
    records = []
    bar = progress_bar(len(names) * len(batches), "zoo suite", True)
    with threadpool_limits(args.threads):
        for name in names:
            for batch in batches:
                bar.set_description(f"{name} b{batch}")
                rec = bench_one(name, batch, args, engines)
                records.append(rec)
                bar.update(1)
                summary = ", ".join(f"{e} {v['p50_ms']:.1f} ms" for e, v in rec["engines"].items()
                                    if "p50_ms" in v)
                print(f"{name} b{batch}: {summary}", file=sys.stderr, flush=True)
                if json_path:  # after every model: a long run keeps its part
                    with open(json_path, "w") as f:
                        json.dump({"environment": env, "results": records}, f, indent=1)
    bar.close()
    md = markdown(env, records, engines)
    doc = args.doc or (os.path.join(ROOT, "docs", "performance.md") if full else None)
    if doc:
        write_docs(md, doc)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
