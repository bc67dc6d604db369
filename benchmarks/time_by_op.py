"""Where a zoo model's time goes, a Kiln backend against onnxruntime, by kind of layer.

    python benchmarks/time_by_op.py --models resnet50,bert --batches 1 --seq 16
    python benchmarks/time_by_op.py --backend numpy --json numpy.json  # every zoo model

For each model and batch: the median unprofiled run of both engines in steady state
(alternating blocks in one process, each after a rest and 60 ms of untimed runs), then
each engine's own per-layer profile (Kiln's ``kiln.profile``; onnxruntime's
``enable_profiling``), the median time of every layer summed by kind (convolution,
matrix product, attention, normalization, pooling, elementwise, data movement,
quantization). The two engines fuse differently (onnxruntime's
Conv carries its BatchNorm and Relu as Kiln's FusedConv does; its MatMul+Add+Gelu become
FusedMatMul/BiasGelu in one engine and not the other), so kinds, not op types, are
compared. A profiler adds its own cost to each layer: the table gives every engine's
profiled layer sum next to its unprofiled run, so that cost can be read off.

Writes a markdown table (stdout, or between the ``time-by-op`` markers of ``--doc``) and
the raw figures as JSON (``--json``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_suite import environment, make_runner  # noqa: E402

BEGIN, END = "<!-- time-by-op:begin -->", "<!-- time-by-op:end -->"
KINDS = {
    "conv": {"Conv", "FusedConv", "QConv", "ConvInteger", "ConvTranspose", "QLinearConv",
             "NhwcFusedConv"},
    "matmul": {"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "QMatMul", "MatMulInteger",
               "QLinearMatMul", "MatMulNBits", "DynamicQuantizeMatMul"},
    "attention": {"Attention", "MultiHeadAttention", "Softmax"},
    "norm": {"LayerNormalization", "SkipLayerNormalization", "BatchNormalization",
             "RMSNormalization", "RMSNorm", "SimplifiedLayerNormalization",
             "InstanceNormalization", "LRN"},
    "pool": {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"},
    "data": {"Reshape", "Transpose", "Gather", "Concat", "Split", "Slice", "Squeeze",
             "Unsqueeze", "Shape", "Flatten", "Expand", "Range", "Cast", "ReorderInput",
             "ReorderOutput", "Identity", "ChannelShuffle", "Tile", "Pad", "Resize",
             "ConstantOfShape", "Size"},
    "quant": {"QuantizeLinear", "DequantizeLinear", "QuantizeDequantize",
              "DynamicQuantizeLinear"},
}
KIND_OF = {op: kind for kind, ops in KINDS.items() for op in ops}
COLUMNS = [*KINDS, "elementwise"]  # every other op is elementwise (Add, Mul, Gelu, Where...)


def kind(op: str) -> str:
    """The kind of layer an op type is counted under."""
    return KIND_OF.get(op, "elementwise")


def kiln_layers(path: str, feeds: dict, backend: str, threads: int, runs: int
                ) -> list[tuple[str, float]]:
    """(op type, median ms) of every layer of a Kiln session, by Kiln's profiler."""
    import kiln
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = kiln.InferenceSession(path, backend=backend, threads=threads)
    prof = kiln.profile(sess, feeds, runs=runs, warmup=3)
    return [(x.op_type, statistics.median(x.times_ms)) for x in prof.layers
            if x.times_ms and not x.once]


def ort_trace(path: str, feeds: dict, threads: int, runs: int, **options) -> list[dict]:
    """onnxruntime's profiler events over 3 warm-up runs and ``runs`` more on ``threads``
    intra-op threads; ``options``: further ``SessionOptions`` fields to set."""
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ort")
    for k, v in options.items():
        setattr(so, k, v)
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    for _ in range(3 + runs):
        sess.run(None, feeds)
    trace = sess.end_profiling()
    with open(trace) as f:
        events = json.load(f)
    os.remove(trace)
    return events


def ort_layers(path: str, feeds: dict, threads: int, runs: int) -> list[tuple[str, float]]:
    """(op type, median ms) of every node onnxruntime ran, by its own profiler."""
    events = ort_trace(path, feeds, threads, runs)
    per_node = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            per_node[(e["name"], e["args"]["op_name"])].append(e["dur"] / 1e3)
    return [(op, statistics.median(ts[3:] or ts)) for (_, op), ts in per_node.items()]


def by_kind(layers: list[tuple[str, float]]) -> dict[str, float]:
    """ms per kind of layer."""
    acc = dict.fromkeys(COLUMNS, 0.0)
    for op, ms in layers:
        acc[kind(op)] += ms
    return acc


