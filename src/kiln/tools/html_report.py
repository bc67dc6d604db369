"""``kiln.report``: one self-contained HTML page about a model: its graph drawn in run
order (colored by time when profiled; details on hover and click), time or FLOPs by op
type as a bar chart, and the ``inspect`` summary. No network: CSS, JS and SVG are inline.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.ir import DType, Graph, Model
from kiln.runtime.run_settings import default_backend_name
from kiln.tools._report_assets import CSS, JS
from kiln.tools.common import (
    dims_of,
    dtype_name,
    fmt_dims,
    load_model,
    model_name,
    session_for,
    type_name,
)
from kiln.tools.profiling import Profile
from kiln.tools.profiling import profile as run_profile
from kiln.tools.summary import ModelSummary, inspect

BOX_W, BOX_H = 168, 46
GAP_X, GAP_Y = 28, 42
MARGIN = 24
IO_H = 26

# Op families for the unprofiled coloring: (fill, ops).
_FAMILIES: list[tuple[str, str, frozenset[str]]] = [
    ("conv", "#c6dbef", frozenset("Conv ConvTranspose FusedConv QLinearConv ConvInteger "
                                  "DeformConv".split())),
    ("matmul", "#dadaeb", frozenset("MatMul Gemm FusedGemm FusedMatMul MatMulInteger "
                                    "QLinearMatMul Einsum Attention".split())),
    ("norm", "#fdd0a2", frozenset("BatchNormalization LayerNormalization LayerNorm "
                                  "InstanceNormalization GroupNormalization LRN Softmax "
                                  "LogSoftmax RMSNormalization".split())),
    ("pool", "#c7e9c0", frozenset("MaxPool AveragePool GlobalAveragePool GlobalMaxPool "
                                  "LpPool Resize Upsample".split())),
    ("activation", "#fcfbb4", frozenset("Relu Sigmoid Tanh Clip LeakyRelu PRelu Gelu "
                                        "HardSigmoid HardSwish Elu Selu Softplus Mish "
                                        "Swish Erf".split())),
    ("shape", "#e5e5e5", frozenset("Reshape Transpose Flatten Squeeze Unsqueeze Shape "
                                   "Gather Slice Concat Split Expand Constant Cast "
                                   "ConstantOfShape Identity Range Tile Pad".split())),
    ("control", "#f4c2d7", frozenset("If Loop Scan".split())),
]
_OTHER_FILL = "#ffffff"


@dataclass
class Box:
    """Where one node (or graph input/output) is drawn."""

    x: float
    y: float
    row: int


def layout(graph: Graph) -> tuple[list[Box], list[tuple[int, int, str]], dict[str, Box],
                                  dict[str, Box], float, float]:
    """A layered drawing of ``graph``: a node's row is the longest path to it from the
    graph inputs, and within a row nodes go under the mean x of what they read, pushed
    right so as not to overlap. Nodes that depend on no input (Constant, weights made by
    ConstantOfShape...) sit just above their first reader, over their readers.

    Returns (node boxes in run order, edges (src, dst, value name) between node indexes;
    src -1 stands for a graph input, dst -1 for a graph output), input boxes, output
    boxes, width, height."""
    nodes = graph.nodes
    prod: dict[Any, int] = {}
    for i, n in enumerate(nodes):
        for v in n.outputs:
            if v is not None:
                prod[v] = i
    preds: list[list[int]] = []
    edges: list[tuple[int, int, str]] = []
    input_names = {v: v.name for v in graph.inputs}
    input_reads: dict[str, list[int]] = {v.name: [] for v in graph.inputs}
    for j, n in enumerate(nodes):
        reads = [v for v in n.inputs if v is not None]
        for sg in n.subgraphs():
            reads.extend(sg.captures())
        ps = []
        for v in dict.fromkeys(reads):
            if v in prod and prod[v] < j:
                ps.append(prod[v])
                edges.append((prod[v], j, v.name))
            elif v in input_names:
                input_reads[v.name].append(j)
        preds.append(sorted(set(ps)))
    row = [0] * len(nodes)
    for j in range(len(nodes)):
        row[j] = 1 + max((row[i] for i in preds[j]), default=0)
    consumers: list[list[int]] = [[] for _ in nodes]
    for j, ps in enumerate(preds):
        for i in ps:
            consumers[i].append(j)
    reads_input = {j for js in input_reads.values() for j in js}
    # Nodes that depend on no graph input (Constant, weights built by ConstantOfShape...)
    # go as low as they can: just above their first reader, not in a pile at the top.
    live = [False] * len(nodes)
    for j in range(len(nodes)):
        live[j] = j in reads_input or any(live[i] for i in preds[j])
    for j in reversed(range(len(nodes))):
        if not live[j] and consumers[j]:
            row[j] = max(1, min(row[c] for c in consumers[j]) - 1)
    step_x = BOX_W + GAP_X
    xs: dict[str, float] = {}
    for k, name in enumerate(input_reads):
        xs[name] = k * step_x
    x = [0.0] * len(nodes)
    by_row: dict[int, list[int]] = {}
    for j, r in enumerate(row):
        by_row.setdefault(r, []).append(j)
    reads_of = {j: [xs[nm] for nm, js in input_reads.items() if j in js] for j in reads_input}
    hint = [0.0] * len(nodes)  # where a node that depends on no input would like to be

    def place(everything: bool) -> None:
        for r in sorted(by_row):
            want = []
            for j in by_row[r]:
                if live[j]:
                    src = [x[i] for i in preds[j] if live[i]] or reads_of.get(j, [])
                    want.append((sum(src) / len(src) if src else 0.0, j))
                elif everything:
                    want.append((hint[j], j))
            want.sort()
            last = None
            for w, j in want:
                x[j] = w if last is None else max(w, last + step_x)
                last = x[j]

    # First the data path, then the constant-producing nodes over their readers.
    place(False)
    for j in reversed(range(len(nodes))):
        if not live[j] and consumers[j]:
            cs = [x[c] if live[c] else hint[c] for c in consumers[j]]
            hint[j] = sum(cs) / len(cs)
    place(True)
    n_rows = max(row, default=0) + 2
    out_boxes: dict[str, Box] = {}
    for v in graph.outputs:
        src = prod.get(v)
        ox = x[src] if src is not None else 0.0
        taken = [b.x for b in out_boxes.values()]
        while any(abs(ox - t) < step_x for t in taken):
            ox += step_x
        out_boxes[v.name] = Box(ox, 0.0, n_rows - 1)
        if src is not None:
            edges.append((src, -1, v.name))
    lo = min([*x, *xs.values(), *(b.x for b in out_boxes.values())], default=0.0)
    step_y = BOX_H + GAP_Y
    boxes = [Box(x[j] - lo + MARGIN, row[j] * step_y + MARGIN, row[j]) for j in range(len(nodes))]
    in_boxes = {nm: Box(xs[nm] - lo + MARGIN, MARGIN + (BOX_H - IO_H) / 2, 0) for nm in xs}
    for b in out_boxes.values():
        b.x, b.y = b.x - lo + MARGIN, (n_rows - 1) * step_y + MARGIN + (BOX_H - IO_H) / 2
    width = max([b.x for b in [*boxes, *in_boxes.values(), *out_boxes.values()]],
                default=0.0) + BOX_W + MARGIN
    height = n_rows * step_y + MARGIN
    return boxes, edges, in_boxes, out_boxes, width, height


def _family(op: str) -> tuple[str, str]:
    for fam, fill, ops in _FAMILIES:
        if op in ops:
            return fam, fill
    return "other", _OTHER_FILL


def _heat(t: float) -> str:
    """A color from pale yellow (t=0) through orange to dark red (t=1)."""
    stops = [(255, 247, 220), (253, 174, 97), (215, 48, 39), (128, 0, 38)]
    t = min(max(t, 0.0), 1.0) * (len(stops) - 1)
    k = min(int(t), len(stops) - 2)
    f = t - k
    c = [round(a + (b - a) * f) for a, b in zip(stops[k], stops[k + 1])]
    return "#" + "".join(f"{v:02x}" for v in c)


def _dark(hex_color: str) -> bool:
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return 0.299 * r + 0.587 * g + 0.114 * b < 140


def _e(s: Any) -> str:
    return html.escape(str(s), quote=True)


def _short(s: str, n: int) -> str:
    return s if len(s) <= n else s[:n - 1] + "…"


def _ms(x: float) -> str:
    return f"{x:.3f} ms" if x < 10 else f"{x:.1f} ms"


def _human(n: float, unit: str = "") -> str:
    for k, s in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= k:
            return f"{n / k:.2f} {s}{unit}"
    return f"{n:g} {unit}".strip()


def _svg_graph(graph: Graph, summary: ModelSummary, prof: Profile | None) -> str:
    boxes, edges, in_boxes, out_boxes, width, height = layout(graph)
    max_share = max((prof.share(x) for x in prof.layers), default=0.0) if prof else 0.0
    parts = [f'<svg id="graph" xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" '
             f'height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}" '
             f'data-width="{width:.0f}" data-height="{height:.0f}">',
             '<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="9" '
             'markerHeight="9" markerUnits="userSpaceOnUse" orient="auto-start-reverse">'
             '<path d="M 0 0 L 10 5 L 0 10 z" fill="#8a8a8a"/></marker></defs>',
             '<g class="edges">']
    shapes = {o.name: fmt_dims(o.shape) for layer in summary.layers for o in layer.outputs}
    for v in [*graph.inputs, *graph.outputs]:
        shapes.setdefault(v.name, fmt_dims(v.shape))

    def anchor_out(i: int, name: str) -> tuple[float, float]:
        if i == -1:
            b = in_boxes[name]
            return b.x + BOX_W / 2, b.y + IO_H
        return boxes[i].x + BOX_W / 2, boxes[i].y + BOX_H

    step_y = BOX_H + GAP_Y

    def path(x1, y1, x2, y2) -> str:
        dy = max((y2 - y1) / 2, 20)
        if y2 - y1 > step_y and abs(x2 - x1) < BOX_W:
            # Skips rows straight down: bow out to the right so boxes in between don't hide it.
            off = BOX_W * 0.75 + min(60.0, 4 * (y2 - y1) / step_y)
            dy = min(dy, step_y)
            return f"M {x1:.1f} {y1:.1f} C {x1 + off:.1f} {y1 + dy:.1f} " \
                   f"{x2 + off:.1f} {y2 - dy:.1f} {x2:.1f} {y2:.1f}"
        return f"M {x1:.1f} {y1:.1f} C {x1:.1f} {y1 + dy:.1f} {x2:.1f} {y2 - dy:.1f} " \
               f"{x2:.1f} {y2:.1f}"

    for src, dst, name in edges:
        x1, y1 = anchor_out(src, name)
        if dst == -1:
            b = out_boxes[name]
            x2, y2 = b.x + BOX_W / 2, b.y
        else:
            x2, y2 = boxes[dst].x + BOX_W / 2, boxes[dst].y
        parts.append(f'<path class="edge" data-src="{src}" data-dst="{dst}" '
                     f'd="{path(x1, y1, x2, y2)}" marker-end="url(#arrow)">'
                     f'<title>{_e(name)} {_e(shapes.get(name, ""))}</title></path>')
    for j, n in enumerate(graph.nodes):
        for v in n.inputs:
            if v is not None and v.name in in_boxes:
                x1, y1 = anchor_out(-1, v.name)
                parts.append(f'<path class="edge" data-src="-1" data-dst="{j}" '
                             f'd="{path(x1, y1, boxes[j].x + BOX_W / 2, boxes[j].y)}" '
                             f'marker-end="url(#arrow)"><title>{_e(v.name)} '
                             f'{_e(shapes.get(v.name, ""))}</title></path>')
    parts.append('</g><g class="io">')
    for title, group in (("input", in_boxes), ("output", out_boxes)):
        for name, b in group.items():
            parts.append(f'<g class="io-box {title}" transform="translate({b.x:.1f},{b.y:.1f})">'
                         f'<title>{title} {_e(name)} {_e(shapes.get(name, ""))}</title>'
                         f'<rect width="{BOX_W}" height="{IO_H}" rx="13"/>'
                         f'<text x="{BOX_W / 2}" y="17">{_e(_short(name, 24))}</text></g>')
    parts.append('</g><g class="nodes">')
    for j, (n, b) in enumerate(zip(graph.nodes, boxes)):
        info = summary.layers[j]
        shape = fmt_dims(info.outputs[0].shape) if info.outputs else ""
        line2 = shape
        if prof is not None and j < len(prof.layers):
            lt = prof.layers[j]
            share = prof.share(lt)
            fill = _heat((share / max_share) ** 0.5 if max_share > 0 else 0.0)
            line2 = f"{_ms(lt.mean_ms)} · {share * 100:.1f}%"
            fam = "timed"
        else:
            fam, fill = _family(n.op_type)
        ink = "#ffffff" if _dark(fill) else "#1a1a1a"
        cls = "node" + ("" if info.supported else " unsupported")
        tip = f"{info.name}\n{n.op_type}  {shape}"
        if prof is not None and j < len(prof.layers):
            tip += f"\n{line2}"
        parts.append(
            f'<g class="{cls}" data-index="{j}" data-family="{fam}" '
            f'transform="translate({b.x:.1f},{b.y:.1f})"><title>{_e(tip)}</title>'
            f'<rect class="layer" width="{BOX_W}" height="{BOX_H}" rx="5" fill="{fill}"/>'
            f'<text class="op" x="{BOX_W / 2}" y="18" fill="{ink}">'
            f'{_e(_short(n.op_type, 22))}</text>'
            f'<text class="sub" x="{BOX_W / 2}" y="35" fill="{ink}">'
            f'{_e(_short(line2, 28))}</text></g>')
    parts.append("</g></svg>")
    return "".join(parts)


# Width of a character of the chart's 12px text, on the generous side (digits are about
# 6.7px in common sans fonts) so the value after the longest bar is not cut off; the page's
# script then fits the drawing to the text as the browser measured it.
_CHAR_W = 7.5


def _bar_chart(rows: list[tuple[str, float, str]], title: str) -> str:
    """Horizontal bars: (label, value, value text)."""
    if not rows:
        return f'<p class="muted">{_e(title)}: nothing to show.</p>'
    top = max(v for _, v, _ in rows) or 1.0
    label_w, bar_w, row_h = 190, 420, 22
    h = row_h * len(rows) + 10
    # Room right of the bars for the widest "value text", which follows its bar's end.
    width = max(label_w + bar_w * v / top + 6 + _CHAR_W * len(text) for _, v, text in rows)
    width = int(max(width, label_w + bar_w) + 8)
    out = [f'<svg class="bars" xmlns="http://www.w3.org/2000/svg" width="{width}"'
           f' height="{h}" viewBox="0 0 {width} {h}" role="img" aria-label="{_e(title)}">']
    for k, (label, v, text) in enumerate(rows):
        y = 5 + k * row_h
        w = max(1.0, bar_w * v / top)
        out.append(f'<g class="bar"><title>{_e(label)}: {_e(text)}</title>'
                   f'<text class="bar-label" x="{label_w - 8}" y="{y + 15}">'
                   f'{_e(_short(label, 26))}</text>'
                   f'<rect x="{label_w}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" '
                   f'rx="2"/><text class="bar-value" x="{label_w + w + 6:.1f}" y="{y + 15}">'
                   f'{_e(text)}</text></g>')
    out.append("</svg>")
    return "".join(out)


def _table(head: list[str], rows: list[list[Any]], cls: str = "") -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _value_row(v) -> list[str]:
    if v is None:
        return ["(none)", "", ""]
    if v.is_const:
        return [v.name, dtype_name(DType.from_numpy(v.const.dtype)),
                fmt_dims(list(v.const.shape)) + " const"]
    return [v.name, type_name(v), fmt_dims(dims_of(v))]


def _node_data(graph: Graph, summary: ModelSummary, prof: Profile | None) -> list[dict]:
    data = []
    for j, info in enumerate(summary.layers):
        d = {"name": info.name, "op": info.op_type, "domain": info.domain,
             "inputs": [_value_row(v) for v in graph.nodes[j].inputs],
             "outputs": [[o.name, o.dtype, fmt_dims(o.shape)] for o in info.outputs],
             "attrs": info.attrs, "params": info.params, "flops": info.flops,
             "where": info.where, "how": info.how, "supported": info.supported}
        if prof is not None and j < len(prof.layers):
            lt = prof.layers[j]
            d.update(ms=lt.mean_ms, share=prof.share(lt), shape=lt.shape)
        data.append(d)
    return data


def render(graph: Graph, summary: ModelSummary, prof: Profile | None = None,
           title: str | None = None, note: str = "") -> str:
    """The report page for ``graph`` (nodes matching ``summary.layers`` one to one)."""
    title = title or summary.name
    stats = [("nodes", f"{len(graph.nodes)}"),
             ("parameters", f"{summary.params:,} ({_human(summary.param_bytes, 'B')})"),
             ("FLOPs (est.)", _human(summary.flops)), ("opset", str(summary.opset)),
             ("backend", f"{summary.backend} on {summary.device}")]
    if prof is not None:
        stats.append(("run time", f"{_ms(prof.wall_mean_ms)} (mean of {prof.runs})"))
    stat_html = "".join(f'<div class="stat"><span>{_e(k)}</span><b>{_e(v)}</b></div>'
                        for k, v in stats)
    if prof is not None:
        ops = prof.by_op()
        chart = _bar_chart([(o.op_type, o.ms, f"{_ms(o.ms)} · {o.share * 100:.1f}% · ×{o.count}")
                            for o in ops], "time by op type")
        chart_title = "Time by op type"
        legend = ('<div class="legend"><span>share of run time</span><span class="scale">'
                  '</span><span>0%</span><span>→ max</span></div>')
    else:
        per_op: dict[str, float] = {}
        for x in summary.layers:
            per_op[x.op_type] = per_op.get(x.op_type, 0) + (x.flops or 0)
        rows = sorted(per_op.items(), key=lambda kv: -kv[1])
        chart = _bar_chart([(k, v, _human(v, "FLOPs")) for k, v in rows if v > 0],
                           "estimated FLOPs by op type")
        chart_title = "Estimated FLOPs by op type (run with --profile for time)"
        legend = '<div class="legend">' + "".join(
            f'<span class="swatch" style="background:{fill}"></span><span>{fam}</span>'
            for fam, fill, _ in _FAMILIES) + \
            f'<span class="swatch" style="background:{_OTHER_FILL}"></span><span>other</span>' \
            '</div>'
    io_rows = [["input", t.name, t.dtype, fmt_dims(t.shape)] for t in summary.inputs] + \
              [["output", t.name, t.dtype, fmt_dims(t.shape)] for t in summary.outputs]
    hist = _table(["op", "count"], [[k, v] for k, v in summary.op_histogram.items()], "hist")
    extra = []
    if summary.unsupported:
        extra.append(f"<p class='warn'>Not supported on the {_e(summary.backend)} backend: "
                     f"{_e(', '.join(summary.unsupported))}</p>")
    for n in summary.notes + ([note] if note else []):
        extra.append(f"<p class='muted'>{_e(n)}</p>")
    slow = ""
    if prof is not None:
        slow = "<h2>Slowest layers</h2>" + _table(
            ["layer", "op", "output shape", "mean", "share"],
            [[x.name, x.op_type, fmt_dims(x.shape), _ms(x.mean_ms),
              f"{prof.share(x) * 100:.1f}%"] for x in prof.slowest(15)], "slow")
    data = json.dumps({"nodes": _node_data(graph, summary, prof), "profiled": prof is not None},
                      separators=(",", ":")).replace("</", "<\\/")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<link rel="icon" href="data:,">
<title>{_e(title)} · Kiln report</title>
<style>{CSS}</style></head>
<body>
<header><h1>{_e(title)}</h1><div class="stats">{stat_html}</div></header>
<main>
<section class="graph-area">
<div class="toolbar"><input id="search" type="search" placeholder="find layer or op (Enter)">
<button id="zoom-out" type="button" title="zoom out">−</button>
<button id="zoom-fit" type="button" title="fit width">fit</button>
<button id="zoom-in" type="button" title="zoom in">+</button>{legend}</div>
<div id="graph-scroll">{_svg_graph(graph, summary, prof)}</div>
</section>
<aside id="panel"><p class="muted">Click a layer to see its inputs, outputs and
attributes. Hover for a summary.</p></aside>
</main>
<section class="below">
<div><h2>{_e(chart_title)}</h2>{chart}{slow}</div>
<div><h2>Inputs and outputs</h2>{_table(["", "name", "dtype", "shape"], io_rows, "io")}
{''.join(extra)}
<h2>Ops</h2>{hist}</div>
</section>
<footer>Made by <code>kiln report</code>. Self-contained: no network needed.</footer>
<script type="application/json" id="kiln-data">{data}</script>
<script>{JS}</script>
</body></html>
"""


