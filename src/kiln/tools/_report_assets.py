"""The inline CSS and JavaScript of the HTML report (kept here so the page needs no
package data files and no network)."""

CSS = r"""
:root { --ink: #1a1a1a; --muted: #6b6b6b; --line: #d0d0d0; --accent: #1f6feb; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       color: var(--ink); background: #fafafa; }
header { padding: 14px 20px 8px; background: #fff; border-bottom: 1px solid var(--line); }
h1 { margin: 0 0 8px; font-size: 20px; }
h2 { font-size: 15px; margin: 18px 0 8px; }
.stats { display: flex; flex-wrap: wrap; gap: 8px 22px; }
.stat span { color: var(--muted); margin-right: 6px; }
main { display: grid; grid-template-columns: minmax(0, 1fr) 340px; gap: 0;
       border-bottom: 1px solid var(--line); }
.graph-area { min-width: 0; background: #fff; }
.toolbar { display: flex; align-items: center; flex-wrap: wrap; gap: 6px; padding: 6px 10px;
           border-bottom: 1px solid var(--line); }
.toolbar input { width: 220px; padding: 3px 6px; }
.toolbar button { min-width: 30px; padding: 2px 8px; }
.legend { display: flex; align-items: center; gap: 5px; margin-left: 12px;
          color: var(--muted); font-size: 12px; flex-wrap: wrap; }
.swatch { display: inline-block; width: 12px; height: 12px; border: 1px solid #999;
          border-radius: 2px; margin-left: 6px; }
.scale { display: inline-block; width: 120px; height: 10px; border: 1px solid #999;
         background: linear-gradient(90deg, #fff7dc, #fdae61, #d73027, #800026); }
#graph-scroll { overflow: auto; height: 72vh; min-height: 320px; }
#graph { display: block; }
.edge { fill: none; stroke: #a0a0a0; stroke-width: 1.2; }
.edge.hl { stroke: var(--accent); stroke-width: 2.4; }
.node { cursor: pointer; }
.node rect.layer { stroke: #555; stroke-width: 1; }
.node:hover rect.layer { stroke: var(--accent); stroke-width: 2; }
.node.selected rect.layer { stroke: var(--accent); stroke-width: 3.5; }
.node.match rect.layer { stroke: #9a6700; stroke-width: 3; }
.node.unsupported rect.layer { stroke: #cf222e; stroke-width: 2.5; stroke-dasharray: 5 3; }
.node text, .io-box text { text-anchor: middle; pointer-events: none;
                            font-family: system-ui, sans-serif; }
.node text.op { font-size: 13px; font-weight: 600; }
.node text.sub { font-size: 11px; }
.io-box rect { fill: #eef4ff; stroke: #6e8fcf; }
.io-box text { font-size: 12px; fill: #234; }
#panel { padding: 10px 14px; border-left: 1px solid var(--line); background: #fff;
         overflow: auto; height: calc(72vh + 38px); min-height: 358px; font-size: 13px; }
#panel h3 { margin: 2px 0 4px; font-size: 15px; word-break: break-all; }
#panel .op { color: var(--muted); margin-bottom: 8px; }
#panel table { width: 100%; }
#panel td:first-child { word-break: break-all; }
#panel td { overflow-wrap: anywhere; }
#panel td:nth-child(2) { white-space: nowrap; }
table { border-collapse: collapse; font-size: 13px; }
th, td { text-align: left; padding: 3px 8px; border-bottom: 1px solid #eee;
         vertical-align: top; }
th { color: var(--muted); font-weight: 600; }
.below { display: grid; grid-template-columns: minmax(0, 3fr) minmax(0, 2fr); gap: 24px;
         padding: 4px 20px 20px; }
.bars { display: block; max-width: 100%; height: auto; }
.bars .bar rect { fill: #e6550d; }
.bars text { font-size: 12px; fill: var(--ink); }
.bars .bar-label { text-anchor: end; }
.muted { color: var(--muted); }
.warn { color: #cf222e; font-weight: 600; }
footer { padding: 10px 20px; color: var(--muted); font-size: 12px; }
"""

