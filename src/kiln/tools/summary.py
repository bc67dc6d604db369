"""``kiln.inspect``: what a model is made of, without running it."""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.ir import Graph, Model, Node, Value
from kiln.runtime.run_settings import default_backend_name
from kiln.tools.common import backend_options, dims_of, load_model, model_name, type_name
from kiln.tools.flops import layer_flops

log = logging.getLogger(__name__)


@dataclass
class TensorInfo:
    """A graph input, output or layer output: name, element type, dims (ints, symbol
    names, None for unknown; the whole list None when the rank is unknown)."""

    name: str
    dtype: str
    shape: list[int | str | None] | None


@dataclass
class LayerInfo:
    """One node of the main graph, in run order."""

    index: int
    name: str
    op_type: str
    domain: str
    inputs: list[str]
    outputs: list[TensorInfo]
    attrs: dict[str, str]
    params: int  # elements of the constant inputs it reads
    flops: int | None  # None: a shape it needs is unknown
    supported: bool = True
    where: str = ""  # "cpu", "cuda:0", "host"; "" when unsupported
    how: str = ""  # "numpy", "torch", "torch-generic", "cpu-fallback", "function"
    subgraph_nodes: int = 0  # nodes inside its If/Loop/Scan bodies


@dataclass
class ModelSummary:
    """Everything ``kiln inspect`` shows. ``to_dict()`` is the ``--json`` form."""

    name: str
    opset: int
    ir_version: int
    producer: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    layers: list[LayerInfo]
    op_histogram: dict[str, int]
    params: int
    param_bytes: int
    flops: int
    flops_unknown: list[str]  # layers whose FLOPs could not be estimated
    dim_sizes: dict[str, int]  # sizes assumed for symbolic dims in the FLOPs count
    backend: str
    device: str
    unsupported: list[str]  # "Op (opset N)" the backend cannot run
    placement: dict[str, int] = field(default_factory=dict)  # how -> layer count
    notes: list[str] = field(default_factory=list)

    @property
    def total_nodes(self) -> int:
        return sum(self.op_histogram.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tensor_info(v: Value) -> TensorInfo:
    return TensorInfo(v.name, type_name(v), dims_of(v))


def _fmt_attr(a: Any) -> str:
    if isinstance(a, Graph):
        return f"<graph {a.name or ''}: {len(a.nodes)} nodes>"
    if isinstance(a, np.ndarray):
        if a.size <= 8:
            return f"tensor{list(a.shape)} {a.ravel().tolist()}"
        return f"tensor{list(a.shape)} {a.dtype}"
    if isinstance(a, list) and a and isinstance(a[0], Graph):
        return f"<{len(a)} graphs>"
    s = repr(a) if isinstance(a, str) else str(a)
    return s if len(s) <= 120 else s[:117] + "..."


def _count_params(g: Graph) -> tuple[int, int]:
    n = b = 0
    for v in g.initializers.values():
        n += int(v.const.size)
        b += int(v.const.nbytes)
    for node in g.nodes:
        for sub in node.subgraphs():
            sn, sb = _count_params(sub)
            n, b = n + sn, b + sb
    return n, b


def infer_shapes(model: Model) -> str | None:
    """Annotate value types with Kiln's shape inference when it is available; returns a
    note when it is not or when it fails (the IR's own types are shown then)."""
    try:
        from kiln.passes.infer_shapes import infer_model
    except ImportError:
        return "shape inference unavailable: showing the shapes the model file declares"
    try:
        infer_model(model)
    except Exception as e:  # inference is a nicety here: show what the file declares
        log.debug("shape inference failed", exc_info=True)
        return f"shape inference stopped early ({type(e).__name__}: {e})"
    return None


def placements(model: Model, backend: str | None = None, device: str | None = None
               ) -> tuple[dict[Node, tuple[str, str]], list[str], str, str | None]:
    """Where each main-graph node would run: ({node: (where, how)}, unsupported ops,
    device, note). Builds the plan the way a session does, but never raises for
    missing ops: those nodes are simply absent from the mapping."""
    from kiln.runtime import make_backend
    from kiln.runtime.plan import plan_graph

    backend = backend or default_backend_name()
    be = make_backend(backend, **backend_options(backend, device))
    chosen: dict[Node, tuple[str, str]] = {}
    note, missing_ops = None, []
    try:
        plan, missing_ops = plan_graph(model.graph, model.opset_imports, model.functions, be)
        for s in plan.steps:
            if s.fn is not None:
                chosen[s.node] = (s.layer.where, s.layer.how)
    except KilnError:
        raise
    except Exception as e:  # a kernel's prepare choking on a node: still list what is known
        note = f"placement incomplete: {type(e).__name__}: {e}"
    missing = [f"{d + '.' if d else ''}{o} (opset {v})" for d, o, v in missing_ops]
    return chosen, missing, be.device, note


def inspect(model: Any, backend: str | None = None, device: str | None = None,
            dims: dict[str, int] | None = None) -> ModelSummary:
    """Summarize ``model`` (path, zoo name, ModelProto, bytes or Model): inputs, outputs,
    layers in run order with output shapes, op histogram, parameters, estimated FLOPs
    (symbolic dims sized by ``dims``, default 1), and which ops ``backend`` (default: the default
    backend, torch when installed, else numpy)
    cannot run and where each layer would run on ``device``.

    A Model passed in gets its value types refined in place by shape inference."""
    m = load_model(model)
    backend = backend or default_backend_name()
    notes = [n for n in [infer_shapes(m)] if n]
    chosen, missing, dev, note = placements(m, backend, device)
    if note:
        notes.append(note)
    sizes = dict(dims or {})
    g = m.graph
    layers: list[LayerInfo] = []
    unknown_flops = []
    for i, n in enumerate(g.nodes):
        where, how = chosen.get(n, ("", "unsupported"))
        fl = layer_flops(n, sizes, m.opset_of(n.domain))
        name = n.name or f"{n.op_type}_{i}"
        if fl is None:
            unknown_flops.append(name)
        sub = sum(sum(1 for _ in sg.walk()) for sg in n.subgraphs())
        layers.append(LayerInfo(
            index=i, name=name, op_type=n.op_type, domain=n.domain,
            inputs=[v.name if v is not None else "" for v in n.inputs],
            outputs=[_tensor_info(v) for v in n.outputs if v is not None],
            attrs={k: _fmt_attr(a) for k, a in n.attrs.items()},
            params=sum(int(v.const.size) for v in n.inputs if v is not None and v.is_const),
            flops=fl, supported=n in chosen, where=where, how=how, subgraph_nodes=sub))
    hist = Counter((f"{n.domain}." if n.domain else "") + n.op_type for _, n in g.walk())
    params, nbytes = _count_params(g)
    syms = sorted({d for v in g.inputs for d in (dims_of(v) or []) if isinstance(d, str)})
    return ModelSummary(
        name=model_name(model), opset=m.opset, ir_version=m.ir_version,
        producer=" ".join(p for p in (m.producer_name, m.producer_version) if p),
        inputs=[_tensor_info(v) for v in g.inputs],
        outputs=[_tensor_info(v) for v in g.outputs], layers=layers,
        op_histogram=dict(hist.most_common()), params=params, param_bytes=nbytes,
        flops=sum(x.flops or 0 for x in layers), flops_unknown=unknown_flops,
        dim_sizes={s: sizes.get(s, 1) for s in syms}, backend=backend, device=dev,
        unsupported=missing, placement=dict(Counter(x.how for x in layers)), notes=notes)