@dataclass
class HtmlReport:
    """What :func:`report` wrote: the file and a few facts about it (not the page itself,
    which is tens of kilobytes; read ``path`` for that)."""

    path: Path
    size_bytes: int
    model: str
    layers: int
    profiled: bool
    backend: str
    device: str

    def __fspath__(self) -> str:
        return str(self.path)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready fields (``path`` as a string)."""
        return {"path": str(self.path), "size_bytes": self.size_bytes, "model": self.model,
                "layers": self.layers, "profiled": self.profiled, "backend": self.backend,
                "device": self.device}


def report(model: Any, path: str | os.PathLike, profile: bool = False,
           backend: str | None = None, device: str | None = None, runs: int = 5,
           feeds: dict | None = None, dims: dict[str, int] | None = None,
           optimize: bool = True,
           on_stage: Callable[[str], None] | None = None) -> HtmlReport:
    """Write the HTML report of ``model`` to ``path``; returns an :class:`HtmlReport`
    saying where it is and what it shows (``render`` gives the page as a string).

    With ``profile=True`` the model is run ``runs`` times on ``backend`` (default: the
    default backend, torch when installed, else numpy) and the graph
    drawn is the one the session ran (optimized unless ``optimize`` is False), each layer
    colored by its share of the time. Without, the model is drawn as the file has it.
    ``on_stage(text)`` is called as each stage starts (for progress output).
    """
    stage = on_stage or (lambda text: None)
    backend = backend or default_backend_name()
    note = ""
    if profile:
        stage(f"building the {backend} session")
        sess = session_for(model, backend, device, optimize=optimize)
        stage(f"profiling {runs} run(s)")
        prof = run_profile(sess, feeds, runs=runs, dims=dims)
        prof.model = model_name(model)
        m: Model = sess.model
        if optimize:
            note = "The graph shown is the one Kiln ran, after its optimizer."
    else:
        stage("loading the model")
        prof, m = None, load_model(model)
    stage("drawing the graph")
    summary = inspect(m, backend=backend, device=device, dims=dims)
    summary.name = model_name(model)
    page = render(m.graph, summary, prof, note=note)
    out = Path(path)
    data = page.encode("utf-8")
    out.write_bytes(data)
    return HtmlReport(path=out, size_bytes=len(data), model=summary.name,
                      layers=len(m.graph.nodes), profiled=prof is not None,
                      backend=summary.backend, device=summary.device)
