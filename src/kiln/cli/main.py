"""The ``kiln`` command: inspect, optimize, cut, edit, run, profile, bench, report, zoo.

Exit codes: 0 success, 1 failure (the model or an input is the problem: the message says
what to do), 2 usage error.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.errors import InputError, KilnError, OptionError
from kiln.quantize.engines import engines, integer_engines
from kiln.runtime.backends import backend_names, reference_backend_name
from kiln.runtime.run_settings import default_backend_name

USAGE_ERROR = 2


class UsageError(Exception):
    """A problem with the command line itself (exit code 2)."""


# -- argument types ---------------------------------------------------------------------

def _dim(text: str) -> tuple[str, int]:
    name, sep, val = text.partition("=")
    try:
        n = int(val)
    except ValueError:
        n = -1
    if not sep or not name or n < 0:
        raise argparse.ArgumentTypeError(f"expected NAME=N with N >= 0, got {text!r}")
    return name, n


def _smooth_alpha(text: str) -> float | str | None:
    if text in ("auto", "off"):
        return None if text == "off" else text
    try:
        alpha = float(text)
    except ValueError:
        alpha = -1.0
    if not 0 <= alpha <= 1:
        raise argparse.ArgumentTypeError(f"expected auto, off or a strength in 0..1, got "
                                         f"{text!r}")
    return alpha


def _input_shape(text: str) -> tuple[str, list[int | str | None]]:
    name, sep, val = text.partition("=")
    if not sep or not name or not val:
        raise argparse.ArgumentTypeError(f"expected NAME=D1,D2,... got {text!r}")
    dims: list[int | str | None] = []
    for d in val.split(","):
        d = d.strip()
        if d.lstrip("-").isdigit():
            if int(d) < 0:
                raise argparse.ArgumentTypeError(f"negative dim in {text!r}")
            dims.append(int(d))
        elif d in ("", "?"):
            dims.append(None)
        else:
            dims.append(d)
    return name, dims


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _count(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return n


def _per_input(text: str) -> tuple[str | None, str]:
    """``NAME=VALUE`` or a bare ``VALUE`` (for a model with one input)."""
    name, sep, val = text.partition("=")
    if not sep:
        return None, text
    if not name or not val:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE or VALUE, got {text!r}")
    return name, val


def _numbers(text: str) -> list[float]:
    try:
        return [float(x) for x in text.strip().strip("[]").split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"expected numbers like [123.7,116.3,103.5], got {text!r}") from None


# -- shared option groups -----------------------------------------------------------------

def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help="an .onnx file, or the name of a zoo model (`kiln zoo list`; built "
                        "on first use)")


def _default_words() -> str:
    """The default backend in words, from the registry (without importing a backend's
    dependency, which would slow every command's start)."""
    top, ref = default_backend_name(usable_only=False), reference_backend_name()
    return ref if top == ref else f"{top} when installed, else {ref}"


def _add_backend(p: argparse.ArgumentParser, runs: bool = True, tuned: bool = False) -> None:
    default = _default_words()
    if tuned:  # a file `kiln tune` wrote stores its backend and options
        backend_help = "backend to run on (default: the one `kiln tune` stored in the " \
                       f"file with its options, else {default}; options given here win)"
        device_help = "torch device: cpu, cuda or cuda:N (default: cpu)"
    elif runs:
        backend_help = f"backend to run on (default: {default})"
        device_help = "torch device: cpu, cuda or cuda:N (default: cpu)"
    else:  # inspect runs nothing: the backend only decides what the report says
        backend_help = ("whose kernels to describe: which layers it supports and where it "
                        "would place them, and with --optimize the fusions it gets; "
                        f"nothing is run (default: {default})")
        device_help = "torch device to describe placement for: cpu, cuda or cuda:N " \
                      "(default: cpu)"
    p.add_argument("--backend", choices=backend_names(), default=None, help=backend_help)
    p.add_argument("--device", default=None, help=device_help)


def _add_torch_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default=None,
                   help="torch backend: compute products and convolutions in this type, fp32 "
                        "in and out (tf32: CUDA only; depthwise convolutions stay fp32 on "
                        "the CPU; default fp32)")
    p.add_argument("--compile", action="store_true",
                   help="torch backend: run one compiled program per input shape (CUDA "
                        "graphs on a GPU); the first run compiles, for seconds")


def _add_dims(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dim", type=_dim, action="append", default=[], metavar="NAME=N",
                   help="size of a symbolic dim such as batch or seq (repeatable; "
                        "unset symbolic dims are 1)")


def _add_inputs(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE",
                   help="an input from .npy, .pb (TensorProto) or .npz (repeatable); a bare "
                        "FILE.npz feeds the inputs named by its keys")
    _add_dims(p)
    p.add_argument("--seed", type=int, default=0, help="seed of random inputs (default 0)")


