"""Latency of Kiln's torch backend next to onnxruntime, in one process, runs alternating.

    python benchmarks/bench_torch.py                      # resnet18 + bert, CPU, 2 threads
    python benchmarks/bench_torch.py --models bert --seq 128 --variants eager,compile
    python benchmarks/bench_torch.py --device cuda        # GPU figures (onnxruntime on CPU
                                                          # unless its CUDA provider exists)

Models come from the zoo (``kiln.zoo.path``), batch 1. Every variant is warmed up, then
rounds alternate: a block of onnxruntime runs, then a block of each Kiln variant, so that
a slow-down from other work on the machine hits both. Each block starts after a short
rest and one untimed run, so that the previous engine's spinning worker threads (both
onnxruntime and OpenMP spin after a parallel region) do not compete for the cores.
Reported: median and p10/p90 per run in milliseconds, and the ratio to onnxruntime's
median (< 1 means Kiln is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings

import numpy as np

VARIANTS = {
    "eager": {},
    "compile": {"compile": True},
    "bf16": {"precision": "bf16"},
    "fp16": {"precision": "fp16"},
}


def feeds_for(name: str, seq: int) -> dict[str, np.ndarray]:
    from kiln.zoo.registry import get_entry
    entry = get_entry(name)
    rng = np.random.default_rng(0)
    out = {}
    for spec in entry.inputs:
        shape = [1 if d == "batch" else seq if d == "seq" else d for d in spec.shape]
        if spec.kind == "image":
            out[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        elif spec.kind == "ids":
            out[spec.name] = rng.integers(1000, 8000, shape).astype(spec.dtype)
        elif spec.kind == "mask":
            out[spec.name] = np.ones(shape, spec.dtype)
        else:
            out[spec.name] = np.zeros(shape, spec.dtype)
    return out


def timed(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def bench_model(name: str, args) -> dict:
    import onnxruntime as ort
    import torch

    import kiln
    from kiln import zoo

    path = str(zoo.path(name))
    feeds = feeds_for(name, args.seq)
    so = ort.SessionOptions()
    so.intra_op_num_threads = args.threads
    so.inter_op_num_threads = 1
    providers = ["CPUExecutionProvider"]
    if args.device.startswith("cuda") and "CUDAExecutionProvider" in ort.get_available_providers():
        providers.insert(0, "CUDAExecutionProvider")
    ref = ort.InferenceSession(path, so, providers=providers)
    want = ref.run(None, feeds)
    runners = {"onnxruntime": lambda: ref.run(None, feeds)}
    info: dict = {"model": name, "feeds": {k: list(v.shape) for k, v in feeds.items()},
                  "threads": args.threads, "device": args.device, "variants": {}}
    for v in args.variants.split(","):
        opts = dict(VARIANTS[v], device=args.device, threads=args.threads)
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sess = kiln.InferenceSession(path, backend="torch", **opts)
            got = sess.run(None, feeds)  # first run: compiles when compile=True
        setup = time.perf_counter() - t0
        err = max(float(np.abs(g.astype(np.float64) - w).max()) for g, w in zip(got, want))
        rep = sess.placement()
        info["variants"][v] = {"setup_s": round(setup, 2), "max_abs_err": err,
                               "placement": rep.counts(), "compiled": rep.compiled,
                               "warnings": [str(w.message)[:200] for w in caught
                                            if w.category.__module__.startswith("kiln")]}
        if args.device.startswith("cuda"):
            def go(s=sess):
                s.run(None, feeds)
                torch.cuda.synchronize()
        else:
            def go(s=sess):
                s.run(None, feeds)
        runners[f"kiln-{v}"] = go
    for fn in runners.values():  # warm-up
        timed(fn, args.warmup)
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.rounds):
        for k, fn in runners.items():
            # Let the other engine's worker threads stop spinning, and re-warm this one,
            # so that neither measures the other's idle threads competing for the cores.
            time.sleep(args.pause)
            fn()
            times[k] += timed(fn, args.block)
    base = statistics.median(times["onnxruntime"])
    res = {}
    for k, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        med = statistics.median(ts)
        res[k] = {"median_ms": round(med, 3), "p10_ms": round(q[0], 3), "p90_ms": round(q[-1], 3),
                  "ratio_to_ort": round(med / base, 3)}
    info["results"] = res
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet18,bert")
    ap.add_argument("--variants", default="eager,compile,bf16,fp16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=128, help="sequence length of text models")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--block", type=int, default=10, help="runs per variant per round")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--pause", type=float, default=0.3,
                    help="seconds of rest before each block (spinning threads go idle)")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(args.threads)
    out = []
    for name in args.models.split(","):
        info = bench_model(name, args)
        out.append(info)
        print(f"\n{name}  feeds {info['feeds']}  {args.threads} threads  {args.device}")
        for k, r in info["results"].items():
            print(f"  {k:<16} {r['median_ms']:9.3f} ms  (p10 {r['p10_ms']:.3f}, "
                  f"p90 {r['p90_ms']:.3f})  x{r['ratio_to_ort']:.2f}")
        for k, v in info["variants"].items():
            print(f"  [{k}] setup {v['setup_s']}s, max |err| {v['max_abs_err']:.2e}, "
                  f"{v['placement']}, compiled: {v['compiled'] or '-'}")
            for w in v["warnings"]:
                print(f"    warning: {w}")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
