"""Does each torch kernel earn its place? Times it against the shared array-API kernel.

    python benchmarks/torch_overrides.py                 # every override, table + JSON
    python benchmarks/torch_overrides.py -k Softmax -k Add --rounds 50

For every op version with both a torch kernel and a generic reference kernel (the one the
torch backend would run without the override), both kernels are prepared the way the plan
prepares them (``Kernel.bind`` on a ``Site`` for a ``kiln.ir.Node``, host-read inputs as
constants) and run on the same float32 CPU tensors, shapes taken from real models: a
ResNet activation (1, 64, 56, 56) and a BERT-base hidden state (1, 16, 768). Timings are
best-of-N per call with ``time.perf_counter``, the two kernels alternating block by block
(so that a slow-down from other work on the machine hits both), 2 torch threads, inside
``torch.inference_mode()``. Outputs must agree (``np.testing.assert_allclose``).

Gain = generic time / torch time; an op version's gain is its best case's: the override
pays off wherever a model hits that case. The table goes to stdout and, with the
machine's description, to ``benchmarks/results/torch_overrides.json``. The project keeps a
torch kernel only where this gain is at least 1.15x, or where it is needed for results or
dtypes (see ``benchmarks/results/torch_overrides.md``).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kiln.ir import Node, Value
from kiln.ops import registry
from kiln.runtime.torch_backend import TorchBackend

THREADS = 2
ACT = (1, 64, 56, 56)  # ResNet-18/50 after the stem
SEQ = (1, 16, 768)  # BERT-base hidden state, 16 tokens
ATT = (1, 12, 16, 16)  # BERT-base attention scores
HEADS = (1, 16, 12, 64)  # BERT-base hidden state split into heads
KEEP_AT = 1.15
JSON_OUT = os.path.join(os.path.dirname(__file__), "results", "torch_overrides.json")

_rng = np.random.default_rng(0)


def f32(shape, lo=-3.0, hi=3.0) -> np.ndarray:
    return _rng.uniform(lo, hi, shape).astype(np.float32)


def i64(*vals) -> np.ndarray:
    return np.array(vals, np.int64)


@dataclass
class Case:
    label: str
    inputs: list  # NumPy arrays (None: an optional input left out)
    attrs: dict = field(default_factory=dict)
    outputs: int = 1
    consts: tuple[int, ...] = ()  # inputs that are initializers (weights, shapes, axes)


# -- the cases, per op --------------------------------------------------------------------

_DOMAINS = {"Log": (0.1, 10.0), "Sqrt": (0.1, 10.0), "Reciprocal": (0.1, 10.0),
            "Acosh": (1.1, 10.0), "Asin": (-0.99, 0.99), "Acos": (-0.99, 0.99),
            "Atanh": (-0.99, 0.99), "Tan": (-1.2, 1.2)}
_UNARY_ATTRS = {"LeakyRelu": {"alpha": 0.1}, "Clip": {"min": 0.0, "max": 6.0},
                "HardSigmoid": {"alpha": 1 / 6, "beta": 0.5}}
_UNARY = ("Relu LeakyRelu ThresholdedRelu Elu Celu Selu Sigmoid HardSigmoid HardSwish "
          "Softplus Softsign Mish Abs Neg Ceil Floor Round Sign Sqrt Exp Log Sin Cos Tan "
          "Asin Acos Atan Sinh Cosh Tanh Asinh Acosh Atanh IsNaN Reciprocal IsInf "
          "Identity").split()
_BINARY = ("Add Sub Mul Div Pow Max Min Sum Mean Equal Greater Less GreaterOrEqual "
           "LessOrEqual").split()
_REDUCE = ("ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceSumSquare ReduceL1 "
           "ReduceL2 ReduceLogSum ReduceLogSumExp").split()


def cases_for(op: str, since: int) -> list[Case]:
    """Realistic inputs for ``op`` at the version registered from ``since``."""
    if op in _UNARY or (op == "Clip" and since < 11):
        lo, hi = _DOMAINS.get(op, (-3.0, 3.0))
        a = _UNARY_ATTRS.get(op, {})
        return [Case("act", [f32(ACT, lo, hi)], a), Case("seq", [f32(SEQ, lo, hi)], a)]
    if op == "Clip":
        lo, hi = np.float32(0), np.float32(6)
        return [Case("act relu6", [f32(ACT), lo, hi], consts=(1, 2)),
                Case("seq relu6", [f32(SEQ), lo, hi], consts=(1, 2))]
    if op in _BINARY:
        if op == "Pow":  # x ** 2 in decomposed LayerNorm / GELU
            two = np.float32(2.0)
            return [Case("act ** 2", [f32(ACT, 0.1, 3), two], consts=(1,)),
                    Case("seq ** 2", [f32(SEQ, 0.1, 3), two], consts=(1,))]
        lo = 0.5 if op == "Div" else -3.0
        return [Case("act . act", [f32(ACT), f32(ACT, lo, 3)]),
                Case("seq . bias", [f32(SEQ), f32(SEQ[-1:], lo, 3)], consts=(1,))]
    if op == "Mod":
        ints = _rng.integers(-1000, 1000, SEQ)
        return [Case("act fmod", [f32(ACT), f32(ACT, 0.5, 3)], {"fmod": 1}),
                Case("seq int64 %", [ints, np.full(SEQ, 7, np.int64)])]
    if op in ("And", "Or", "Xor"):
        return [Case("act bool", [f32(ACT) > 0, f32(ACT) > 0]),
                Case("seq bool", [f32(SEQ) > 0, f32(SEQ) > 0])]
    if op == "Not":
        return [Case("act bool", [f32(ACT) > 0]), Case("seq bool", [f32(SEQ) > 0])]
    if op == "Where":  # attention masking: a (1, 1, 16, 16) mask, a scalar fill
        mask = f32((1, 1, 16, 16)) > 0
        return [Case("att mask", [mask, f32(ATT), np.float32(-1e9)], consts=(2,)),
                Case("act", [f32(ACT) > 0, f32(ACT), f32(ACT)])]
    if op == "PRelu":
        return [Case("act", [f32(ACT), f32((64, 1, 1), 0, 0.5)], consts=(1,)),
                Case("seq", [f32(SEQ), f32((768,), 0, 0.5)], consts=(1,))]
    if op in ("Softmax", "LogSoftmax"):
        return [Case("att", [f32(ATT)], {"axis": 3 if since < 13 else -1}),
                Case("seq", [f32(SEQ)], {"axis": 2 if since < 13 else -1})]
    if op in _REDUCE:
        lo, hi = (0.98, 1.02) if op == "ReduceProd" else (0.5, 1.5)
        out = []
        for label, shape, axes in (("act spatial", ACT, [2, 3]), ("seq last", SEQ, [-1])):
            x = f32(shape, lo, hi)
            if since == 1:
                out.append(Case(label, [x], {"axes": axes, "keepdims": 1}))
            else:
                out.append(Case(label, [x, i64(*axes)], {"keepdims": 1}, consts=(1,)))
        return out
    if op in ("ArgMax", "ArgMin"):
        return [Case("act channels", [f32(ACT)], {"axis": 1, "keepdims": 1}),
                Case("seq last", [f32(SEQ)], {"axis": -1, "keepdims": 0})]
    if op == "MatMul":
        return [Case("seq x W", [f32(SEQ), f32((768, 768), -0.05, 0.05)], consts=(1,)),
                Case("q x kT", [f32((1, 12, 16, 64)), f32((1, 12, 64, 16))])]
    if op == "Gemm":
        return [Case("classifier", [f32((1, 512)), f32((1000, 512), -0.05, 0.05),
                                    f32((1000,))], {"transB": 1}, consts=(1, 2)),
                Case("seq ffn", [f32((16, 768)), f32((768, 3072), -0.05, 0.05),
                                 f32((3072,))], consts=(1, 2))]
    if op == "Gather":
        return [Case("embedding", [f32((1000, 768)), _rng.integers(0, 1000, (1, 16))],
                     consts=(0,)),
                Case("cls token", [f32(SEQ), np.array(0, np.int64)], {"axis": 1},
                     consts=(1,))]
    if op == "Reshape":
        return [Case("seq to heads", [f32(SEQ), i64(1, 16, 12, 64)], consts=(1,)),
                Case("act flatten", [f32(ACT), i64(1, -1)], consts=(1,))]
    if op == "Flatten":
        return [Case("act", [f32(ACT)], {"axis": 1}), Case("seq", [f32(SEQ)], {"axis": 1})]
    if op == "Transpose":
        return [Case("heads", [f32(HEADS)], {"perm": [0, 2, 1, 3]}),
                Case("act nhwc", [f32(ACT)], {"perm": [0, 2, 3, 1]})]
    if op in ("Squeeze", "Unsqueeze"):
        shape = (1, 1, 768) if op == "Squeeze" else (1, 768)
        axes = [1]
        if since < 13:
            return [Case("seq", [f32(shape)], {"axes": axes}),
                    Case("act", [f32(ACT)], {"axes": [0]})]
        return [Case("seq", [f32(shape), i64(*axes)], consts=(1,)),
                Case("act", [f32(ACT), i64(0)], consts=(1,))]
    if op == "Concat":
        return [Case("act channels", [f32((1, 32, 56, 56)), f32((1, 32, 56, 56))],
                     {"axis": 1}),
                Case("seq last", [f32((1, 16, 384)), f32((1, 16, 384))], {"axis": -1})]
    if op == "Split":  # QKV out of one projection; a channel split
        qkv = f32((1, 16, 2304))
        if since == 2:
            return [Case("qkv", [qkv], {"axis": -1, "split": [768] * 3}, outputs=3),
                    Case("act halves", [f32(ACT)], {"axis": 1}, outputs=2)]
        if since == 13:
            return [Case("qkv", [qkv, i64(768, 768, 768)], {"axis": -1}, 3, consts=(1,)),
                    Case("act halves", [f32(ACT)], {"axis": 1}, outputs=2)]
        return [Case("qkv", [qkv], {"axis": -1, "num_outputs": 3}, outputs=3),
                Case("act halves", [f32(ACT)], {"axis": 1, "num_outputs": 2}, outputs=2)]
    if op == "Slice":
        if since < 10:
            return [Case("seq half", [f32(SEQ)], {"starts": [0], "ends": [384], "axes": [2]}),
                    Case("act crop", [f32(ACT)], {"starts": [0, 0], "ends": [28, 28],
                                                  "axes": [2, 3]})]
        return [Case("seq half", [f32(SEQ), i64(0), i64(384), i64(2)], consts=(1, 2, 3)),
                Case("act crop", [f32(ACT), i64(0, 0), i64(28, 28), i64(2, 3)],
                     consts=(1, 2, 3))]
    if op == "Expand":
        return [Case("pos bias", [f32((1, 1, 768)), i64(1, 16, 768)], consts=(1,)),
                Case("act", [f32((1, 64, 1, 1)), i64(*ACT)], consts=(1,))]
    if op == "Tile":
        return [Case("seq", [f32(SEQ), i64(1, 2, 1)], consts=(1,)),
                Case("act", [f32((1, 16, 56, 56)), i64(1, 4, 1, 1)], consts=(1,))]
    raise KeyError(f"no benchmark case for {op} (opset {since}): add one")


# -- preparing and timing -----------------------------------------------------------------

def overrides() -> list[tuple[registry.OpDef, registry.OpDef, str]]:
    """``(version holding the torch kernel, live version, note)`` for every torch kernel on
    an op version with a generic kernel. The live version is the one ``lookup`` returns
    for the opset; when it is not the one holding the torch kernel, the plan never runs
    that kernel, and it is timed against the live generic kernel, which runs instead."""
    registry.load_backend("torch")
    out = []
    for d in registry.registered():
        if not (d.generic and "torch" in d.kernels):
            continue
        live = registry.lookup(d.domain, d.op_type, d.since)
        if live is d:
            out.append((d, d, ""))
        elif live is not None and live.generic and live.kernels.get("torch") \
                is not d.kernels["torch"]:
            out.append((d, live, "unreachable: lookup returns another version"))
    return sorted(out, key=lambda t: (t[0].op_type, t[0].since))


def prepare(opdef, kernel, case: Case, backend):
    """``kernel`` bound for a node like the plan's, as ``run(*tensors)``, or None."""
    ins = []
    for i, x in enumerate(case.inputs):
        if x is None:
            ins.append(None)
            continue
        ins.append(Value(f"in{i}", const=np.asarray(x) if i in case.consts else None))
    outs = [Value(f"out{i}") for i in range(case.outputs)]
    node = Node(opdef.op_type, ins, outs, dict(case.attrs), domain=opdef.domain,
                name=opdef.op_type)
    opset = opdef.since
    bound = kernel.bind(registry.Site(node, opset, dict(case.attrs), backend.target()))
    if bound is None:
        return None
    fn, wants_ctx = bound
    if wants_ctx:
        fn = functools.partial(fn, registry.KernelContext(case.outputs, opset, {}, node,
                                                          backend.target()))
    return fn