def _add_no_optimize(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-optimize", action="store_true",
                   help="run the model as it is, without Kiln's optimizer")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kiln", description="Kiln: import ONNX models, optimize them and run them.",
        epilog="Run `kiln COMMAND --help` for a command's options. Exit codes: 0 ok, "
               "1 failure, 2 usage error.")
    from kiln import __version__
    ap.add_argument("--version", action="version", version=f"kiln {__version__}")
    ap.add_argument("--debug", action="store_true",
                    help="print the full traceback when a command fails (anywhere on the line)")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("inspect", help="what a model is made of: I/O, layers, ops, "
                       "parameters, FLOPs, backend support",
                       description="Describe a model without running it.")
    _add_model(p)
    _add_backend(p, runs=False)
    _add_dims(p)
    p.add_argument("--optimize", action="store_true",
                   help="describe the model as a session runs it, after Kiln's optimizer")
    p.add_argument("--no-layers", action="store_true", help="leave out the per-layer table")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect, parser=p)

    p = sub.add_parser("optimize", help="write the optimized model and say what changed",
                       description="Optimize a model with Kiln's passes and save it.")
    _add_model(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="optimized .onnx")
    p.add_argument("--input-shape", type=_input_shape, action="append", default=[],
                   metavar="NAME=D1,D2,...",
                   help="fix an input's shape, e.g. x=1,3,224,224 (repeatable; a name keeps "
                        "a dim symbolic, ? leaves it unknown)")
    p.add_argument("--disable", action="append", default=[], metavar="PASS",
                   help="skip a pass by name (repeatable; `--disable help` lists them)")
    p.add_argument("--level", choices=["0", "1", "2"], default=None,
                   help="0: only --input-shape, 1: standard ONNX rewrites, "
                        "2: also Kiln's fused ops (default)")
    p.add_argument("--no-optimize", action="store_true",
                   help="run no pass; only apply --input-shape (same as --level 0)")
    pre = p.add_argument_group(
        "embedded preprocessing", "done inside the model, in this order: input type, layout, "
        "resize, channel reversal, mean, scale; constant steps fold into a first Conv "
        "(docs/surgery.md). NAME= may be left out for a model with one input")
    pre.add_argument("--input-type", type=_per_input, action="append", default=[],
                     metavar="[NAME=]TYPE", help="the type the input takes, e.g. x=uint8")
    pre.add_argument("--layout", type=_per_input, action="append", default=[],
                     metavar="[NAME=]LAYOUT", help="the layout the input takes: NCHW or NHWC")
    pre.add_argument("--mean-values", type=_per_input, action="append", default=[],
                     metavar="[NAME=][M,...]",
                     help="per-channel mean subtracted, e.g. x=[123.7,116.3,103.5]")
    pre.add_argument("--scale-values", type=_per_input, action="append", default=[],
                     metavar="[NAME=][S,...]",
                     help="per-channel divisor applied after the mean, e.g. x=[58.4,57.1,57.4]")
    pre.add_argument("--reverse-input-channels", action="store_true",
                     help="reverse the channels (BGR <-> RGB) of every 3-channel image input")
    pre.add_argument("--resize", type=_per_input, action="append", default=[],
                     metavar="[NAME=]MODE", help="take images of any size and resize them "
                     "to the model's: linear or nearest")
    p.set_defaults(func=cmd_optimize, parser=p)

    p = sub.add_parser("cut", help="keep the part of a model between new inputs and outputs",
                       description="Cut a model at new inputs and outputs (tensor or layer "
                                   "names), or drop its last layers; save the part.")
    _add_model(p)
    p.add_argument("-o", "--output-file", "--out", dest="out", required=True, metavar="OUT",
                   help="the .onnx to write")
    p.add_argument("--input", action="append", default=[], metavar="NAME[:SHAPE]",
                   help="a new input: a tensor, or a layer (its inputs); SHAPE like "
                        "1x3x224x224 or batch,3,224,224 (default: inferred). Repeatable")
    p.add_argument("--output", action="append", default=[], metavar="NAME",
                   help="a new output: a tensor, or a layer (its outputs). Repeatable")
    p.add_argument("--last-layers", type=int, default=None, metavar="K",
                   help="SINGA's last_layers: -K drops the last K layers")
    p.set_defaults(func=cmd_cut, parser=p)

    p = sub.add_parser("edit", help="rename inputs/outputs, add a Softmax/ArgMax/TopK tail, "
                       "set the batch dim, append another model",
                       description="Edit a model's interface and save it.")
    _add_model(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="the .onnx to write")
    p.add_argument("--append", metavar="MODEL2",
                   help="run MODEL2 after the model (kiln.compose); connect with --io-map")
    p.add_argument("--io-map", action="append", default=[], metavar="OUT=IN",
                   help="the model's output OUT feeds MODEL2's input IN (repeatable)")
    p.add_argument("--tail", choices=["softmax", "argmax", "topk"], default=None,
                   help="apply this op to the (only) output along the last axis")
    p.add_argument("--k", type=_positive, default=1, help="k of --tail topk (default 1)")
    p.add_argument("--batch", default=None, metavar="N|NAME",
                   help="first dim of every input: a number, or a name for a symbolic dim")
    p.add_argument("--rename", action="append", default=[], metavar="OLD=NEW",
                   help="rename an input or output (repeatable; done last)")
    p.set_defaults(func=cmd_edit, parser=p)

    p = sub.add_parser("run", help="run a model once and summarize its outputs",
                       description="Run a model once on given or random inputs.")
    _add_model(p)
    _add_inputs(p)
    p.add_argument("--random", action="store_true",
                   help="random inputs of the declared shapes for inputs not given")
    p.add_argument("--output", metavar="OUT.npz", help="save every output to an .npz")
    _add_backend(p, tuned=True)
    _add_torch_options(p)
    _add_no_optimize(p)
    p.add_argument("--json", action="store_true", help="machine-readable summary")
    p.set_defaults(func=cmd_run, parser=p)

    p = sub.add_parser("profile", help="time every layer; totals by op type; Chrome trace",
                       description="Profile a model layer by layer (random inputs unless "
                                   "--input is given).")
    _add_model(p)
    _add_backend(p)
    p.add_argument("--runs", type=_positive, default=10, help="measured runs (default 10)")
    p.add_argument("--warmup", type=_count, default=1, help="unmeasured runs first (default 1)")
    p.add_argument("--trace", metavar="TRACE.json",
                   help="write a Chrome trace (chrome://tracing, ui.perfetto.dev)")
    p.add_argument("--top", type=_count, default=0,
                   help="show only the N slowest layers (default: all, in run order)")
    _add_inputs(p)
    _add_no_optimize(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_profile, parser=p)

    p = sub.add_parser("bench", help="latency percentiles and throughput, optionally vs "
                       "onnxruntime", description="Benchmark a model (random inputs unless "
                                                  "--input is given).")
    _add_model(p)
    _add_backend(p)
    _add_torch_options(p)
    p.add_argument("--vs", choices=["onnxruntime"], default=None,
                   help="also time onnxruntime, alternating runs in this process")
    p.add_argument("--batch", type=_positive, default=None,
                   help="batch size for random inputs (sets a symbolic first dim)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="threads for Kiln and onnxruntime alike (default: all cores)")
    p.add_argument("--runs", type=_positive, default=50, help="measured runs (default 50)")
    p.add_argument("--warmup", type=_count, default=5, help="unmeasured runs (default 5)")
    _add_inputs(p)
    _add_no_optimize(p)
    p.add_argument("-q", "--quiet", action="store_true",
                   help="no progress bar (it is drawn only when stderr is a terminal)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_bench, parser=p)

    p = sub.add_parser("report", help="a self-contained HTML page: the graph, time by op, "
                       "the summary", description="Write an HTML report of a model.")
    _add_model(p)
    p.add_argument("-o", "--output", required=True, metavar="REPORT.html",
                   help="the HTML file to write (one self-contained page, no network needed)")
    p.add_argument("--profile", action="store_true",
                   help="run the model and color each layer by its share of the time")
    p.add_argument("--runs", type=_positive, default=5, help="profiled runs (default 5)")
    _add_backend(p)
    _add_inputs(p)
    _add_no_optimize(p)
    p.set_defaults(func=cmd_report, parser=p)

    p = sub.add_parser("convert", help="write the model in half precision (float16 or "
                       "bfloat16)", description="Convert weights and compute to float16 "
                       "(or bfloat16); inputs and outputs stay float32 unless --half-io.")
    _add_model(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="converted .onnx")
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument("--fp16", action="store_true", help="float16 weights and compute")
    kind.add_argument("--bf16", action="store_true", help="bfloat16 weights and compute")
    p.add_argument("--block", action="append", default=[], metavar="OP_OR_LAYER",
                   help="an op type or layer name to keep in float32 (repeatable)")
    p.add_argument("--half-io", action="store_true",
                   help="make float32 inputs and outputs half too (no Casts at the boundary)")
    p.add_argument("--calibration", metavar="DATA.npz",
                   help="inputs to run the float32 model on: layers meeting values beyond "
                        "float16's range stay float32, and the converted model is measured "
                        "against float32 on them (a warning gives the figures)")
    p.add_argument("--accuracy-budget", metavar="rel=R,top1=F",
                   help="with --calibration: keep in float32 the layers whose half-precision "
                        "error breaks this budget, the worst first")
    p.set_defaults(func=cmd_convert, parser=p)

    p = sub.add_parser("batch", help="score parquet/.npz files on a Ray cluster, write "
                       "parquet", description="Batch inference with Ray Data: one Kiln "
                       "session per actor, columns named like the model's inputs (a single "
                       "input takes a .npy); outputs become columns, other columns pass "
                       "through. Needs the ray extra.")
    _add_model(p)
    p.add_argument("--input", action="append", required=True, metavar="GLOB",
                   help="files to score, e.g. 'data/*.parquet' (repeatable; quote the glob)")
    p.add_argument("--output", required=True, metavar="DIR",
                   help="new or empty folder for the parquet output")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join ('auto' finds a running one; default: start a "
                        "local one)")
    p.add_argument("--concurrency", type=_positive, default=1, help="actors (default 1)")
    p.add_argument("--batch-size", type=_positive, default=256,
                   help="rows per batch (default 256)")
    p.add_argument("--threads", type=_positive, default=1,
                   help="CPUs Ray reserves per actor, used as its threads (default 1)")
    p.add_argument("--gpus", type=float, default=0,
                   help="GPUs per actor (with --backend torch; default 0)")
    _add_backend(p)
    _add_no_optimize(p)
    p.set_defaults(func=cmd_batch, parser=p)

    p = sub.add_parser("serve", help="serve models over the Open Inference Protocol "
                       "(KServe v2): HTTP and gRPC, dynamic batching",
                       description="Serve ONNX models to any KServe v2 / Triton client "
                       "until SIGTERM or Ctrl-C (requests in flight finish). A file is "
                       "served under its file stem; a repository folder holds "
                       "name/VERSION/model.onnx with an optional name/config.json. Needs "
                       "the serve extra. Docs: docs/serving.md.")
    p.add_argument("models", nargs="*", metavar="MODEL",
                   help=".onnx files to serve (or zoo model names), each under its file "
                        "stem (a model.onnx under its folder's name)")
    p.add_argument("--model-repository", metavar="DIR", default=None,
                   help="folder of models in Triton's layout (name/1/model.onnx)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--http-port", type=int, default=8000, help="HTTP port (default 8000; "
                   "0 picks a free one)")
    p.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001; "
                   "0 picks a free one)")
    p.add_argument("--allow-grpc", choices=["true", "false"], default="true",
                   help="serve gRPC too (default true)")
    p.add_argument("--max-batch-size", type=int, default=32,
                   help="rows one run merges from concurrent requests (default 32; 0 or 1: "
                        "no batching)")
    p.add_argument("--max-queue-delay-microseconds", type=int, default=0,
                   help="how long a request waits for others to batch with (default 0: "
                        "only requests already queued are merged)")
    p.add_argument("--max-queue-size", type=_positive, default=256,
                   help="requests queued per model before 503 / UNAVAILABLE (default 256)")
    p.add_argument("--max-request-size", type=_positive, default=64 << 20, metavar="BYTES",
                   help="largest request accepted (default 64 MiB)")
    p.add_argument("--threads", type=_positive, default=None, help="threads per model run")
    p.add_argument("--token-env", default="KILN_SERVE_TOKEN", metavar="VAR",
                   help="environment variable holding a bearer token every request but "
                        "health checks must carry (default KILN_SERVE_TOKEN; unset: none)")
    _add_backend(p)
    p.add_argument("--precision", choices=["fp32", "tf32", "bf16", "fp16"], default=None,
                   help="torch backend: compute precision")
    p.set_defaults(func=cmd_serve, parser=p)

    p = sub.add_parser("quantize", help="write an INT8 (or weight-only INT4) model in "
                       "standard QDQ format, with a report of what it cost",
                       description="Quantize a model: static INT8 (calibrated), dynamic "
                       "INT8, or weight-only INT4/INT8; prints size, error, top-1 "
                       "agreement and latency before/after.")
    _add_model(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="quantized .onnx")
    p.add_argument("--mode", choices=["static", "dynamic", "weight-only"], default="static",
                   help="static: int8 weights and activations (needs --calibration); "
                        "dynamic: activation scales at run time; weight-only: MatMul/Gemm "
                        "weights int4/int8 in blocks (default: static)")
    p.add_argument("--calibration", metavar="DATA.npz",
                   help="calibration inputs: an .npz whose keys are the model's inputs")
    p.add_argument("--validation", metavar="DATA.npz",
                   help="data the report (and --accuracy-budget) checks on "
                        "(default: the calibration data)")
    p.add_argument("--method", choices=["minmax", "percentile", "entropy", "auto"],
                   default="minmax", help="how calibration picks each range (default: "
                   "minmax; auto: per tensor, the least noisy for the layers reading it)")
    p.add_argument("--max-noise", type=float, default=None,
                   help="keep in float each layer whose measured noise ratio exceeds this "
                        "(e.g. 0.02; docs/quantization.md)")
    p.add_argument("--smooth-alpha", type=_smooth_alpha, default="auto",
                   metavar="auto|off|A",
                   help="static: SmoothQuant migration of activation outliers into the "
                        "weights at strength A (0..1); auto (default): on a transformer-"
                        "like model the one of none, 0.5 and 0.8 with the least measured "
                        "output error, elsewhere off")
    p.add_argument("--bias-correction", action=argparse.BooleanOptionalAction, default=True,
                   help="static: take each quantized Conv/Gemm's measured mean output shift "
                        "out of its bias (default: on)")
    p.add_argument("--per-tensor", action="store_true",
                   help="one weight scale per tensor instead of per output channel")
    p.add_argument("--symmetric", action="store_true",
                   help="int8 activations around 0 instead of uint8 with a zero point")
    p.add_argument("--exclude", action="append", default=[], metavar="OP_OR_LAYER",
                   help="an op type or layer name to keep in float (repeatable)")
    p.add_argument("--reduce-range", choices=["auto", "on", "off"], default="auto",
                   help="7-bit weights (on) for x86 CPUs without VNNI, full 8-bit (off); "
                        "auto: what this machine's CPU needs (default)")
    p.add_argument("--bits", type=int, choices=[4, 8], default=4,
                   help="weight-only: bits per weight (default: 4)")
    p.add_argument("--block-size", type=int, choices=[32, 64, 128], default=128,
                   help="weight-only: weights per scale along the reduction axis")
    p.add_argument("--accuracy-budget", metavar="rel=R,top1=F",
                   help="try 8-bit weights, per-channel weights and other calibration, then "
                        "revert the most sensitive layers to float, until the error holds: "
                        "rel=0.01 (max relative output error), top1=0.995 (top-1 agreement "
                        "with the float model)")
    p.add_argument("--budget-seconds", type=float, default=600.0, metavar="S",
                   help="stop the accuracy-budget search after S seconds with the closest "
                        "model found (default: 600)")
    p.add_argument("--backend", choices=engines(), default=None,
                   help="engine that calibrates and on which the report, the accuracy budget "
                        "and --speed-aware measure (the one the file will run on; default: "
                        f"{default_backend_name()}, a default session's)")
    p.add_argument("--speed-aware", action=argparse.BooleanOptionalAction, default=None,
                   help="time each quantized layer alone, float and quantized, on --backend "
                        "and keep in float those not measured faster (default: on where "
                        "there is data to time on; --no-speed-aware quantizes for size)")
    p.set_defaults(func=cmd_quantize, parser=p)

    p = sub.add_parser("tune", help="measure the ways to run a model here and write the "
                       "fastest within an accuracy budget, with its run settings",
                       description="Measure the candidates that apply on this machine "
                       "(backend, eager or compiled, fp32/bf16, INT8 dynamic/static, threads) "
                       "side by side in alternating rounds, check each one's accuracy on "
                       "--data against the fp32 model, and write the fastest within the "
                       "budget as a standard ONNX file whose metadata holds its run settings "
                       "(kiln.InferenceSession and `kiln run` pick them up).")
    _add_model(p)
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="tuned .onnx")
    p.add_argument("--data", metavar="DATA.npz|DIR",
                   help="inputs to check accuracy (and calibrate INT8) on: an .npz whose keys "
                        "are the model's inputs, or a folder of them; without it only exact "
                        "transformations are tried (backend, compile, threads)")
    p.add_argument("--budget", metavar="top1=F|rel=R",
                   help="accuracy the winner must keep against the fp32 model: top1=0.99 "
                        "(top-1 agreement) or rel=0.01 (max relative output error); default "
                        "top1=0.99 for a model with score outputs, else rel=0.01")
    p.add_argument("--batch", type=int, default=1, help="rows per timed run (default 1)")
    p.add_argument("--time-budget", type=float, default=600.0, metavar="S",
                   help="seconds for the whole search (default 600)")
    p.add_argument("--json", action="store_true", help="machine-readable report")
    p.set_defaults(func=cmd_tune, parser=p)

    sub.add_parser("zoo", help="the offline model zoo (kiln zoo --help)", add_help=False)
    return ap


