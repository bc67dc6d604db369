"""Where a trained model's time goes, Kiln against onnxruntime, by kind of layer.

    python benchmarks/real_model_layers.py                     # every installed model, batch 1
    python benchmarks/real_model_layers.py --models magika,dddd_det --runs 30 [--doc]

For each model of tests/trained_models.py, a process of its own (one process that had run
Magika first ran onnxruntime's sessions of the PaddleOCR models at twice their time alone)
holds onnxruntime and Kiln's default session (``kiln.InferenceSession(path)``); first
their unprofiled medians (alternating blocks, benchmarks/zoo_suite.py's ``measure``),
then each engine's own per-layer profile on the same feed: Kiln's ``kiln.profile`` on
the thread count its thread trial chose for these shapes, onnxruntime's
``enable_profiling`` trace on its 2 threads (its optimized graph, saved alongside, names
each node's kernel and group). The
median time of every main-graph layer is summed by kind: convolutions by kernel size,
depthwise or dense, 1-D or 2-D; products; recurrent layers; pooling; normalization;
control flow (If: its branch included); data movement and shape ops (onnxruntime's
NCHWc reorders among them); elementwise; and "per-call" — each engine's unprofiled run
minus its profiled layers' sum (dispatch and the plan's bookkeeping; zero when the
profiled layers add up to more than the run, as under load they can). The two
engines fuse differently, so kinds are compared, not nodes.

Prints, per model, the kinds ordered by how much more time Kiln spends on them, and
writes the table between the ``real-model-layers`` markers of docs/performance.md with
``--doc`` (the raw figures with ``--json``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)
import real_models as rm  # noqa: E402
import time_by_op as tbo  # noqa: E402
import zoo_suite as zs  # noqa: E402

import trained_models as tm  # noqa: E402

BEGIN, END = "<!-- real-model-layers:begin -->", "<!-- real-model-layers:end -->"
CONV = {"Conv", "FusedConv", "NhwcFusedConv", "ConvTranspose"}
MATMUL = {"MatMul", "Gemm", "FusedMatMul", "FusedGemm", "Attention", "MultiHeadAttention"}
SIMPLE = {
    "recurrent": {"LSTM", "GRU", "RNN"},
    "pool": {"MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"},
    "norm": {"LayerNormalization", "LayerNorm", "SkipLayerNormalization",
             "BatchNormalization", "InstanceNormalization", "SimplifiedLayerNormalization"},
    "control": {"If", "Loop", "Scan"},
    "data": {"Reshape", "Transpose", "Gather", "Concat", "Split", "Slice", "Squeeze",
             "Unsqueeze", "Shape", "Flatten", "Expand", "Range", "Cast", "ReorderInput",
             "ReorderOutput", "Identity", "Tile", "Pad", "Resize", "ConstantOfShape", "Size",
             "MemcpyToHost", "MemcpyFromHost"},
}
KIND_OF = {op: k for k, ops in SIMPLE.items() for op in ops}
OVERHEAD = "per-call"


def layer_kind(op: str, attrs: dict, weight_shape: tuple | None) -> str:
    """The kind a layer is counted under: convolutions by kernel (``conv 3x3 dw``,
    ``conv1d k5``, ``conv 5x1``), else a group of op types, else ``elementwise``."""
    if op in CONV:
        k = list(attrs.get("kernel_shape") or (weight_shape[2:] if weight_shape else []))
        group = int(attrs.get("group", 1))
        dw = " dw" if group > 1 else ""
        if len(k) == 1:
            return f"conv1d k{k[0]}{dw}"
        return ("conv " + "x".join(map(str, k)) if k else "conv") + dw
    if op in MATMUL:
        return "matmul"
    return KIND_OF.get(op, "elementwise")


def _attrs_of(node) -> dict:
    from onnx import helper
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def ort_profile(path: str, feeds: dict, threads: int, runs: int) -> tuple[list, float]:
    """(kind, median ms) of every main-graph node onnxruntime ran, by its own profiler,
    and its profiled run's median ms."""
    import onnx

    optimized = os.path.join(tempfile.mkdtemp(), "opt.onnx")
    events = tbo.ort_trace(path, feeds, threads, runs, inter_op_num_threads=1,
                           log_severity_level=3, optimized_model_filepath=optimized)
    opt = onnx.load(optimized, load_external_data=False)
    inits = {i.name: tuple(i.dims) for i in opt.graph.initializer}
    nodes = {n.name: n for n in opt.graph.node}  # main graph only: If branches inside
    per_node, walls = collections.defaultdict(list), []
    for e in events:
        if e.get("cat") == "Session" and e.get("name") == "model_run":
            walls.append(e["dur"] / 1e3)
        elif e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            name = e["name"][: -len("_kernel_time")]
            if name in nodes:
                per_node[name].append(e["dur"] / 1e3)
    out = []
    for name, ts in per_node.items():
        n = nodes[name]
        w = inits.get(n.input[1]) if len(n.input) > 1 else None
        out.append((layer_kind(n.op_type, _attrs_of(n), w), statistics.median(ts[3:] or ts)))
    return out, statistics.median(walls[3:] or walls)


