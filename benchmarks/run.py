"""The benchmark suite's one entry point: names each benchmark and runs it with your arguments.

    python benchmarks/run.py                  # list the benchmarks
    python benchmarks/run.py zoo --models resnet18,bert --batches 1
    python benchmarks/run.py layers --nodes 500 --threads 1

Each benchmark is a script in this folder; ``run.py NAME ARGS...`` runs it with ARGS
(``run.py NAME --help`` shows them). What the figures are and the latest ones:
docs/performance.md.
"""

from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# name -> (script, what it measures). Every one compares against an anchor in one process.
SUITE: dict[str, tuple[str, str]] = {
    "zoo": ("zoo_suite.py", "every zoo model on every engine: latency, throughput, peak memory"),
    "real-models": ("real_models.py", "trained models shipped in pip packages"),
    "real-models-int8": ("real_models_int8.py", "the same: Kiln's and ORT's INT8 files vs fp32"),
    "real-model-layers": ("real_model_layers.py",
                          "the same at batch 1: Kiln's and ORT's per-layer profiles by kind"),
    "time-by-op": ("time_by_op.py", "where a zoo model's time goes, by kind of layer"),
    "layers": ("layer_overhead.py", "per-layer overhead on a chain of small nodes"),
    "sessions": ("session_overhead.py", "session creation time and memory (--zoo)"),
    "big-graph": ("big_graph.py", "load/optimize/session time of a 200k-node chain"),
    "training": ("training.py", "kiln.to_torch training steps against the PyTorch module"),
    "training-compiled": ("training_compiled.py", "compiled training step vs the compiled module"),
    "onnx2torch": ("onnx2torch_compare.py", "kiln.to_torch against onnx2torch"),
    "quantization": ("quantization.py", "fp16/int8/int4 files: size, error, latency"),
    "tune": ("tune.py", "kiln tune's winner vs onnxruntime fp32 and its own int8 file"),
    "quant-trained": ("quantization_trained.py", "INT8/fp16/bf16 on trained models vs ORT's tool"),
    "quant-minilm": ("quantization_minilm.py", "static vs dynamic INT8 on a trained MiniLM (DIR)"),
    "validation": ("validation_cost.py", "what load-time validation costs of session creation"),
    "preprocess": ("preprocess_fold.py", "what embedded preprocessing costs at run time"),
    "serving": ("serving.py", "kiln serve: overhead over HTTP/gRPC, batching throughput"),
    "serving-path": ("serving_path.py",
                     "kiln serve's HTTP app per infer request, against Starlette's, no sockets"),
    "ray": ("ray_batch.py", "rows per second of `kiln batch` on Ray Data"),
    "torch-overrides": ("torch_overrides.py", "does each torch kernel beat the generic one"),
    "hops": ("run_hops.py", "the Python frames from Session.run to a kernel"),
    "gpu": ("gpu_run.sh", "everything on a CUDA machine: check|quick|speed|accuracy"),
    "gpu-speed": ("gpu_speed.py", "on CUDA: Kiln against the PyTorch module (gpu_run.sh speed)"),
    "gpu-accuracy": ("gpu_accuracy.py", "on CUDA: each zoo model's error per precision"),
}


def available() -> dict[str, tuple[str, str]]:
    """The benchmarks whose script is present in this checkout."""
    return {k: v for k, v in SUITE.items() if os.path.exists(os.path.join(HERE, v[0]))}


def main(argv: list[str]) -> int:
    suite = available()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__.strip().splitlines()[0] + "\n")
        for name, (script, what) in suite.items():
            print(f"  {name:<16} {what}  ({script})")
        return 0
    name, args = argv[0], argv[1:]
    if name not in suite:
        print(f"no benchmark named {name!r}; choose one of: {', '.join(suite)}",
              file=sys.stderr)
        return 2
    script = os.path.join(HERE, suite[name][0])
    cmd = ["bash", script] if script.endswith(".sh") else [sys.executable, script]
    return subprocess.call(cmd + args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
