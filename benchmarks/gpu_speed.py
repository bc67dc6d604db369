"""Kiln's torch backend on a GPU next to the original PyTorch module, in one process.

    python benchmarks/gpu_speed.py [--models resnet50,mobilenetv2,bert,gpt2]
        [--batches 1,64] [--precisions fp32,bf16] [--seq 128] [--ways ...] [--json out.json]

For each zoo model, precision and batch, up to five ways of computing the same outputs
from the same CUDA tensors:

- ``torch-eager``: the zoo's original ``nn.Module`` (``ZooEntry.make_model``);
- ``torch-compile``: that module under ``torch.compile`` (default mode);
- ``torch-graphs``: that module under ``torch.compile(mode="reduce-overhead")``, which adds
  CUDA graphs as Kiln's compiled sessions do (not in the default ``--ways``: each output
  is overwritten by the next run, where Kiln hands out outputs of their own);
- ``kiln-eager``: Kiln's session on the model's ONNX file, ``device="cuda"``;
- ``kiln-compile``: the same with ``compile=True`` (torch.compile with frozen weights and
  CUDA graphs).

fp32 is fp32 on both sides (cuDNN's TF32 convolutions off for the module, as Kiln's
``precision="fp32"`` runs); tf32 puts both on TF32 products. bf16 is mixed precision on
both sides: the module runs under ``torch.autocast``, Kiln with ``precision="bf16"``
(products and convolutions in bf16, fp32 in and out); fp16 likewise. Feeds are CUDA
tensors and Kiln returns CUDA tensors (``output_type="torch"``), so no side pays for
host copies. After warm-up (whose first call is reported as ``first_s``: compilation),
rounds alternate a block of runs of each way, each block timed between two
``torch.cuda.synchronize()``; the per-run median over the rounds is reported, with its
ratio to ``torch-compile`` and ``torch-eager``. Also reported: each output's relative L2
error against the module's fp32 eager output, and Kiln's host<->device transfers per run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import warnings


def first_tensor(out):
    """The first tensor of a module's output (tensor, tuple, list, dict or ModelOutput)."""
    import torch
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict):
        out = list(out.values())
    return first_tensor(out[0])


