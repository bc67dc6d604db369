"""Kiln's ``kiln.to_torch`` against onnx2torch (``onnx2torch.convert``), the tool people use
today to train ONNX models in PyTorch (issue 10): which models each converts and trains.

Models: the 20 zoo models (kiln.zoo.registry: REGISTRY with its dynamo variants; inputs
``make_inputs(name, batch=2, seq=16, seed=0)``), built into the zoo cache if missing, and the
9 ONNX "light" models of onnx's backend test data (``light_*.onnx``; standard normal inputs of
the declared shapes, seed 0). In the light models every large weight is a ``ConstantOfShape``
output (of an int64 shape initializer); only small float tensors (some biases, BatchNorm
scales and statistics) are initializers, the parameters a tool can make. Their Dropout
layers are random in train mode, so there a changed loss after the SGD step proves little.

Per model and tool (every step's exception is caught; its first line is kept):

1. converts: the module is built;
2. matches: eval mode, no_grad forward against onnxruntime (CPUExecutionProvider) on the
   same file: max absolute difference, pass at ``np.allclose(rtol=1e-3, atol=1e-4)`` for
   every float output (other outputs must be equal);
3. trains: train mode, loss = sum over float outputs of ``out.float().square().mean()``,
   backward: how many float parameters got a gradient that is finite and not all zero (it
   trains when all did; "n/a" for a module without float parameters), then one SGD step
   (lr 1e-3) and whether the loss changed (and stayed finite). Kiln makes every float
   initializer but BatchNorm statistics a parameter, 0-d ones (literals an exporter
   lifted: a Pow exponent, a mask value) with requires_grad off, which are not counted.
   Float buffers are counted too: onnx2torch makes a parameter
   only of the weights of Conv, Gemm, BatchNormalization, InstanceNormalization and
   LayerNormalization; every other initializer (MatMul weights, embeddings, PRelu slopes,
   Add biases) is a frozen buffer.

Gradient oracle (resnet18, mobilenetv2, bert, gpt2: the models of tests/train/test_train_zoo.py,
with its ``_prepare``, ``_loss`` and ``_padding_rows``): each tool's module of the zoo
PyTorch module's trainable export, eval mode, against that module's gradients, parameter by
parameter. Kiln's parameters map back with ``initializer_name``. onnx2torch's are named
``<node>.weight``/``<node>.bias`` after the ONNX node (dots made slashes; ``<node>.1.weight``
where a Conv's padding is a module of its own); the node is found with onnx2torch's own
``OnnxGraph`` naming, the initializer is the node's input 1 (weight, scale) or 2 (bias), and
every such mapping is checked: the parameter must equal that initializer (for Gemm: times
alpha or beta, transposed where transB is 0, as onnx2torch builds its Linear); a parameter
that fails the check is reported unmapped and not compared. Reported: parameters compared
(of the PyTorch module's parameters with a gradient), the largest ||g - w|| / ||w|| over
those whose reference gradient is not negligible (||w|| > 1e-6 max ||w||), and how many miss
the test's tolerance ||g - w|| <= 1e-4 ||w|| + 1e-6 max ||w||.

Step time and memory: resnet18 (224x224) and bert (seq 128) at batch 8, exported as
benchmarks/training.py does (its ``exported``, ``step`` and ``saved_bytes``), both tools in
one process with alternating steps (forward + backward + SGD), best of 5 after a warm-up,
2 torch threads; memory is the bytes of tensors saved for backward.

onnx2torch imports torchvision for its NMS and RoiAlign converters only, and no torchvision
wheel on PyPI loads beside torch 2.13.0+cpu (docs/training.md). Where ``import torchvision``
fails, a stub ``torchvision``/``torchvision.ops`` whose ``nms``, ``box_convert`` and
``roi_align`` raise NotImplementedError when called is in ``sys.modules`` while onnx2torch
is imported, and removed after (so transformers does not take it for torchvision). No model
here has NonMaxSuppression or RoiAlign, so the stub changes nothing that is measured; the
header says whether it was used.

    pip install --no-deps onnx2torch==1.5.15
    python benchmarks/onnx2torch_compare.py [--models resnet18,light_vgg19] [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import glob
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import helper, numpy_helper
from torch import nn

import kiln
import kiln.zoo
from kiln.zoo.registry import REGISTRY, get_entry, make_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIGHT_DIR = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
STUB_MESSAGE = "torchvision is not installable beside torch 2.13.0+cpu"
ORACLE_MODELS = ("resnet18", "mobilenetv2", "bert", "gpt2")
TIMED_MODELS = ("resnet18", "bert")
TOOLS = ("kiln", "onnx2torch")
REL = 1e-4
PARAM_INPUT = {"weight": 1, "bias": 2}

Converter = Callable[[Any], nn.Module]


@dataclass
class Case:
    name: str
    path: str
    feeds: dict[str, np.ndarray]


def _unavailable(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(STUB_MESSAGE)


def _torchvision_loads() -> bool:
    try:
        importlib.import_module("torchvision")
    except Exception:  # noqa: BLE001 - ImportError, or RuntimeError from its _C.so
        return False
    return True


def import_onnx2torch() -> tuple[types.ModuleType, bool]:
    """onnx2torch, and whether a torchvision stub had to stand in while importing it."""
    stubbed = not _torchvision_loads()
    if stubbed:
        tv, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")
        ops.nms = ops.box_convert = ops.roi_align = _unavailable
        tv.ops = ops
        sys.modules.update({"torchvision": tv, "torchvision.ops": ops})
    try:
        return importlib.import_module("onnx2torch"), stubbed
    except ImportError as e:
        raise SystemExit(f"{e}: pip install --no-deps onnx2torch==1.5.15") from None
    finally:
        if stubbed:
            for name in ("torchvision.ops", "torchvision"):
                sys.modules.pop(name, None)


def _helpers(folder: str, module: str) -> types.ModuleType:
    path = os.path.join(ROOT, folder)
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module(module)


def first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0] if lines else ''}".strip()


@contextlib.contextmanager
def quiet() -> Iterator[list[str]]:
    """Warnings raised inside, as their first lines (deduplicated); nothing printed."""
    seen: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield seen
    for w in caught:
        line = f"{w.category.__name__}: {str(w.message).strip().splitlines()[0][:200]}"
        if line not in seen:
            seen.append(line)


# -- models ---------------------------------------------------------------------------


def zoo_cases(names: list[str]) -> list[Case]:
    return [Case(n, str(kiln.zoo.path(n, progress=False)), make_inputs(n, batch=2, seq=16, seed=0))
            for n in names]


def light_feeds(path: str) -> dict[str, np.ndarray]:
    graph = onnx.load(path).graph
    inits = {t.name for t in graph.initializer}
    rng = np.random.default_rng(0)
    feeds = {}
    for v in graph.input:
        if v.name in inits:
            continue
        tt = v.type.tensor_type
        shape = [d.dim_value or 1 for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type)
        feeds[v.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def light_paths() -> dict[str, str]:
    files = sorted(glob.glob(os.path.join(LIGHT_DIR, "light_*.onnx")))
    return {os.path.splitext(os.path.basename(f))[0]: f for f in files}


def all_cases(selected: set[str] | None) -> list[Case]:
    zoo = [n for n in REGISTRY if selected is None or n in selected]
    light = {n: p for n, p in light_paths().items() if selected is None or n in selected}
    return zoo_cases(zoo) + [Case(n, p, light_feeds(p)) for n, p in light.items()]


# -- per model checks -----------------------------------------------------------------


def as_list(out: Any) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def float_params(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad and p.is_floating_point()]


def grad_problem(grad: torch.Tensor | None) -> str | None:
    if grad is None:
        return "None"
    if not bool(torch.isfinite(grad).all()):
        return "not finite"
    return None if bool(grad.any()) else "all zero"


def float_buffers(module: nn.Module) -> int:
    return sum(1 for b in module.buffers() if b.is_floating_point())


def ort_outputs(case: Case) -> list[np.ndarray]:
    sess = ort.InferenceSession(case.path, providers=["CPUExecutionProvider"])
    return sess.run(None, case.feeds)


def compare_outputs(got: list[np.ndarray], want: list[np.ndarray]) -> dict[str, Any]:
    if len(got) != len(want):
        return {"matches": False, "error": f"{len(got)} outputs, onnxruntime gives {len(want)}"}
    ok, diff = True, 0.0
    for g, w in zip(got, want):
        if g.shape != w.shape:
            return {"matches": False, "error": f"output shape {g.shape}, onnxruntime {w.shape}"}
        if np.issubdtype(w.dtype, np.floating):
            diff = max(diff, float(np.abs(g.astype(np.float64) - w).max(initial=0.0)))
            ok = ok and bool(np.allclose(g, w, rtol=1e-3, atol=1e-4))
        else:
            ok = ok and bool(np.array_equal(g, w))
    return {"matches": ok, "max_abs_diff": diff}


def check_match(module: nn.Module, args: tuple, want: list[np.ndarray]) -> dict[str, Any]:
    module.eval()
    with torch.no_grad():
        got = [t.detach().cpu().numpy() for t in as_list(module(*args))]
    return compare_outputs(got, want)


def loss_of(module: nn.Module, args: tuple) -> torch.Tensor:
    outs = [o for o in as_list(module(*args)) if o.is_floating_point()]
    return sum((o.float().square().mean() for o in outs), torch.zeros(()))


def check_train(module: nn.Module, args: tuple, res: dict[str, Any]) -> None:
    """Fills res as it goes, so that an exception leaves what was measured before it."""
    module.train()
    params = float_params(module)
    res.update(params=len(params), params_with_grad=0, float_buffers=float_buffers(module),
               trains=False)
    loss = loss_of(module, args)
    if not params:
        res.update(trains=None, note="no float parameters: nothing to train")
        return
    loss.backward()
    bad = {k: grad_problem(p.grad) for k, p in module.named_parameters() if p.requires_grad
           and p.is_floating_point() and grad_problem(p.grad)}
    res.update(params_with_grad=len(params) - len(bad), trains=not bad, bad_grads=bad)
    torch.optim.SGD(params, lr=1e-3).step()
    with torch.no_grad():
        after = float(loss_of(module, args))
    before = float(loss.detach())
    res.update(loss_before=before, loss_after=after, loss_changed=after != before,
               loss_finite=bool(np.isfinite(after)))


def run_tool(case: Case, convert: Converter, want: list[np.ndarray]) -> dict[str, Any]:
    res: dict[str, Any] = {"converts": False, "matches": None, "trains": None, "error": None}
    args = tuple(torch.from_numpy(v) for v in case.feeds.values())

    def build() -> None:
        res["module"] = convert(case.path)
        res["converts"] = True

    def match() -> None:
        res.update(check_match(res["module"], args, want))

    def train() -> None:
        check_train(res["module"], args, res)

    steps = [("convert", build), ("forward", match), ("train", train)]
    with quiet() as seen:
        for step, fn in steps:
            if step != "convert" and not res["converts"]:
                break
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - each step's failure is a result
                res.setdefault("errors", {})[step] = first_line(e)
                res["error"] = res["error"] or f"{step}: {first_line(e)}"
                if step == "train":
                    res["trains"] = False
    res.pop("module", None)
    res["warnings"] = seen
    return res


def measure(cases: list[Case], tools: dict[str, Converter]) -> list[dict[str, Any]]:
    rows = []
    for case in cases:
        t0 = time.perf_counter()
        try:
            want = ort_outputs(case)
        except Exception as e:  # noqa: BLE001
            rows.append({"model": case.name, "tool": "onnxruntime", "error": first_line(e)})
            continue
        for tool, convert in tools.items():
            rows.append({"model": case.name, "tool": tool, **run_tool(case, convert, want)})
            gc.collect()
        print(f"  {case.name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return rows


# -- gradient oracle ------------------------------------------------------------------


def _gemm_maps(node: Any, attr: str) -> tuple[Callable, Callable]:
    """Initializer -> onnx2torch parameter, and parameter gradient -> initializer gradient."""
    a = node.attributes
    if attr == "bias":
        beta = a.get("beta", 1.0)
        return (lambda t: t * beta), (lambda g: g * beta)
    alpha, trans = a.get("alpha", 1.0), a.get("transB", 0) != 0
    if trans:
        return (lambda t: t * alpha), (lambda g: g * alpha)
    return (lambda t: t.T * alpha), (lambda g: g.T * alpha)


def _maps(node: Any, attr: str) -> tuple[Callable, Callable]:
    if node.operation_type == "Gemm":
        return _gemm_maps(node, attr)
    return (lambda t: t), (lambda g: g)


def _node_of(nodes: Any, key: str) -> tuple[Any, str]:
    owner, _, attr = key.rpartition(".")
    if owner not in nodes:
        owner = owner.rpartition(".")[0]  # Sequential(padding, conv): "<node>.1.weight"
    return nodes.get(owner), attr


def onnx2torch_grads(module: nn.Module, proto: onnx.ModelProto
                     ) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Gradients by initializer name, and the parameters that could not be mapped."""
    from onnx2torch.onnx_graph import OnnxGraph

    nodes = OnnxGraph(proto.graph).nodes
    inits = {t.name: t for t in proto.graph.initializer}
    grads, unmapped = {}, []
    for key, p in module.named_parameters():
        node, attr = _node_of(nodes, key)
        idx = PARAM_INPUT.get(attr)
        if node is None or idx is None or len(node.input_values) <= idx:
            unmapped.append(key)
            continue
        name = node.input_values[idx]
        to_param, to_init = _maps(node, attr)
        value = torch.from_numpy(numpy_helper.to_array(inits[name]).copy()) \
            if name in inits else None
        if value is None or not torch.equal(to_param(value), p.detach()):
            unmapped.append(key)
            continue
        grads[name] = None if p.grad is None else to_init(p.grad)
    return grads, unmapped