def kiln_profile(sess, feeds: dict, runs: int) -> tuple[list, float, int]:
    """(kind, median ms) of every main-graph layer of a Kiln session (its If layers carry
    their branches), its profiled run's median ms, and the thread count profiled on: the
    one the session's thread trial chose for these shapes (one thread on a small model)."""
    from threadpoolctl import threadpool_limits

    import kiln

    chosen = _trial_choice(sess)
    torch = None
    if chosen == 1:
        import torch
        before = torch.get_num_threads()
        torch.set_num_threads(1)
    try:
        with threadpool_limits(chosen or 2):
            prof = kiln.profile(sess, feeds, runs=runs, warmup=3)
    finally:
        if torch is not None:
            torch.set_num_threads(before)
    out = []
    for layer in prof.layers:
        if not layer.times_ms or layer.once:
            continue
        node = sess.plan.steps[layer.index].node
        w = getattr(node.inputs[1], "shape", None) if len(node.inputs) > 1 and \
            node.inputs[1] is not None else None
        w = tuple(w) if w and all(isinstance(d, int) for d in w) else None
        out.append((layer_kind(node.op_type, dict(node.attrs), w),
                    statistics.median(layer.times_ms)))
    return out, statistics.median(prof.wall_ms), chosen or 2


def _trial_choice(sess) -> int | None:
    """The thread count the session's trial settled on for its main plan (None: none)."""
    trials = sess.backend.__dict__.get("_thread_trials") or {}
    per = trials.get(sess.plan) or {}
    chosen = [t.chosen for t in per.values() if t.chosen is not None]
    return chosen[0] if chosen else None


def by_kind(layers: list, run_ms: float) -> dict[str, list]:
    """kind -> [layer count, ms], with the per-call remainder: the unprofiled run's
    median minus the profiled layers' sum (onnxruntime's profiler adds tens of µs a node
    to its own run, so the profiled run is no base for it)."""
    acc: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for k, ms in layers:
        acc[k][0] += 1
        acc[k][1] += ms
    acc[OVERHEAD] = [1, max(0.0, run_ms - sum(ms for _, ms in layers))]
    return dict(acc)


def bench_one(name: str, args) -> dict:
    import kiln

    m = tm.get(name)
    feeds = tm.feed_at_batch(m, 1)
    ort_run = zs.make_runner("onnxruntime", m.path, args.threads, feeds)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = kiln.InferenceSession(m.path)

    def kiln_run(f):
        return sess.run(None, f)
    times = zs.measure({"onnxruntime": ort_run, "kiln": kiln_run}, feeds, args.budget, 20,
                       400, args.rest)
    ort_ms, kiln_ms = (statistics.median(times[e]) for e in ("onnxruntime", "kiln"))
    o_layers, o_wall = ort_profile(m.path, feeds, args.threads, args.runs)
    k_layers, k_wall, k_threads = kiln_profile(sess, feeds, args.runs)
    return {"model": name, "ort_ms": round(ort_ms, 4), "kiln_ms": round(kiln_ms, 4),
            "ratio": round(kiln_ms / ort_ms, 3), "kiln_backend": sess.backend.name,
            "kiln_threads": k_threads, "ort_profiled_ms": round(o_wall, 4),
            "kiln_profiled_ms": round(k_wall, 4),
            "ort": {k: [n, round(v, 4)] for k, (n, v) in by_kind(o_layers, ort_ms).items()},
            "kiln": {k: [n, round(v, 4)] for k, (n, v) in by_kind(k_layers, kiln_ms).items()}}