# -- helpers ------------------------------------------------------------------------------

def _dims(args) -> dict[str, int]:
    return dict(args.dim)


def _feeds(args, model, random_rest: bool):
    """Feeds from --input, the others random when ``random_rest``; None = all random."""
    from kiln.tools.common import feeds_from_specs, random_feeds

    if not args.input:
        return None if random_rest else {}
    feeds = feeds_from_specs(model, args.input)
    missing = [v.name for v in model.graph.inputs if v.name not in feeds]
    if missing and random_rest:
        rnd = random_feeds(model, _dims(args), args.seed)
        feeds.update({k: rnd[k] for k in missing})
    return feeds


def _emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


# -- commands -----------------------------------------------------------------------------

def cmd_inspect(args) -> int:
    from kiln.cli.format import summary_text
    from kiln.tools import inspect
    from kiln.tools.common import load_model

    model: Any = args.model
    backend = args.backend or default_backend_name()
    if args.optimize:
        from kiln.optimizer import optimize
        model = optimize(load_model(model), backend=backend)
    s = inspect(model, backend=backend, device=args.device, dims=_dims(args))
    if args.optimize:
        s.name = f"{Path(args.model).name} (optimized)"
    if args.json:
        _emit_json(s.to_dict())
    else:
        print(summary_text(s, layers=not args.no_layers))
    return 0