def kiln_grads(module: nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    return {module.initializer_name(k): p.grad for k, p in module.named_parameters()}, []


def grad_errors(grads: dict[str, torch.Tensor | None], want: dict[str, torch.Tensor],
                pad: dict[str, int]) -> dict[str, Any]:
    scale = max(float(w.norm()) for w in want.values())
    compared, worst, over, unknown = 0, 0.0, [], []
    for name, g in grads.items():
        if name not in want:
            unknown.append(name)
            continue
        w = want[name].clone()
        g = torch.zeros_like(w) if g is None else g.clone()
        if name in pad:
            g[pad[name]] = 0
            w[pad[name]] = 0
        diff, norm = float((g - w).norm()), float(w.norm())
        compared += 1
        if norm > 1e-6 * scale:
            worst = max(worst, diff / norm)
        if diff > REL * norm + 1e-6 * scale:
            over.append(name)
    return {"compared": compared, "reference_params": len(want), "max_rel_err": worst,
            "over_tolerance": over, "not_in_reference": unknown}


def oracle_one(name: str, tools: dict[str, Converter], zoo_test: types.ModuleType
               ) -> list[dict[str, Any]]:
    with quiet():
        net, blob, args = zoo_test._prepare(name)
    pad = zoo_test._padding_rows(net)
    ref = copy.deepcopy(net).eval()
    zoo_test._loss(ref(*args)).backward()
    want = {k: p.grad for k, p in ref.named_parameters() if p.grad is not None}
    proto = onnx.load_from_string(blob)
    rows = []
    for tool, convert in tools.items():
        row: dict[str, Any] = {"model": name, "tool": tool, "error": None}
        try:
            with quiet():
                module = convert(blob if tool == "kiln" else copy.deepcopy(proto)).eval()
                zoo_test._loss(tuple(as_list(module(*args)))).backward()
            grads, unmapped = kiln_grads(module) if tool == "kiln" else \
                onnx2torch_grads(module, proto)
            row.update(grad_errors(grads, want, pad), unmapped=unmapped,
                       tool_params=sum(1 for _ in module.parameters()))
        except Exception as e:  # noqa: BLE001
            row["error"] = first_line(e)
        rows.append(row)
    return rows


def oracle(names: list[str], tools: dict[str, Converter]) -> list[dict[str, Any]]:
    zoo_test = _helpers("tests", "test_train_zoo")
    rows = []
    for name in names:
        t0 = time.perf_counter()
        try:
            rows += oracle_one(name, tools, zoo_test)
        except BaseException as e:  # noqa: BLE001 - pytest's Skipped is a BaseException
            if isinstance(e, KeyboardInterrupt):
                raise
            rows += [{"model": name, "tool": t, "error": first_line(e)} for t in tools]
        print(f"  oracle {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return rows


# -- step time and memory -------------------------------------------------------------


def timing_feeds(name: str) -> dict[str, np.ndarray]:
    entry = get_entry(name)
    if entry.is_text:
        return make_inputs(entry, batch=8, seq=128)
    return {"input": np.random.default_rng(0).standard_normal((8, 3, 224, 224))
            .astype(np.float32)}


def timing_modules(blob: bytes, tools: dict[str, Converter]
                   ) -> tuple[dict[str, nn.Module], dict[str, str]]:
    mods, errors = {}, {}
    for t, convert in tools.items():
        try:
            mods[t] = convert(blob if t == "kiln" else onnx.load_from_string(blob)).train()
        except Exception as e:  # noqa: BLE001
            errors[t] = first_line(e)
    return mods, errors


def timing_one(name: str, tools: dict[str, Converter], training: types.ModuleType,
               reps: int) -> dict[str, Any]:
    args = tuple(torch.from_numpy(v) for v in timing_feeds(name).values())
    with quiet():
        _, blob = training.exported(name, args, get_entry(name))
        mods, errors = timing_modules(blob, tools)
        opts = {t: torch.optim.SGD(m.parameters(), lr=1e-3) for t, m in mods.items()}
        times: dict[str, list[float]] = {t: [] for t in mods}
        for t in mods:
            training.step(mods[t], opts[t], args)
        for _ in range(reps):
            for t in mods:
                times[t].append(training.step(mods[t], opts[t], args))
        saved = {t: training.saved_bytes(m, args) for t, m in mods.items()}
    return {"model": name, "step_s": {t: min(v) for t, v in times.items()},
            "saved_bytes": saved, "params": {t: len(float_params(m)) for t, m in mods.items()},
            "errors": errors}


def timings(names: list[str], tools: dict[str, Converter], reps: int) -> list[dict[str, Any]]:
    training = _helpers("benchmarks", "training")
    torch.set_num_threads(2)
    rows = []
    for name in names:
        try:
            rows.append(timing_one(name, tools, training, reps))
        except Exception as e:  # noqa: BLE001
            rows.append({"model": name, "error": first_line(e)})
        gc.collect()
    return rows


# -- report ---------------------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def git_commit() -> str:
    def git(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD").stdout.strip() or "unknown"
    return head if git("diff", "--quiet", "HEAD", "--", "src").returncode == 0 \
        else f"{head} (src/ modified)"


def header(stubbed: bool) -> dict[str, Any]:
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "onnx": onnx.__version__,
            "onnxruntime": ort.__version__, "onnx2torch": metadata.version("onnx2torch"),
            "kiln_commit": git_commit(), "cpu": cpu_model(), "cpus": os.cpu_count(),
            "torchvision_stub": stubbed}


def header_line(h: dict[str, Any]) -> str:
    stub = "used (torchvision does not load)" if h["torchvision_stub"] else "not used"
    return (f"{h['date']}; torch {h['torch']}, onnx {h['onnx']}, onnxruntime {h['onnxruntime']}, "
            f"onnx2torch {h['onnx2torch']}, kiln {h['kiln_commit']}; CPU {h['cpu']} "
            f"({h['cpus']} cores); torchvision stub {stub}")


def cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(head: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def yes(flag: Any, unknown: str = "—") -> str:
    return unknown if flag is None else "yes" if flag else "no"


def trains_cell(r: dict[str, Any]) -> str:
    if "params" not in r:
        return yes(r.get("trains"))
    text = (f"{yes(r['trains'], 'n/a')} ({r['params_with_grad']}/{r['params']} params; "
            f"{r['float_buffers']} float buffers)")
    if r.get("bad_grads"):
        text += "; gradient " + ", ".join(f"{k}: {v}" for k, v in list(r["bad_grads"].items())[:4])
    if r.get("note"):
        text += f"; {r['note']}"
    elif r.get("loss_finite") is False:
        text += f"; loss {r['loss_after']} after the SGD step"
    elif r.get("loss_changed") is False:
        text += "; loss unchanged by the SGD step"
    return text


def models_table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        diff = r.get("max_abs_diff")
        match = yes(r.get("matches")) + (f" ({diff:.2e})" if diff is not None else "")
        body.append([r["model"], r["tool"], yes(r.get("converts")), match, trains_cell(r),
                     r.get("error") or ""])
    return table(["model", "tool", "converts", "matches ort (max abs diff)",
                  "trains (params with grads)", "error"], body)


def oracle_table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        if "compared" not in r:
            body.append([r["model"], r["tool"], "", "", "", r.get("error") or ""])
            continue
        notes = []
        if r["unmapped"]:
            notes.append(f"{len(r['unmapped'])} params unmapped: {', '.join(r['unmapped'][:3])}")
        if r["not_in_reference"]:
            notes.append(f"not in the PyTorch module: {', '.join(r['not_in_reference'][:3])}")
        if r["over_tolerance"]:
            notes.append(f"over tolerance: {', '.join(r['over_tolerance'][:3])}")
        body.append([r["model"], r["tool"], f"{r['compared']}/{r['reference_params']}",
                     f"{r['max_rel_err']:.2e}", len(r["over_tolerance"]), "; ".join(notes)])
    return table(["model", "tool", "params compared (of PyTorch's with grads)",
                  "max rel grad err", "params over 1e-4 tolerance", "notes"], body)


def _pair(r: dict[str, Any], key: str, fmt: Callable[[float], str]) -> list[str]:
    v = r.get(key, {})
    k, o = v.get("kiln"), v.get("onnx2torch")
    ratio = f"{k / o:.2f}" if k is not None and o else "—"
    return [fmt(k) if k is not None else "—", fmt(o) if o is not None else "—", ratio]


def timing_table(rows: list[dict[str, Any]]) -> str:
    body = []
    for r in rows:
        p = r.get("params", {})
        errors = [f"{t}: {e}" for t, e in r.get("errors", {}).items()]
        body.append([r["model"], *_pair(r, "step_s", lambda x: f"{x:.3f}"),
                     *_pair(r, "saved_bytes", lambda x: f"{x / 2**20:.1f}"),
                     f"{p.get('kiln', '—')} / {p.get('onnx2torch', '—')}",
                     "; ".join(errors + ([r["error"]] if r.get("error") else []))])
    return table(["model (batch 8)", "kiln step s", "onnx2torch step s", "ratio kiln/o2t",
                  "kiln saved MB", "onnx2torch saved MB", "ratio kiln/o2t",
                  "trained params kiln / o2t", "error"], body)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", help="comma-separated zoo and light_* names (default: all)")
    ap.add_argument("--json", help="also write every result to this file")
    ap.add_argument("--reps", type=int, default=5, help="timed steps per tool (best of)")
    a = ap.parse_args()
    selected = set(a.models.split(",")) if a.models else None
    o2t, stubbed = import_onnx2torch()
    tools: dict[str, Converter] = {"kiln": kiln.to_torch, "onnx2torch": o2t.convert}
    head = header(stubbed)
    t0 = time.perf_counter()
    rows = measure(all_cases(selected), tools)
    picked = [n for n in ORACLE_MODELS if selected is None or n in selected]
    grads = oracle(picked, tools)
    timed = timings([n for n in TIMED_MODELS if selected is None or n in selected], tools, a.reps)
    head["wall_s"] = round(time.perf_counter() - t0, 1)
    print(header_line(head), "\n")
    print(models_table(rows), "\n")
    print("Gradient oracle (eval mode, tests/train/test_train_zoo.py's export, loss and inputs):\n")
    print(oracle_table(grads), "\n")
    print(f"Training step, batch 8, 2 threads, best of {a.reps} "
          "(forward + backward + SGD); saved = bytes saved for backward:\n")
    print(timing_table(timed))
    print(f"\nwall time {head['wall_s']} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"header": head, "models": rows, "oracle": grads, "timing": timed}, f,
                      indent=2, default=str)


if __name__ == "__main__":
    main()
