"""Plain-text rendering of the tools' data objects for the terminal."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kiln.tools import BenchResult, ModelSummary, Profile
from kiln.tools.common import fmt_dims


def human(n: float, unit: str = "") -> str:
    """``1234567`` -> ``1.23 M``."""
    for k, s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= k:
            return f"{n / k:.2f} {s}{unit}"
    return f"{n:g} {unit}".rstrip()


def clip(s: str, n: int) -> str:
    """``s`` cut to ``n`` characters, keeping its end (layer names end in what they are)."""
    return s if len(s) <= n else "…" + s[-(n - 1):]


def table(head: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = (),
          indent: str = "  ") -> str:
    """Aligned columns; column indexes in ``right`` are right-aligned."""
    cells = [[str(c) for c in head]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = []
    for r in cells:
        parts = [c.rjust(w) if i in right else c.ljust(w)
                 for i, (c, w) in enumerate(zip(r, widths))]
        lines.append(indent + "  ".join(parts).rstrip())
    return "\n".join(lines)


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 100 else f"{x:.1f}"


def summary_text(s: ModelSummary, layers: bool = True) -> str:
    """``kiln inspect``'s text: I/O, layers (unless ``layers`` is False), totals, support."""
    head = [f"{s.name}  opset {s.opset} · ir {s.ir_version}"
            + (f" · {s.producer}" if s.producer else "")]
    out = head + ["", "inputs"]
    io = [[t.name, t.dtype, fmt_dims(t.shape)] for t in s.inputs]
    out.append(table(["name", "dtype", "shape"], io) if io else "  (none)")
    out += ["outputs", table(["name", "dtype", "shape"],
                             [[t.name, t.dtype, fmt_dims(t.shape)] for t in s.outputs])]
    if layers:
        out += ["", f"layers ({len(s.layers)}, in run order)"]
        rows = []
        for x in s.layers:
            shapes = "; ".join(fmt_dims(o.shape) for o in x.outputs)
            where = f"{x.where} {x.how}" if x.supported else "UNSUPPORTED"
            flops = "?" if x.flops is None else (human(x.flops) if x.flops else "")
            op = f"{x.domain}.{x.op_type}" if x.domain else x.op_type
            if x.subgraph_nodes:
                op += f" [+{x.subgraph_nodes} inside]"
            rows.append([x.index, clip(x.name, 40), op, shapes,
                         f"{x.params:,}" if x.params else "", flops, where])
        out.append(table(["#", "layer", "op", "output shape", "params", "FLOPs", "runs on"],
                         rows, right=(0, 4, 5)))
    out += ["", "ops: " + ", ".join(f"{k} {v}" for k, v in s.op_histogram.items())]
    out.append(f"parameters: {s.params:,} ({human(s.param_bytes, 'B')})")
    fl = f"FLOPs (estimated): {human(s.flops)} per run"
    if s.dim_sizes:
        fl += " with " + ", ".join(f"{k}={v}" for k, v in s.dim_sizes.items()) + \
              " (set with --dim NAME=N)"
    if s.flops_unknown:
        fl += f"; {len(s.flops_unknown)} layer(s) of unknown shape not counted"
    out.append(fl)
    out.append(f"backend: {s.backend} on {s.device}: "
               + ", ".join(f"{v} {k}" for k, v in sorted(s.placement.items())))
    if s.unsupported:
        out.append(f"unsupported on {s.backend}: " + ", ".join(s.unsupported))
    else:
        out.append(f"every op is supported on {s.backend}")
    out += [f"note: {n}" for n in s.notes]
    return "\n".join(out)


def profile_text(p: Profile, top: int = 0) -> str:
    """``kiln profile``'s text: every layer (or the ``top`` slowest), then totals by op."""
    total = p.layer_total_ms
    out = [f"{p.model} on {p.backend} ({p.device}): {p.runs} run(s) after {p.warmup} warm-up; "
           f"mean run {_ms(p.wall_mean_ms)} ms, of which {_ms(total)} ms in layers"]
    layers = p.slowest(top) if top else p.layers
    out += ["", f"{'slowest ' + str(top) + ' ' if top else ''}layers"
            + ("" if top else " in run order")]
    rows = [[x.index, clip(x.name, 40), x.op_type, fmt_dims(x.shape),
             "once" if x.once else _ms(x.mean_ms), f"{p.share(x) * 100:.1f}"] for x in layers]
    out.append(table(["#", "layer", "op", "output shape", "mean ms", "%"], rows,
                     right=(0, 4, 5)))
    out += ["", "by op type"]
    rows = [[o.op_type, o.count, _ms(o.ms), f"{o.share * 100:.1f}"] for o in p.by_op()]
    rows.append(["total", len(p.layers), _ms(total), "100.0"])
    out.append(table(["op", "layers", "mean ms", "%"], rows, right=(1, 2, 3)))
    once = sum(x.once for x in p.layers)
    if once:
        out.append(f"{once} layer(s) depend only on the input shapes: they ran once for "
                   "these shapes and are skipped by every later run (\"once\")")
    return "\n".join(out)


def run_words(precision: str | None, compiled: bool) -> list[str]:
    """How a torch session ran, as ``run`` and ``bench`` say it: its precision unless fp32,
    and "compiled" when the run was a compiled program."""
    return ([precision] if precision not in (None, "fp32") else []) \
        + (["compiled"] if compiled else [])


def bench_text(b: BenchResult) -> str:
    """``kiln bench``'s text: percentiles per engine, then the Kiln / other ratio in words."""
    out = [f"{b.model}: batch {b.batch}, {b.threads} thread(s), {len(b.kiln.latencies_ms)} "
           f"run(s) after {b.warmup} warm-up" + (", alternating" if b.other else "")]
    stats = [b.kiln] + ([b.other] if b.other else [])
    rows = []
    for st in stats:
        how = [b.backend, b.device] + run_words(b.precision,
                                                b.compile_status.startswith("yes"))
        label = f"kiln ({', '.join(how)})" if st is b.kiln else st.engine
        rows.append([label, _ms(st.p50), _ms(st.p90), _ms(st.p99), _ms(st.mean),
                     f"{st.throughput:,.1f}"])
    out.append(table(["engine", "p50 ms", "p90 ms", "p99 ms", "mean ms", "samples/s"], rows,
                     right=(1, 2, 3, 4, 5)))
    words = b.comparison()  # Kiln / other, as everywhere in Kiln's docs
    if words is not None:
        out.append(words)
    if b.compile_status and not b.compile_status.startswith("yes"):
        out.append(f"--compile: {b.compile_status}")
    return "\n".join(out)


def array_summary(name: str, x: Any) -> list[str]:
    """One row describing an output: name, dtype, shape, min, max, mean."""
    if isinstance(x, list):
        return [name, "sequence", f"[{len(x)}]", "", "", ""]
    if x is None:
        return [name, "none", "", "", "", ""]
    a = np.asarray(x)
    row = [name, str(a.dtype), fmt_dims(list(a.shape))]
    if a.size and (a.dtype.kind in "biuf"):
        v = a.astype(np.float64)
        row += [f"{v.min():.6g}", f"{v.max():.6g}", f"{v.mean():.6g}"]
    else:
        row += ["", "", ""]
    return row