def cmd_optimize(args) -> int:
    from kiln import optimizer as kopt

    names = list(kopt.PASS_NAMES)
    if "help" in args.disable:
        print("passes: " + ", ".join(names))
        return 0
    unknown = [d for d in args.disable if names and d not in names]
    if unknown:
        raise UsageError(f"unknown pass(es) {unknown} for --disable; the passes are "
                         + ", ".join(names))
    from kiln.passes.base import count_nodes, op_histogram
    from kiln.tools.common import load_model

    model = _preprocessed(load_model(args.model), args)
    before_nodes, before_ops = count_nodes(model.graph), op_histogram(model.graph)
    level = 0 if args.no_optimize else (int(args.level) if args.level is not None else None)
    kw: dict[str, Any] = {"disable": args.disable, "input_shapes": dict(args.input_shape)}
    if level is not None:
        kw["level"] = level
    t0 = time.perf_counter()
    run = getattr(kopt, "optimize_with_report", None)
    if run is not None:
        out, rep = run(model, **kw)
    else:
        out, rep = kopt.optimize(model, **kw), None
    dt = time.perf_counter() - t0
    from kiln.onnxio import save
    save(out, args.output)
    after_nodes, after_ops = count_nodes(out.graph), op_histogram(out.graph)
    print(f"{args.model} -> {args.output}: {before_nodes} -> {after_nodes} nodes "
          f"in {dt * 1e3:.0f} ms")
    if rep is not None and hasattr(rep, "by_pass"):
        for name, changes in rep.by_pass().items():
            if changes:
                print(f"  {name}: " + ", ".join(f"{k} x{v}" for k, v in sorted(changes.items())))
    diff = []
    for op in sorted(set(before_ops) | set(after_ops)):
        a, b = before_ops.get(op, 0), after_ops.get(op, 0)
        if a != b:
            diff.append(f"{op} {a}->{b}")
    print("ops changed: " + (", ".join(diff) if diff else "none"))
    if args.input_shape:
        shapes = {v.name: v.shape for v in out.graph.inputs}
        from kiln.tools.common import fmt_dims
        print("inputs: " + ", ".join(f"{n} {fmt_dims(s)}" for n, s in shapes.items()))
    return 0


