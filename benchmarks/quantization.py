"""Reduced precision side by side: fp32 / fp16 / int8-dynamic / int8-static /
int4-weight-only files made by kiln.quantize and kiln.convert_float16, and onnxruntime's
own quantization tool on the same models as the anchor.

For every file: size, error and top-1 agreement against fp32 on held-out inputs drawn
like the calibration inputs (zoo.make_inputs, other seeds), and latency of Kiln's torch
backend, Kiln's NumPy backend and onnxruntime on that same file, batch 1 and 8: the
median of at least ``--runs`` runs, in one process, the engines and files taking turns in
blocks that each start after a rest and an untimed run (zoo_suite's ``measure``), so that
one engine's spinning worker threads do not slow the next.

    python benchmarks/quantization.py [--models resnet18 mobilenetv2 bert] [--runs 5]
        [--variants fp32 int8-static ort-int8-static] [--no-numpy] [--json FILE]
    python benchmarks/quantization.py --kernels [--runs 30]   # int8 vs fp32 conv alone

Kiln's torch backend runs QDQ layers on fbgemm's integer kernels (kiln.passes.fuse_quant);
the ``int8 / fp32`` columns of the speed table are ratios within one process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings

import numpy as np
import onnxruntime as ort
import torch

import kiln
from kiln.onnxio import save
from kiln.zoo import path as zoo_path
from kiln.zoo.registry import make_inputs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_suite import measure  # noqa: E402


def _ort_session(path: str):
    so = ort.SessionOptions()
    so.intra_op_num_threads = torch.get_num_threads()
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def _accuracy(path: str, ref_path: str, feeds: list[dict]) -> tuple[float, float]:
    """(worst relative error, top-1 agreement) of ``path`` against ``ref_path``, both
    run by onnxruntime."""
    s, r = _ort_session(path), _ort_session(ref_path)
    rel, agree, rows = 0.0, 0, 0
    for f in feeds:
        for a, b in zip(s.run(None, f), r.run(None, f)):
            a2, b2 = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
            rel = max(rel, float(np.abs(a2 - b2).max() / np.abs(b2).max()))
            agree += int((a2.argmax(-1) == b2.argmax(-1)).sum())
            rows += len(a2)
    return rel, agree / rows


def _ort_anchor(src: str, out_dir: str, name: str, cal: list[dict]) -> dict[str, str]:
    """onnxruntime.quantization's dynamic and static (QDQ) files for the same model."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.it = iter(cal)

        def get_next(self):
            return next(self.it, None)

    pre = os.path.join(out_dir, f"{name}_pre.onnx")
    quant_pre_process(src, pre, skip_symbolic_shape=True)
    out = {}
    dyn = os.path.join(out_dir, f"{name}_ort_dynamic.onnx")
    quantize_dynamic(pre, dyn, weight_type=QuantType.QInt8)
    out["ort-int8-dynamic"] = dyn
    st = os.path.join(out_dir, f"{name}_ort_static.onnx")
    quantize_static(pre, st, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    reduce_range=True)
    out["ort-int8-static"] = st
    return out


def run(models: list[str], runs: int, variants: list[str] | None = None,
        numpy_backend: bool = True) -> dict:
    """Every figure, per model and variant (all variants unless ``variants`` names some)."""
    def wanted(label: str) -> bool:
        return variants is None or label in variants

    results: dict = {}
    tmp = tempfile.mkdtemp(prefix="kiln_quant_bench_")
    for name in models:
        src = str(zoo_path(name, progress=False))
        cal = [make_inputs(name, batch=8, seed=s) for s in range(4)]
        held = [make_inputs(name, batch=8, seed=100 + s) for s in range(4)]
        files = {"fp32": src}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if wanted("fp16"):
                files["fp16"] = os.path.join(tmp, f"{name}_fp16.onnx")
                save(kiln.convert_float16(src), files["fp16"])
            for mode, label in [("dynamic", "int8-dynamic"), ("static", "int8-static"),
                                ("weight-only", "int4-weight-only")]:
                if not wanted(label):
                    continue
                q = kiln.quantize(src, mode, cal if mode == "static" else None,
                                  backend="torch", measure_latency=False)
                files[label] = os.path.join(tmp, f"{name}_{label}.onnx")
                q.save(files[label])
            if wanted("ort-int8-dynamic") or wanted("ort-int8-static"):
                files.update({k: v for k, v in _ort_anchor(src, tmp, name, cal).items()
                              if wanted(k)})
        results[name] = {}
        for label, path in files.items():
            row: dict = {"size_mb": os.path.getsize(path) / 1e6}
            row["rel_error"], row["top1_agreement"] = _accuracy(path, src, held)
            results[name][label] = row
        for batch in (1, 8):
            times = _side_by_side(name, files, batch, runs, numpy_backend)
            for label, cell in times.items():
                results[name][label][f"b{batch}"] = cell
        for label, row in results[name].items():
            print(name, label, json.dumps(row), flush=True)
    return results