def steady_times(runners: dict, feeds: dict, budget_s: float) -> dict[str, list[float]]:
    """Per engine, run times (ms) in steady state: blocks alternate between the engines,
    each after a 0.2 s rest (so the other engine's spinning threads have stopped) and 60
    ms of untimed runs (on this VM a thread woken after idle time runs several times
    slower for a while: docs/performance.md, "Runs after idle time")."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    start = time.perf_counter()
    while min(len(v) for v in times.values()) < 5 or time.perf_counter() - start < budget_s:
        for name, fn in runners.items():
            time.sleep(0.2)
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 0.06:
                fn(feeds)
            for _ in range(5):
                t = time.perf_counter()
                fn(feeds)
                times[name].append((time.perf_counter() - t) * 1e3)
    return times


def bench_one(name: str, batch: int, args) -> dict:
    import kiln.zoo as zoo
    from kiln.zoo.registry import make_inputs

    path = str(zoo.path(name))
    feeds = make_inputs(name, batch=batch, seq=args.seq, seed=0)
    runners = {e: make_runner(e, path, args.threads, feeds)
               for e in ("onnxruntime", args.backend)}
    times = steady_times(runners, feeds, args.budget)
    del runners
    runs = max(5, min(50, int(args.budget * 1e3 / 2 / statistics.median(times[args.backend]))))
    rec = {"model": name, "batch": batch, "seq": args.seq, "profiled_runs": runs,
           "backend": args.backend}
    for e, layers in (("onnxruntime", ort_layers(path, feeds, args.threads, runs)),
                      (args.backend, kiln_layers(path, feeds, args.backend, args.threads,
                                                 runs))):
        rec[e] = {"run_ms": round(statistics.median(times[e]), 3), "layers": len(layers),
                  "profiled_sum_ms": round(sum(ms for _, ms in layers), 3),
                  "by_kind_ms": {k: round(v, 3) for k, v in by_kind(layers).items()}}
    return rec


def markdown(env: dict, records: list[dict]) -> str:
    head = (f"Run {env['date']} on {env['cpu']} ({env['machine']}), {env['threads']} "
            f"threads; python {env['python']}, torch {env['torch']}, onnxruntime "
            f"{env['onnxruntime']}, onnx {env['onnx']}, numpy {env['numpy']} with "
            f"{env['numpy BLAS']}. Milliseconds: `run` is the "
            "unprofiled median; the kinds are each engine's profiled layers (medians) "
            "summed, `sum` their total; ort = onnxruntime, kiln = Kiln's "
            f"{records[0]['backend'] if records else ''} backend.\n\n")
    cols = " | ".join(COLUMNS)
    lines = [f"| model | batch | engine | layers | run | sum | {cols} |",
             "|---|---|---|---|---|---|" + "---|" * len(COLUMNS)]
    for r in records:
        label = r["model"] + (f" (seq {r['seq']})" if _is_text(r["model"]) else "")
        for e, short in (("onnxruntime", "ort"), (r["backend"], "kiln")):
            x = r[e]
            kinds = " | ".join(_ms(x["by_kind_ms"][k]) for k in COLUMNS)
            ratio = "" if e == "onnxruntime" else \
                f" ({x['run_ms'] / r['onnxruntime']['run_ms']:.2f}x)"
            lines.append(f"| {label} | {r['batch']} | {short} | {x['layers']} | "
                         f"{x['run_ms']:.3f}{ratio} | {x['profiled_sum_ms']:.3f} | {kinds} |")
    return head + "\n".join(lines) + "\n"


def _ms(v: float) -> str:
    return "·" if v < 0.0005 else f"{v:.3f}"


def _is_text(name: str) -> bool:
    from kiln.zoo.registry import get_entry
    return any(i.kind == "ids" for i in get_entry(name).inputs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="all", help="comma-separated zoo names, or 'all'")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--seq", type=int, default=128, help="sequence length for text models")
    ap.add_argument("--backend", default="torch", choices=["torch", "numpy"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--budget", type=float, default=4.0, help="seconds per engine and model")
    ap.add_argument("--json", help="write the raw figures here")
    ap.add_argument("--doc", help="markdown file whose time-by-op table to replace")
    args = ap.parse_args(argv)
    from kiln.zoo.registry import REGISTRY
    models = [n for n in REGISTRY if not n.endswith("_dynamo")] if args.models == "all" \
        else args.models.split(",")
    records = []
    for name in models:
        for b in (int(x) for x in args.batches.split(",")):
            records.append(bench_one(name, b, args))
            r = records[-1]
            print(f"{name} b{b}: ort {r['onnxruntime']['run_ms']} ms, kiln "
                  f"{r[args.backend]['run_ms']} ms", file=sys.stderr)
    env = environment(argparse.Namespace(threads=args.threads, seq=args.seq))
    md = markdown(env, records)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "records": records}, f, indent=1)
    if args.doc:
        with open(args.doc) as f:
            text = f.read()
        a, b = text.index(BEGIN) + len(BEGIN), text.index(END)
        with open(args.doc, "w") as f:
            f.write(text[:a] + "\n" + md + text[b:])
    else:
        print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
