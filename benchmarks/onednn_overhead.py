"""Where a small layer's time goes on the torch backend: oneDNN's kernel or PyTorch's call.

    python benchmarks/onednn_overhead.py [--threads 2]

For layer shapes from the zoo's small models at batch 1 (MobileNetV2 and ShuffleNetV2
convolutions, BERT's linear layers at sequence 16), the ops Kiln calls (fp32
``mkldnn._convolution_pointwise`` / ``_linear_pointwise`` with weights packed once, int8
``onednn.qconv2d_pointwise`` / ``qlinear_pointwise``) are timed per call in this process.
A child process runs the same calls under ``ONEDNN_VERBOSE=1``, which prints the time
oneDNN's primitive itself took; the rest of a call is PyTorch preparing it (argument
checks, descriptors, memory objects, the output), which no choice of Kiln's avoids. Both
processes keep freed memory as a Kiln session does (``kiln.runtime.memory``), so that an
output's fresh pages are not counted as the call's cost.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch

from kiln.runtime.memory import keep_freed_memory

# (name, in channels, out channels, size, kernel, groups)
CONVS = [
    ("mobilenetv2 depthwise 96@56", 96, 96, 56, 3, 96),
    ("mobilenetv2 depthwise 576@14", 576, 576, 14, 3, 576),
    ("mobilenetv2 pointwise 96->24@56", 96, 24, 56, 1, 1),
    ("shufflenetv2 pointwise 116@14", 116, 116, 14, 1, 1),
    ("shufflenetv2 pointwise 232@7", 232, 232, 7, 1, 1),
]
LINEARS = [("bert 16x256 -> 256", 16, 256, 256), ("bert 16x256 -> 1024", 16, 256, 1024)]


def _calls() -> list[tuple[str, str, object]]:
    """(layer, kind, zero-argument call) for every layer and both precisions."""
    torch.manual_seed(0)
    out = []
    for name, ci, co, s, k, g in CONVS:
        pad, one = [k // 2] * 2, [1, 1]
        x = torch.randn(1, ci, s, s).contiguous(memory_format=torch.channels_last)
        w = torch.randn(co, ci // g, k, k)
        b = torch.randn(co)
        pw = torch.ops.mkldnn._reorder_convolution_weight(
            w.contiguous(memory_format=torch.channels_last), pad, one, one, g, list(x.shape))
        out.append((name, "fp32", lambda x=x, pw=pw, b=b, pad=pad, g=g:
                    torch.ops.mkldnn._convolution_pointwise(x, pw, b, pad, [1, 1], [1, 1], g,
                                                            "none", [], "")))
        xq = torch.randint(0, 256, x.shape, dtype=torch.uint8).contiguous(
            memory_format=torch.channels_last)
        wq = torch.randint(-63, 64, w.shape, dtype=torch.int8)
        ws = torch.rand(co) * 0.01
        pq = torch.ops.onednn.qconv_prepack(wq, ws, 0.05, 128, one, pad, one, g, None)
        zeros = torch.zeros(co, dtype=torch.int64)
        out.append((name, "int8", lambda xq=xq, pq=pq, ws=ws, zeros=zeros, b=b, pad=pad, g=g:
                    torch.ops.onednn.qconv2d_pointwise(
                        xq, 0.05, 128, pq, ws, zeros, b, [1, 1], pad, [1, 1], g, 0.07, 120,
                        torch.uint8, "none", [], "")))
    for name, m, k, n in LINEARS:
        x, w, b = torch.randn(m, k), torch.randn(n, k), torch.randn(n)
        pw = torch.ops.mkldnn._reorder_linear_weight(w)
        out.append((name, "fp32", lambda x=x, pw=pw, b=b:
                    torch.ops.mkldnn._linear_pointwise(x, pw, b, "none", [], "")))
        xq = torch.randint(0, 256, (m, k), dtype=torch.uint8)
        pq = torch.ops.onednn.qlinear_prepack(torch.randint(-63, 64, (n, k), dtype=torch.int8),
                                              None)
        ws, zeros = torch.rand(n) * 0.01, torch.zeros(n, dtype=torch.int32)
        out.append((name, "int8", lambda xq=xq, pq=pq, ws=ws, zeros=zeros, b=b:
                    torch.ops.onednn.qlinear_pointwise(xq, 0.05, 128, pq, ws, zeros, b, 0.07,
                                                       120, torch.uint8, "none", [], "")))
    return out


def _child(threads: int) -> None:
    """Run each call a few times under ONEDNN_VERBOSE (set by the parent); the parent
    reads the primitive times from stdout, separated by marker lines."""
    torch.set_num_threads(threads)
    with torch.inference_mode():
        for name, kind, call in _calls():
            for _ in range(20):
                call()
            print(f"@@ {name}|{kind}", flush=True)
            for _ in range(40):
                call()
            print("@@ end", flush=True)


def _primitive_times(threads: int) -> dict[tuple[str, str], float]:
    env = dict(os.environ, ONEDNN_VERBOSE="1")
    text = subprocess.run([sys.executable, __file__, "--child", "--threads", str(threads)],
                          env=env, capture_output=True, text=True, check=True).stdout
    times: dict[tuple[str, str], float] = {}
    key, sums = None, []
    for line in text.splitlines():
        if line.startswith("@@ "):
            if key is not None and sums:
                times[key] = min(sums) * 1e3  # verbose prints ms; its own printing slows some
            key = None if line == "@@ end" else tuple(line[3:].split("|"))
            sums = []
        elif key is not None and ",exec," in line and ",reorder," not in line:
            sums.append(float(line.rsplit(",", 1)[1]))
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    keep_freed_memory()
    if args.child:
        _child(args.threads)
        return
    prim = _primitive_times(args.threads)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; microseconds per call")
    print(f"{'layer':34s} {'kind':5s} {'call':>7s} {'oneDNN':>7s} {'PyTorch':>8s}")
    with torch.inference_mode():
        for name, kind, call in _calls():
            for _ in range(200):
                call()
            best = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(300):
                    call()
                best.append((time.perf_counter() - t) / 300 * 1e6)
            total, kernel = min(best), prim.get((name, kind), float("nan"))
            print(f"{name:34s} {kind:5s} {total:7.1f} {kernel:7.1f} {total - kernel:8.1f}")


if __name__ == "__main__":
    main()