def tensors(case: Case) -> list:
    return [None if x is None else torch.from_numpy(np.ascontiguousarray(x))
            for x in case.inputs]


def _as_list(r) -> list:
    return list(r) if isinstance(r, (tuple, list)) else [r]


def agree(a, b) -> str:
    """'' when the outputs match, else why not."""
    a, b = _as_list(a), _as_list(b)
    if len(a) != len(b):
        return f"{len(a)} outputs vs {len(b)}"
    for x, y in zip(a, b):
        x, y = np.asarray(x.numpy()), np.asarray(y.numpy())
        if x.dtype != y.dtype:
            return f"dtype {x.dtype} vs {y.dtype}"
        try:
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
        except AssertionError as e:
            return " ".join(str(e).split())[:160]
    return ""


def per_call(fn, args, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter() - t0) / n


def time_pair(f_torch, f_gen, args, rounds: int, block_s: float) -> tuple[float, float]:
    """Best-of-``rounds`` seconds per call of each, blocks alternating (order swapped
    every round), each block ``block_s`` long or one call."""
    for _ in range(3):
        f_torch(*args)
        f_gen(*args)
    n = max(1, int(block_s / max(per_call(f_torch, args, 3), per_call(f_gen, args, 3))))
    best = [math.inf, math.inf]
    fns = (f_torch, f_gen)
    for r in range(rounds):
        order = (0, 1) if r % 2 == 0 else (1, 0)
        for k in order:
            best[k] = min(best[k], per_call(fns[k], args, n))
    return best[0], best[1]