def _preprocessed(model, args):
    """``model`` with the preprocessing the optimize flags ask for embedded."""
    from kiln.edit import preprocess

    only = model.graph.inputs[0].name if len(model.graph.inputs) == 1 else None
    specs: dict[str, dict[str, Any]] = {}
    for flag, key in (("input_type", "input_type"), ("layout", "layout"),
                      ("mean_values", "mean"), ("scale_values", "scale"), ("resize", "resize")):
        for name, val in getattr(args, flag):
            name = name or only
            if name is None:
                raise UsageError(f"--{flag.replace('_', '-')} {val}: the model has several "
                                 "inputs; write NAME=VALUE")
            specs.setdefault(name, {})[key] = _numbers(val) if key in ("mean", "scale") \
                else val
    if args.reverse_input_channels:
        for v in model.graph.inputs:
            if v.shape is not None and len(v.shape) == 4 and v.shape[1] == 3:
                specs.setdefault(v.name, {})["reverse_channels"] = True
    for name, spec in specs.items():
        model = preprocess(model, name, **spec)
    if specs:
        print("preprocessing embedded for " + ", ".join(specs))
    return model


def cmd_cut(args) -> int:
    from kiln.edit import cut
    from kiln.edit.common import all_names
    from kiln.onnxio import save
    from kiln.passes.base import count_nodes
    from kiln.tools.common import load_model

    model = load_model(args.model)
    known = all_names(model.graph)
    inputs: dict[str, str | None] = {}
    for text in args.input:
        name, sep, shape = text.rpartition(":")
        if text in known or not sep:
            name, shape = text, None
        inputs[name] = shape or None
    out = cut(model, inputs=inputs or None, outputs=args.output or None,
              last_layers=args.last_layers)
    save(out, args.out)
    print(f"{args.model} -> {args.out}: {count_nodes(model.graph)} -> "
          f"{count_nodes(out.graph)} nodes")
    from kiln.tools.common import fmt_dims
    for kind, vals in (("inputs", out.graph.inputs), ("outputs", out.graph.outputs)):
        print(f"{kind}: " + ", ".join(f"{v.name} {fmt_dims(v.shape)}" for v in vals))
    return 0