def differences(r: dict) -> list[tuple[str, int, float, int, float]]:
    """(kind, ort layers, ort ms, kiln layers, kiln ms), most extra Kiln time first."""
    kinds = set(r["ort"]) | set(r["kiln"])
    rows = [(k, *r["ort"].get(k, [0, 0.0]), *r["kiln"].get(k, [0, 0.0])) for k in kinds]
    return sorted(rows, key=lambda x: x[2] - x[4])


def _ms(v: float) -> str:
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}"


def markdown(env: dict, records: list[dict], top: int) -> str:
    lines = [f"Run {env['date']} on {env['cpu']} ({env['machine']}), load {env['load']}, "
             f"batch 1; onnxruntime {env['onnxruntime']}, torch {env['torch']}. `run` is "
             "the unprofiled median (ms, alternating rounds) and its ratio; the kinds are "
             "each engine's profiled layers (medians, ms, layer count) summed, the "
             f"{top} where Kiln spends the most more than onnxruntime; `per-call` is the "
             "unprofiled run minus the profiled layers (dispatch, bookkeeping).", "",
             "| model | run: ort / Kiln (×ort), Kiln threads | where Kiln spends more: "
             "kind (ort layers) ort ms → (Kiln layers) Kiln ms |", "|---|---|---|"]
    for r in records:
        diffs = [d for d in differences(r) if d[4] - d[2] > 0][:top]
        cells = "; ".join(f"{k} ({no}) {_ms(om)} → ({nk}) {_ms(km)}" if k != OVERHEAD
                          else f"{k} {_ms(om)} → {_ms(km)}" for k, no, om, nk, km in diffs)
        lines.append(f"| {r['model']} | {_ms(r['ort_ms'])} / {_ms(r['kiln_ms'])} "
                     f"(**{r['ratio']:.2f}**), {r['kiln_threads']} | {cells} |")
    return "\n".join(lines)


def _joined(parts: list[dict]) -> tuple[dict, list[dict]]:
    """One run's (environment, records) from runs saved with --json: the first one's
    environment, every run's records."""
    return parts[0]["environment"], [r for p in parts for r in p["records"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(tm.available()))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=30, help="profiled runs per engine")
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of unprofiled runs")
    ap.add_argument("--rest", type=float, default=rm.SWITCH_REST_S)
    ap.add_argument("--top", type=int, default=4, help="kinds per model in the table")
    ap.add_argument("--doc", action="store_true", help="write docs/performance.md's table")
    ap.add_argument("--json", default=None)
    ap.add_argument("--merge", default=None, metavar="JSON,JSON",
                    help="one table from runs saved with --json (one per locked command)")
    args = ap.parse_args(argv)
    from threadpoolctl import threadpool_limits

    models = [n for n in args.models.split(",") if n]
    if args.merge:
        parts = [json.load(open(p)) for p in args.merge.split(",")]
        env, records = _joined(parts)
        env["load"] = " / ".join(p["environment"]["load"] for p in parts)
    elif len(models) > 1:  # each model in a process of its own (the docstring says why)
        load0 = rm.load_now()
        with tempfile.TemporaryDirectory() as tmp:
            argv = ["--threads", str(args.threads), "--runs", str(args.runs),
                    "--budget", str(args.budget), "--rest", str(args.rest)]
            env, records = _joined([rm.in_child(os.path.abspath(__file__), name, argv, tmp)
                                    for name in models])
        env["load"] = f"{load0} to {rm.load_now()}"
    else:
        with threadpool_limits(args.threads):
            env = zs.environment(argparse.Namespace(threads=args.threads, seq=None))
            load0 = rm.load_now()
            r = bench_one(models[0], args)
            print(f"{models[0]}: ort {r['ort_ms']:.3f} ms, kiln {r['kiln_ms']:.3f} ms "
                  f"({r['ratio']:.2f}x, {r['kiln_threads']} threads)", flush=True)
            for k, no, om, nk, km in differences(r):
                print(f"   {k:<16} ort {no:>3} {om:8.3f}   kiln {nk:>3} {km:8.3f}   "
                      f"{km - om:+8.3f}", flush=True)
            records = [r]
            env["load"] = f"{load0} to {rm.load_now()}"
    md = markdown(env, records, args.top)
    print(md)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "records": records}, f, indent=1)
    if args.doc:
        rm.write_docs(md, os.path.join(ROOT, "docs", "performance.md"), BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