# -- the machine --------------------------------------------------------------------------

def machine() -> dict:
    model = platform.processor() or platform.machine()
    flags: set[str] = set()
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        m = re.search(r"^Model name:\s*(.+)$", out, re.M)
        model = m.group(1).strip() if m else model
        m = re.search(r"^Flags:\s*(.+)$", out, re.M)
        flags = set(m.group(1).split()) if m else set()
    except (OSError, subprocess.CalledProcessError):
        pass
    return {"cpu": model, "avx2": "avx2" in flags, "avx512": "avx512f" in flags,
            "amx": "amx_tile" in flags,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "numpy": np.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-k", dest="ops", action="append", help="only this op (repeatable)")
    # Short blocks, many of them, in several sweeps minutes apart: on a busy machine a
    # 2-thread parallel region that loses a thread waits out a scheduler tick (4 ms); the
    # best short block over all sweeps misses those.
    ap.add_argument("--rounds", type=int, default=80, help="timed blocks per kernel a sweep")
    ap.add_argument("--sweeps", type=int, default=3, help="passes over all cases")
    ap.add_argument("--block-ms", type=float, default=0.2, help="length of one block")
    ap.add_argument("--json", default=JSON_OUT, help="where the table goes ('' for nowhere)")
    args = ap.parse_args(argv)

    torch.set_num_threads(THREADS)
    backend = TorchBackend()
    rows, todo, bad = [], [], []
    with torch.inference_mode():
        for d, live, note in overrides():
            if args.ops and d.op_type not in args.ops:
                continue
            for case in cases_for(d.op_type, d.since):
                row = {"op": d.op_type, "since": d.since, "case": case.label}
                if note:
                    row["note"] = note
                rows.append(row)
                f_t = prepare(d, d.kernels["torch"], case, backend)
                f_g = prepare(live, live.reference, case, backend)
                xs = tensors(case)
                if f_t is None or f_g is None:
                    row["skipped"] = "torch kernel declines the node" if f_t is None else \
                        "generic kernel declines the node"
                    continue
                if f_t(*xs) is NotImplemented:
                    row["skipped"] = "torch kernel returns NotImplemented (generic runs)"
                    continue
                why = agree(f_t(*xs), f_g(*xs))
                row["agree"] = not why
                if why:
                    bad.append(f"{d.op_type}-{d.since} {case.label}: {why}")
                todo.append((row, f_t, f_g, xs, [math.inf, math.inf]))
        for sweep in range(args.sweeps):
            print(f"sweep {sweep + 1}/{args.sweeps}", file=sys.stderr, flush=True)
            for _row, f_t, f_g, xs, best in todo:
                t_t, t_g = time_pair(f_t, f_g, xs, args.rounds, args.block_ms / 1e3)
                best[0], best[1] = min(best[0], t_t), min(best[1], t_g)
    gains: dict[tuple[str, int], list[float]] = {}
    notes: dict[tuple[str, int], str] = {}
    for row, _, _, _, (t_t, t_g) in todo:
        row.update(torch_us=round(t_t * 1e6, 2), generic_us=round(t_g * 1e6, 2),
                   gain=round(t_g / t_t, 3))
        gains.setdefault((row["op"], row["since"]), []).append(t_g / t_t)
        notes[(row["op"], row["since"])] = row.get("note", "")

    print(f"{'op':<20} {'case':<14} {'torch us':>9} {'generic us':>10} {'gain':>7}")
    for row in rows:
        name = f"{row['op']}-{row['since']}"
        if "skipped" in row:
            print(f"{name:<20} {row['case']:<14} {row['skipped']}")
            continue
        print(f"{name:<20} {row['case']:<14} {row['torch_us']:>9.1f} {row['generic_us']:>10.1f} "
              f"{row['gain']:>6.2f}x" + ("" if row["agree"] else "  DIFFERS"))
    summary = []
    print(f"\n{'op version':<20} {'best gain':>9} {'geomean':>8}")
    for (op, since), gs in gains.items():
        g, geo = max(gs), math.exp(sum(map(math.log, gs)) / len(gs))
        s = {"op": op, "since": since, "gain": round(g, 3), "gain_geomean": round(geo, 3),
             "over_threshold": g >= KEEP_AT}
        if notes[(op, since)]:
            s["note"] = notes[(op, since)]
        summary.append(s)
        print(f"{op + '-' + str(since):<20} {g:>8.2f}x {geo:>7.2f}x"
              + ("" if g >= KEEP_AT else f"   < {KEEP_AT}x") + f"  {s.get('note', '')}")
    for b in bad:
        print("DIFFERS:", b)
    if args.json:
        doc = {"date": datetime.date.today().isoformat(), "machine": machine(),
               "shapes": {"act": ACT, "seq": SEQ, "att": ATT, "heads": HEADS},
               "method": f"per call, best of {args.sweeps} sweeps x {args.rounds} alternating "
                         f"blocks of >= {args.block_ms} ms; float32 CPU tensors, "
                         "torch.inference_mode(); gain = generic / torch, an op version's "
                         "gain is its best case's",
               "keep_at": KEEP_AT, "summary": summary, "cases": rows, "differs": bad}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