def cmd_edit(args) -> int:
    from kiln import edit
    from kiln.onnxio import save
    from kiln.tools.common import fmt_dims, load_model

    model = load_model(args.model)
    if args.append:
        pairs = [tuple(m.split("=", 1)) for m in args.io_map]
        if not pairs or any(len(p) != 2 for p in pairs):
            raise UsageError("--append needs --io-map OUT=IN for each connection")
        model = edit.compose(model, load_model(args.append), pairs)
    elif args.io_map:
        raise UsageError("--io-map only goes with --append")
    if args.tail:
        tail = {"softmax": "Softmax", "argmax": "ArgMax", "topk": "TopK"}[args.tail]
        model = edit.add_tail(model, tail, k=args.k)
    if args.batch is not None:
        model = edit.set_batch(model, int(args.batch) if args.batch.isdigit() else args.batch)
    if args.rename:
        pairs = [tuple(r.split("=", 1)) for r in args.rename]
        if any(len(p) != 2 or not all(p) for p in pairs):
            raise UsageError(f"--rename takes OLD=NEW, got {args.rename}")
        model = edit.rename(model, dict(pairs))
    save(model, args.output)
    print(f"{args.model} -> {args.output}")
    for kind, vals in (("inputs", model.graph.inputs), ("outputs", model.graph.outputs)):
        print(f"{kind}: " + ", ".join(f"{v.name} {fmt_dims(v.shape)}" for v in vals))
    return 0


def cmd_run(args) -> int:
    import numpy as np

    from kiln.cli.format import array_summary, run_words, table
    from kiln.tools.common import load_model, random_feeds, session_for

    if args.output and not Path(args.output).resolve().parent.is_dir():
        raise InputError(f"cannot save {args.output}: the folder "
                         f"{Path(args.output).resolve().parent} does not exist")
    model = load_model(args.model)
    feeds = _feeds(args, model, args.random) if args.input else {}
    missing = [v.name for v in model.graph.inputs if v.name not in feeds]
    if missing:
        if not args.random:
            raise UsageError(f"no value for input(s) {missing}: give --input NAME=FILE or "
                             "--random")
        rnd = random_feeds(model, _dims(args), args.seed)
        feeds.update({k: rnd[k] for k in missing})
    sess = session_for(model, args.backend, args.device, optimize=not args.no_optimize,
                       precision=args.precision, compile=args.compile)
    t0 = time.perf_counter()
    outs = sess.run(None, feeds)
    dt = (time.perf_counter() - t0) * 1e3
    names = [o.name for o in sess.get_outputs()]
    last = sess.placement().last_run
    compiled = bool(last is not None and last.compiled)
    backend = sess.backend.name  # with no --backend, the one the file stores
    precision = getattr(sess.backend, "precision", None)
    how = run_words(precision, compiled)
    if args.output:
        arrays = {n: np.asarray(o) for n, o in zip(names, outs) if not isinstance(o, list)}
        with open(args.output, "wb") as f:  # the name given: np.savez would add ".npz"
            np.savez(f, **arrays)
    rows = [array_summary(n, o) for n, o in zip(names, outs)]
    if args.json:
        _emit_json({"ms": dt, "backend": backend, "precision": precision or "fp32",
                    "compiled": compiled, "inputs": {k: [list(v.shape), str(v.dtype)]
                                         for k, v in feeds.items()},
                    "outputs": [dict(zip(["name", "dtype", "shape", "min", "max", "mean"], r))
                                for r in rows]})
        return 0
    ins = ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in feeds.items())
    print(f"ran {Path(str(args.model)).name} on {backend}"
          + (f" ({', '.join(how)})" if how else "") + f" in {dt:.1f} ms"
          + (f" (inputs: {ins})" if ins else ""))
    print(table(["output", "dtype", "shape", "min", "max", "mean"], rows, right=(3, 4, 5)))
    if args.output:
        print(f"saved {len(names)} output(s) to {args.output}")
    return 0


def _stages(what: str, steps: int) -> Any:
    """Progress of a command that can take more than a few seconds, on stderr: a line
    redrawn with the seconds elapsed on a terminal, a line per stage in a pipe or log."""
    from kiln.tools.progress import StepReporter

    return StepReporter(f"kiln {what}", steps)


def cmd_profile(args) -> int:
    from kiln.cli.format import profile_text
    from kiln.tools import profile
    from kiln.tools.common import load_model, model_name, session_for

    with _stages("profile", 3) as stages:
        stages.step(f"loading {args.model}")
        model = load_model(args.model)
        feeds = _feeds(args, model, True)
        stages.step(f"building the {args.backend or default_backend_name()} session")
        sess = session_for(model, args.backend, args.device, optimize=not args.no_optimize)
        stages.step(f"profiling {args.warmup} warm-up and {args.runs} timed run(s)")
        p = profile(sess, feeds, runs=args.runs, warmup=args.warmup, dims=_dims(args),
                    seed=args.seed)
        stages.done(f"done in {stages.elapsed():.1f} s")
    p.model = model_name(args.model)
    if args.trace:
        p.save_trace(args.trace)
    if args.json:
        _emit_json(p.to_dict())
    else:
        print(profile_text(p, args.top))
        if args.trace:
            print(f"\ntrace written to {args.trace} (open in ui.perfetto.dev or "
                  "chrome://tracing)")
    return 0