def rel_l2(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def time_blocks(runners: dict, rounds: int, target_s: float, sync) -> dict[str, list[float]]:
    """Per-run milliseconds of each runner, one figure per round (``sync`` waits for the
    device)."""
    sizes = {}
    for k, fn in runners.items():  # block size: about target_s of runs
        sync()
        t = time.perf_counter()
        fn()
        sync()
        sizes[k] = max(3, min(500, int(target_s / max(time.perf_counter() - t, 1e-5))))
    times: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(rounds):
        for k, fn in runners.items():
            n = sizes[k]
            sync()
            t = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            times[k].append((time.perf_counter() - t) * 1e3 / n)
    return times


def bench(name: str, precision: str, batch: int, args, cache: dict) -> dict:
    import torch

    import kiln
    from kiln import zoo
    from kiln.zoo.registry import get_entry, make_inputs

    entry = get_entry(name)
    path = str(zoo.path(name, progress=False))
    feeds_np = make_inputs(entry, batch=batch, seq=args.seq, seed=0)
    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    xs = [torch.from_numpy(feeds_np[t.name]).to(dev) for t in entry.inputs]
    feeds = {t.name: x for t, x in zip(entry.inputs, xs)}
    if name not in cache:
        cache[name] = {"module": entry.make_model().to(dev).eval()}
    module = cache[name]["module"]
    for way, mode in (("torch-compile", "default"), ("torch-graphs", "reduce-overhead")):
        if way in args.ways and way not in cache[name]:  # dynamic=False as Kiln: per shape
            cache[name][way] = torch.compile(module, dynamic=False, mode=mode)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = torch.autocast(dev, dtype=half) if half else contextlib.nullcontext()

    tf32 = precision == "tf32"

    def module_runner(m):
        def run():
            if dev == "cuda":  # Kiln's runs restore the switches after each run
                torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = tf32
            with torch.inference_mode(), autocast:
                return first_tensor(m(*xs))
        return run

    sessions = {}
    for way, compile_ in (("kiln-eager", False), ("kiln-compile", True)):
        if way not in args.ways:
            continue
        key = (way, precision)
        if key not in cache[name]:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = time.perf_counter()
                cache[name][key] = kiln.InferenceSession(path, backend="torch", device=dev,
                                                         precision=precision, compile=compile_)
                cache[name][key + ("setup",)] = time.perf_counter() - t
        sessions[way] = cache[name][key]

    def kiln_runner(sess):
        return lambda: sess.run(None, feeds, output_type="torch")[0]

    runners = {k: (kiln_runner(sessions[k]) if k in sessions
                   else module_runner(module if k == "torch-eager" else cache[name][k]))
               for k in args.ways}
    with torch.inference_mode():
        torch.backends.cudnn.allow_tf32 = False
        ref = first_tensor(module(*xs)).float()
    info: dict = {"model": name, "precision": precision, "batch": batch,
                  "seq": args.seq if entry.is_text else None, "ways": {}}
    for k in list(runners):
        t = time.perf_counter()
        try:
            out = runners[k]()
            sync()
        except Exception as e:  # noqa: BLE001 - report the way that failed, time the rest
            info["ways"][k] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            del runners[k]
            continue
        w = {"first_s": round(time.perf_counter() - t, 2), "rel_l2_vs_fp32_eager":
             rel_l2(out.float(), ref)}
        if k.startswith("kiln"):
            rep = sessions[k].placement()
            w.update(setup_s=round(cache[name][(k, precision, "setup")], 2),
                     transfers_per_run=rep.last_run.transfers,
                     fallback_layers=len(rep.fallbacks), compiled=rep.compiled,
                     last_run_compiled=bool(rep.last_run.compiled))
        info["ways"][k] = w
    for fn in runners.values():  # warm-up (CUDA graphs record, autotuning settles)
        for _ in range(args.warmup):
            fn()
    times = time_blocks(runners, args.rounds, args.block_s, sync)
    for k, ts in times.items():
        info["ways"][k]["median_ms"] = round(statistics.median(ts), 4)
        info["ways"][k]["rounds_ms"] = [round(x, 4) for x in ts]
    for k in times:
        for base in ("torch-compile", "torch-graphs", "torch-eager"):
            if base in times:
                info["ways"][k][f"x_{base}"] = round(
                    info["ways"][k]["median_ms"] / info["ways"][base]["median_ms"], 3)
    return info


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="resnet50,mobilenetv2,bert,gpt2")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--precisions", default="fp32,bf16")
    ap.add_argument("--seq", type=int, default=128, help="sequence length of text models")
    ap.add_argument("--ways", default="torch-eager,torch-compile,kiln-eager,kiln-compile",
                    help="also: torch-graphs")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--block-s", type=float, default=0.05, help="seconds per timed block")
    ap.add_argument("--json", help="write the results here (after every configuration)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of this script")
    args = ap.parse_args(argv)
    args.ways = args.ways.split(",")
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure", file=sys.stderr)
        return 1
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"# {gpu}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}", flush=True)
    rows, cache = [], {}
    for precision in args.precisions.split(","):
        for name in args.models.split(","):
            for batch in map(int, args.batches.split(",")):
                try:
                    info = bench(name, precision, batch, args, cache)
                except Exception as e:  # noqa: BLE001 - keep measuring the others
                    info = {"model": name, "precision": precision, "batch": batch,
                            "error": f"{type(e).__name__}: {str(e)[:300]}"}
                rows.append(info)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(rows, f, indent=1)
                head = f"{name:<12} {precision} b{batch:<3}"
                if "error" in info:
                    print(f"{head} ERROR {info['error']}", flush=True)
                    continue
                for k, w in info["ways"].items():
                    if "error" in w:
                        print(f"{head} {k:<14} ERROR {w['error']}", flush=True)
                        continue
                    extra = (f"  transfers {w['transfers_per_run']}" if "transfers_per_run" in w
                             else "")
                    print(f"{head} {k:<14} {w.get('median_ms', float('nan')):9.3f} ms  "
                          f"x{w.get('x_torch-compile', float('nan')):.2f} compile  "
                          f"x{w.get('x_torch-graphs', float('nan')):.2f} graphs  "
                          f"x{w.get('x_torch-eager', float('nan')):.2f} eager  "
                          f"first {w['first_s']}s  err {w['rel_l2_vs_fp32_eager']:.1e}{extra}",
                          flush=True)
            cache.pop(name, None)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