def _side_by_side(name: str, files: dict[str, str], batch: int, runs: int,
                  numpy_backend: bool) -> dict[str, dict[str, float]]:
    """Median ms per file and engine over at least ``runs`` runs, the engines and files
    taking turns in rested blocks (so a burst of load hits them all alike, and no engine
    runs while another's threads still spin)."""
    feed = make_inputs(name, batch=batch, seed=7)
    calls: dict[tuple[str, str], object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for label, path in files.items():
            kt = kiln.InferenceSession(path, backend="torch")
            calls[label, "kiln_torch_ms"] = lambda s=kt: s.run(None, feed)
            if numpy_backend:
                kn = kiln.InferenceSession(path)
                calls[label, "kiln_numpy_ms"] = lambda s=kn: s.run(None, feed)
            o = _ort_session(path)
            calls[label, "onnxruntime_ms"] = lambda s=o: s.run(None, feed)
    times = measure({k: (lambda _feed, fn=fn: fn()) for k, fn in calls.items()}, feed,
                    budget_s=2.0, min_runs=runs, max_runs=max(runs, 40), rest_s=0.2)
    out: dict[str, dict[str, float]] = {}
    for (label, engine), t in times.items():
        out.setdefault(label, {"kiln_numpy_ms": float("nan")})[engine] = statistics.median(t)
    return out


def kernels(runs: int) -> str:
    """fbgemm's int8 3x3 convolution (as Kiln's QConv calls it: wrap, convolve, take the
    integer representation) against torch's float32 one on the same shapes, ResNet-18's
    four stages, taking turns; a markdown table of best-of-``runs`` ms."""
    import torch.nn.functional as F

    rows = ["| channels x size | batch | fp32 conv ms | fbgemm int8 conv ms | fp32 / int8 |",
            "|---|---|---|---|---|"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for c, hw in [(64, 56), (128, 28), (256, 14), (512, 7)]:
            w8 = torch.randint(-63, 64, (c, c, 3, 3), dtype=torch.int8)
            qw = torch._make_per_channel_quantized_tensor(
                w8, torch.rand(c, dtype=torch.float64) * 0.01,
                torch.zeros(c, dtype=torch.int64), 0)
            packed = torch.ops.quantized.conv2d_prepack(qw, torch.randn(c), [1, 1], [1, 1],
                                                        [1, 1], 1)
            wf = torch.randn(c, c, 3, 3)
            for batch in (1, 8):
                xu = torch.randint(0, 256, (batch, c, hw, hw), dtype=torch.uint8).contiguous(
                    memory_format=torch.channels_last)
                xf = torch.randn(batch, c, hw, hw)

                def q(xu=xu, packed=packed):
                    qx = torch._make_per_tensor_quantized_tensor(xu, 0.02, 10)
                    return torch.ops.quantized.conv2d(qx, packed, 0.05, 3).int_repr()

                def f(xf=xf, wf=wf):
                    return F.conv2d(xf, wf, padding=1)
                best = {"f": float("inf"), "q": float("inf")}
                f(), q()
                for _ in range(runs):
                    for key, fn in (("f", f), ("q", q)):
                        t0 = time.perf_counter()
                        fn()
                        best[key] = min(best[key], time.perf_counter() - t0)
                rows.append(f"| {c} x {hw}x{hw} | {batch} | {best['f'] * 1e3:.2f} | "
                            f"{best['q'] * 1e3:.2f} | {best['f'] / best['q']:.2f}x |")
    return "\n".join(rows)


def markdown(results: dict) -> str:
    """The results as one table per model."""
    out = []
    for name, rows in results.items():
        out.append(f"\n### {name}\n")
        out.append("| file | size MB | rel. error | top-1 agr. | Kiln torch b1 / b8 ms | "
                   "Kiln numpy b1 / b8 ms | onnxruntime b1 / b8 ms |")
        out.append("|---|---|---|---|---|---|---|")
        for label, r in rows.items():
            cells = [f"{r['b1'][k]:.1f} / {r['b8'][k]:.1f}"
                     for k in ("kiln_torch_ms", "kiln_numpy_ms", "onnxruntime_ms")]
            out.append(f"| {label} | {r['size_mb']:.1f} | {r['rel_error']:.2%} | "
                       f"{r['top1_agreement']:.1%} | " + " | ".join(cells) + " |")
        out.append("\n| file | Kiln torch: fp32 time / this file's, b1 / b8 | onnxruntime "
                   "on this file / Kiln torch on it, b1 / b8 |")
        out.append("|---|---|---|")
        for label, r in rows.items():
            if label == "fp32":
                continue
            vs_fp32 = [rows["fp32"][b]["kiln_torch_ms"] / r[b]["kiln_torch_ms"]
                       for b in ("b1", "b8")]
            vs_ort = [r[b]["onnxruntime_ms"] / r[b]["kiln_torch_ms"] for b in ("b1", "b8")]
            out.append(f"| {label} | {vs_fp32[0]:.2f}x / {vs_fp32[1]:.2f}x | "
                       f"{vs_ort[0]:.2f}x / {vs_ort[1]:.2f}x |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["resnet18", "mobilenetv2", "bert"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--variants", nargs="+", default=None,
                    help="only these files (fp32 fp16 int8-dynamic int8-static "
                         "int4-weight-only ort-int8-dynamic ort-int8-static)")
    ap.add_argument("--no-numpy", action="store_true", help="skip Kiln's NumPy backend")
    ap.add_argument("--kernels", action="store_true",
                    help="only compare fbgemm's int8 convolution with torch's fp32 one")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.kernels:
        print(kernels(args.runs))
        return
    results = run(args.models, args.runs, args.variants, not args.no_numpy)
    meta = {"date": time.strftime("%Y-%m-%d"), "python": platform.python_version(),
            "torch": torch.__version__, "onnxruntime": ort.__version__,
            "threads": torch.get_num_threads(), "runs": args.runs}
    print(markdown(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