def cmd_bench(args) -> int:
    from kiln.cli.format import bench_text
    from kiln.tools import bench
    from kiln.tools.common import load_model
    from kiln.tools.progress import Heartbeat, wants_progress

    feeds = None
    if args.input:
        model = load_model(args.model)
        feeds = _feeds(args, model, True)
    # On a terminal the bar shows how the runs go; in a pipe or log, where no bar is drawn,
    # a long bench says every few seconds how far it is (a short one prints nothing).
    quiet = args.quiet or args.json
    with Heartbeat("kiln bench", enabled=not args.quiet and not wants_progress(None)) as beat:
        beat.update("building the session")
        r = bench(args.model, backend=args.backend, device=args.device, feeds=feeds,
                  runs=args.runs, warmup=args.warmup, batch=args.batch,
                  threads=args.threads, vs=args.vs, dims=_dims(args),
                  optimize=not args.no_optimize, progress=False if quiet else None,
                  precision=args.precision, compile=args.compile,
                  on_run=lambda done, total: beat.update(
                      f"round {done}/{total} ({args.warmup} warm-up)"))
    if args.json:
        _emit_json(r.to_dict())
    else:
        print(bench_text(r))
    fastest = default_backend_name()
    if r.backend != fastest and not args.quiet:
        measured = (f"took {r.ratio:.2f}x {r.other.engine}'s time here" if r.ratio is not None
                    else f"ran in {r.kiln.p50:.3f} ms (p50) here")
        _hint(f"this measured Kiln's {r.backend} backend, which {measured}. The default "
              f"backend here, {fastest} (--backend {fastest}), is the one Kiln prefers for "
              "speed (docs/performance.md compares them)")
    return 0


def _hint(text: str) -> None:
    """A way to a better result, on stderr (stdout keeps the command's own output)."""
    note = "" if importlib.util.find_spec("torch") else ' (pip install -e ".[torch]")'
    print(f"kiln: hint: {text}{note}", file=sys.stderr)


def cmd_report(args) -> int:
    from kiln.tools import report
    from kiln.tools.common import load_model

    feeds = None
    if args.input:
        feeds = _feeds(args, load_model(args.model), True)
    with _stages("report", 3 if args.profile else 2) as stages:
        r = report(args.model, args.output, profile=args.profile, backend=args.backend,
                   device=args.device, runs=args.runs, feeds=feeds, dims=_dims(args),
                   optimize=not args.no_optimize, on_stage=stages.step)
        stages.done(f"done in {stages.elapsed():.1f} s")
    print(f"report written to {r.path} ({r.size_bytes / 1e3:.0f} kB, {r.layers} layers"
          + (", profiled)" if r.profiled else ")"))
    return 0


def cmd_convert(args) -> int:
    import os

    from kiln.onnxio import save
    from kiln.quantize import convert_float16
    from kiln.tools.common import resolve_path

    src = resolve_path(args.model)
    _check_layer_names(src, args.block, "--block")
    out = convert_float16(src, keep_io_types=not args.half_io, block_list=args.block,
                          bf16=args.bf16, calibration=args.calibration,
                          budget=args.accuracy_budget)
    save(out, args.output)
    kind = "bfloat16" if args.bf16 else "float16"
    print(f"{args.model} -> {args.output}: {kind}, {os.path.getsize(src) / 1e6:.1f} MB -> "
          f"{os.path.getsize(args.output) / 1e6:.1f} MB")
    return 0


def _check_layer_names(model: Any, names: list[str], flag: str) -> None:
    """Each of ``names`` is an op type or a layer name of ``model``: a misspelt one would
    otherwise block or exclude nothing, silently."""
    if not names:
        return
    from kiln.tools.common import load_model

    g = load_model(model).graph
    known = {n.op_type for n in g.nodes} | {n.name for n in g.nodes if n.name}
    unknown = [n for n in names if n not in known]
    if unknown:
        import difflib

        close = [c for n in unknown for c in difflib.get_close_matches(n, known, 2)]
        raise OptionError(f"{flag} {', '.join(unknown)}: no op type or layer of that name in "
                          "the model" + (f"; did you mean {' or '.join(close)}?" if close
                                         else " (`kiln inspect MODEL` lists the layers)"))


def cmd_batch(args) -> int:
    from kiln.integrations.ray import batch_files

    with _stages("batch", 0) as stages:  # a local Ray start alone is silent for 30+ s
        r = batch_files(args.model, args.input, args.output, address=args.address,
                        concurrency=args.concurrency, batch_size=args.batch_size,
                        backend=args.backend, device=args.device, threads=args.threads,
                        num_gpus=args.gpus, optimize=not args.no_optimize,
                        on_stage=stages.step)
        stages.done(f"done in {stages.elapsed():.1f} s")
    print(f"scored {r.rows} rows from {r.files} file(s) in {r.seconds:.1f} s "
          f"({r.rows / r.seconds:.0f} rows/s); parquet in {r.output}")
    return 0


def cmd_serve(args) -> int:
    from kiln.serving import ModelConfig, serve
    from kiln.tools.common import resolve_path

    if not args.models and not args.model_repository:
        raise UsageError("give model files, --model-repository DIR, or both")
    models = [resolve_path(m) for m in args.models]  # zoo names, as every command takes
    config = ModelConfig(backend=args.backend or default_backend_name(), device=args.device,
                         precision=args.precision,
                         threads=args.threads, max_batch_size=args.max_batch_size,
                         max_queue_delay_microseconds=args.max_queue_delay_microseconds,
                         max_queue_size=args.max_queue_size)
    serve(models, args.model_repository, host=args.host, http_port=args.http_port,
          grpc_port=args.grpc_port if args.allow_grpc == "true" else None,
          token=os.environ.get(args.token_env) or None,
          max_request_bytes=args.max_request_size, config=config)
    return 0