JS = r"""
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("kiln-data").textContent);
  var svg = document.getElementById("graph");
  var scroller = document.getElementById("graph-scroll");
  var panel = document.getElementById("panel");
  var nodes = svg.querySelectorAll("g.node");
  var selected = null;
  var scale = 1;

  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function human(n) {
    var units = [[1e12, "T"], [1e9, "G"], [1e6, "M"], [1e3, "k"]];
    for (var i = 0; i < units.length; i++) {
      if (Math.abs(n) >= units[i][0]) return (n / units[i][0]).toFixed(2) + " " + units[i][1];
    }
    return String(n);
  }
  function table(head, rows) {
    var t = el("table"), tr = el("tr");
    head.forEach(function (h) { tr.appendChild(el("th", h)); });
    t.appendChild(tr);
    rows.forEach(function (r) {
      var row = el("tr");
      r.forEach(function (c) { row.appendChild(el("td", c)); });
      t.appendChild(row);
    });
    return t;
  }
  function show(i) {
    var d = data.nodes[i];
    if (!d) return;
    if (selected !== null) nodes[selected].classList.remove("selected");
    svg.querySelectorAll(".edge.hl").forEach(function (e) { e.classList.remove("hl"); });
    selected = i;
    nodes[i].classList.add("selected");
    svg.querySelectorAll('.edge[data-src="' + i + '"], .edge[data-dst="' + i + '"]')
      .forEach(function (e) { e.classList.add("hl"); });
    panel.textContent = "";
    panel.appendChild(el("h3", d.name));
    var op = (d.domain ? d.domain + "." : "") + d.op;
    panel.appendChild(el("div", op + "  ·  layer #" + i, "op"));
    var facts = [];
    if (data.profiled && d.ms !== undefined) {
      facts.push(["time", d.ms.toFixed(3) + " ms (" + (d.share * 100).toFixed(1) + "% of run)"]);
      if (d.shape) facts.push(["shape as run", "(" + d.shape.join(", ") + ")"]);
    }
    facts.push(["runs on", d.supported ? (d.where + " (" + d.how + ")") : "unsupported"]);
    facts.push(["parameters", d.params.toLocaleString()]);
    facts.push(["FLOPs (est.)", d.flops === null ? "unknown" : human(d.flops)]);
    panel.appendChild(table(["", ""], facts));
    panel.appendChild(el("h4", "inputs"));
    panel.appendChild(table(["name", "dtype", "shape"], d.inputs));
    panel.appendChild(el("h4", "outputs"));
    panel.appendChild(table(["name", "dtype", "shape"], d.outputs));
    var keys = Object.keys(d.attrs);
    panel.appendChild(el("h4", "attributes"));
    if (keys.length) {
      var rows = keys.map(function (k) { return [k, d.attrs[k]]; });
      panel.appendChild(table(["name", "value"], rows));
    } else {
      panel.appendChild(el("p", "none", "muted"));
    }
  }
  function reveal(i) {
    var b = nodes[i].getBoundingClientRect(), s = scroller.getBoundingClientRect();
    scroller.scrollLeft += b.left - s.left - s.width / 2 + b.width / 2;
    scroller.scrollTop += b.top - s.top - s.height / 2 + b.height / 2;
  }
  svg.addEventListener("click", function (ev) {
    var g = ev.target.closest("g.node");
    if (g) show(Number(g.getAttribute("data-index")));
  });
  var matches = [], cursor = -1;
  document.getElementById("search").addEventListener("keydown", function (ev) {
    if (ev.key !== "Enter") return;
    var q = ev.target.value.trim().toLowerCase();
    nodes.forEach(function (n) { n.classList.remove("match"); });
    if (!q) return;
    if (ev.target.dataset.q !== q) {
      ev.target.dataset.q = q;
      matches = [];
      data.nodes.forEach(function (d, i) {
        if (d.name.toLowerCase().indexOf(q) >= 0 || d.op.toLowerCase() === q) matches.push(i);
      });
      cursor = -1;
    }
    matches.forEach(function (i) { nodes[i].classList.add("match"); });
    if (!matches.length) return;
    cursor = (cursor + 1) % matches.length;
    show(matches[cursor]);
    reveal(matches[cursor]);
  });
  function zoom(z) {
    scale = Math.min(4, Math.max(0.05, z));
    svg.setAttribute("width", Number(svg.dataset.width) * scale);
    svg.setAttribute("height", Number(svg.dataset.height) * scale);
  }
  function on(id, fn) { document.getElementById(id).addEventListener("click", fn); }
  on("zoom-in", function () { zoom(scale * 1.25); });
  on("zoom-out", function () { zoom(scale / 1.25); });
  on("zoom-fit", function () {
    zoom((scroller.clientWidth - 4) / Number(svg.dataset.width));
  });
  // Fit each bar chart's drawing to its text as this browser's font measured it: the
  // width computed in Python is an estimate, and a value after the longest bar must not
  // be cut off. (CSS then scales the chart down to its column when that is narrower.)
  Array.prototype.forEach.call(document.querySelectorAll("svg.bars"), function (bars) {
    var vb = bars.viewBox.baseVal;
    if (!vb || !vb.width) { return; }
    var lo = vb.x, hi = vb.x + vb.width;
    Array.prototype.forEach.call(bars.querySelectorAll("text"), function (t) {
      var b = t.getBBox();
      lo = Math.min(lo, Math.floor(b.x) - 2);
      hi = Math.max(hi, Math.ceil(b.x + b.width) + 2);
    });
    bars.setAttribute("viewBox", lo + " " + vb.y + " " + (hi - lo) + " " + vb.height);
    bars.setAttribute("width", String(hi - lo));
  });
  document.body.setAttribute("data-ready", String(nodes.length));
})();
"""