def cmd_quantize(args) -> int:
    from kiln.quantize import quantize
    from kiln.tools.common import resolve_path

    if args.mode == "static" and not args.calibration:  # before building a zoo model
        raise OptionError("--mode static (the default) needs calibration data: --calibration "
                          "DATA.npz, an .npz whose keys are the model's inputs (--mode "
                          "dynamic needs none)")
    _check_layer_names(resolve_path(args.model), args.exclude, "--exclude")
    with _stages("quantize", 0) as stages:
        q = quantize(resolve_path(args.model), args.mode, args.calibration,
                     method=args.method, per_channel=not args.per_tensor,
                     symmetric=args.symmetric, exclude=args.exclude,
                     validation=args.validation, bits=args.bits, block_size=args.block_size,
                     reduce_range={"auto": None, "on": True, "off": False}[args.reduce_range],
                     budget=args.accuracy_budget, budget_seconds=args.budget_seconds,
                     backend=args.backend,
                     speed_aware=args.speed_aware, max_noise=args.max_noise,
                     smooth_alpha=args.smooth_alpha, bias_correction=args.bias_correction,
                     on_stage=stages.step,
                     on_batch=lambda done, total: stages.update(
                         f"calibrating: batch {done}/{total}"))
        stages.done(f"done in {stages.elapsed():.1f} s")
    q.save(args.output)
    print(f"{args.model} -> {args.output}")
    print(q.report)
    r = q.report
    kilns = [e for e in integer_engines() if e in backend_names(usable_only=True)]
    if r.backend not in integer_engines() and r.latency_before_ms and r.latency_after_ms \
            and kilns:
        _hint(f"on the {r.backend} backend the quantized model ran "
              f"{r.latency_before_ms / r.latency_after_ms:.2f}x as fast as the original "
              f"({r.latency_after_ms:.2f} against {r.latency_before_ms:.2f} ms): it has "
              f"no int8 kernels. The {kilns[0]} backend runs int8 layers on integer "
              f"kernels (docs/quantization.md): measure with --backend {kilns[0]}, run with "
              f'backend="{kilns[0]}"')
    return 0


def cmd_tune(args) -> int:
    from kiln.tools.common import resolve_path
    from kiln.tools.tune import tune

    with _stages("tune", 0) as stages:
        r = tune(resolve_path(args.model), args.data, budget=args.budget, batch=args.batch,
                 time_budget=args.time_budget, output=args.output, on_stage=stages.step)
        stages.done(f"done in {stages.elapsed():.1f} s")
    if args.json:
        _emit_json(r.to_dict())
        return 0
    print(f"{args.model} -> {args.output}")
    print(r)
    return 0


def cmd_zoo(argv: list[str]) -> int:
    if importlib.util.find_spec("kiln.zoo.__main__") is None:
        print("kiln: the model zoo is not available in this install "
              "(pip install 'kiln[zoo]')", file=sys.stderr)
        return 1
    try:
        from kiln.zoo.__main__ import main as zoo_main
    except ImportError as e:
        print(f"kiln: the model zoo is not available ({e}); pip install 'kiln[zoo]'",
              file=sys.stderr)
        return 1
    return int(zoo_main(argv) or 0)


# Optional packages and the extra of pyproject.toml that installs each (for the safety net
# in _guard: the places that need them raise MissingDependencyError themselves).
_EXTRAS = {"torch": "torch", "PIL": "images", "onnxruntime": "zoo", "transformers": "zoo",
           "onnxscript": "zoo", "tqdm": "zoo", "ray": "ray", "starlette": "serve",
           "uvicorn": "serve", "grpc": "serve", "prometheus_client": "serve"}


def _missing_module_hint(e: ModuleNotFoundError) -> str | None:
    """One line saying which extra installs the module ``e`` is about; None when the
    module is not one of Kiln's optional dependencies."""
    top = (e.name or "").split(".")[0]
    if top not in _EXTRAS:
        return None
    return (f"this needs {top}, which is not installed: "
            f'pip install -e ".[{_EXTRAS[top]}]"')


# -- entry point --------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    """Run the ``kiln`` command line; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # --debug is taken wherever it stands, so `kiln run m.onnx --debug` works too.
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if argv and argv[0] == "zoo":
        return _guard(lambda: cmd_zoo(argv[1:]), None, debug)
    parser = build_parser()
    args = parser.parse_args(argv)
    return _guard(lambda: args.func(args), args.parser, debug)


def _guard(fn: Callable[[], int], parser: argparse.ArgumentParser | None,
           debug: bool = False) -> int:
    """Turn failures into one line on stderr and an exit code; the traceback only with
    ``--debug``."""
    if debug:
        return fn()
    try:
        return _explain(fn, parser)
    except Exception as e:  # noqa: BLE001 - a bug in Kiln still gets one readable line
        what = (str(e).strip().splitlines() or [""])[0]
        print(f"kiln: internal error: {type(e).__name__}: {what} (run again with --debug "
              "for the traceback, and please report it)", file=sys.stderr)
        return 1


def _explain(fn: Callable[[], int], parser: argparse.ArgumentParser | None) -> int:
    """Expected failures as a message and an exit code; anything else propagates."""
    try:
        return fn()
    except UsageError as e:
        if parser is not None:
            parser.print_usage(sys.stderr)
        print(f"kiln: error: {e}", file=sys.stderr)
        return USAGE_ERROR
    except (KilnError, InputError) as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:
        hint = _missing_module_hint(e)
        if hint is None:
            raise  # Kiln itself is broken: reported by _guard
        print(f"kiln: error: {hint}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # output piped into `head` and the like
        sys.stdout = None
        return 0
    except OSError as e:
        print(f"kiln: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kiln: interrupted", file=sys.stderr)
        return 130
