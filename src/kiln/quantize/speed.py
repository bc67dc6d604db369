"""Speed-aware quantization: a layer stays quantized only where its integer version is
measured faster than its float version, on the target backend and this machine.

Each quantized Conv/ConvTranspose/MatMul/Gemm is cut out twice with ``kiln.edit.cut``:
from the float model (the layer, and the bias Add / Relu / Clip sharing its grid) and
from the quantized one (the same span with its Q/DQ nodes: quantizing its input,
dequantizing its output, which is what reverting it saves). Both run on the layer's real
input (the float model run on the first feed), on ``backend`` (a Kiln backend or
onnxruntime), so the quantized cut is fused into the integer kernel exactly as in the
whole model; the times are best-of ``runs``, the two versions taking turns. Then the
whole model, float against what is left quantized (:func:`whole_model_ms`): layers timed
alone miss the Q/DQ a reverted neighbour adds between them (silero's sequence VAD kept 3
of 6 layers, each faster alone, and ran slower than the float model on torch). Both
are timed on the feed as given and, where it holds many samples, on one sample of it
(:func:`one_sample`): a decision made at the calibration batch alone does not hold at
batch 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kiln.edit import cut
from kiln.ir import Model, Node
from kiln.quantize.calibrate import session_with
from kiln.quantize.engines import open_session

__all__ = ["LayerTiming", "one_sample", "slowest", "time_layers", "whole_model_ms"]


@dataclass
class LayerTiming:
    """Measured time of one layer in float and quantized (best of runs, ms)."""

    float_ms: float
    quant_ms: float

    @property
    def faster(self) -> bool:
        """Whether the quantized version was measured faster."""
        return self.quant_ms < self.float_ms


def _chain_end(n: Node, quantized_names: set[str]):
    """The last value of the span a layer's grid covers: its output, through a constant
    bias Add and a Relu/Clip that alone read it (and that were quantized with it)."""
    v = n.outputs[0]
    for ops in (("Add",), ("Relu", "Clip")):
        readers = v.consumers()
        if len(readers) != 1 or len(v.uses) != 1 or v.is_output_of(n.graph):
            break
        r = readers[0]
        if r.op_type not in ops or r.name not in quantized_names:
            continue
        if r.op_type == "Add" and sum(i is not None and i.const is not None
                                      for i in r.inputs) != 1:
            break
        v = r.outputs[0]
    return v


def _best_pair(a, b, runs: int) -> tuple[float, float]:
    a(), b()
    ta = tb = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta, tb = min(ta, t1 - t0), min(tb, t2 - t1)
    return ta * 1e3, tb * 1e3


def time_layers(base: Model, quant: Model, layers: list[Node], feed: dict, backend: str,
                runs: int = 7) -> dict[str, LayerTiming]:
    """Per layer name: its float and quantized times (see the module doc). ``layers`` are
    nodes of ``base`` (they must have names); ``quant`` is ``base`` quantized."""
    qnames = {n.name for n in quant.graph.nodes if n.name}
    quant_values = quant.graph.values_by_name()
    spans = {}
    for n in layers:
        end = _chain_end(n, qnames)
        # every input computed at run time: attention's products read two
        xs = [v.name for v in n.inputs if v is not None and v.const is None]
        q_end = f"{end.name}_dequantized"
        spans[n.name] = (xs, end.name, q_end if q_end in quant_values else end.name)
    xs = sorted({x for span in spans.values() for x in span[0]})
    inputs = {v.name for v in base.graph.inputs}
    need = [x for x in xs if x not in inputs]
    acts = {}
    if need:
        # as graph outputs: onnxruntime returns no other intermediate tensor
        sess, need = session_with(base, need, backend)
        acts = dict(zip(need, sess.run(need, feed)))
    acts.update({k: v for k, v in feed.items() if k in xs})
    out = {}
    for name, (ins, end, q_end) in spans.items():
        fm = cut(base, inputs=ins, outputs=[end])
        qm = cut(quant, inputs=ins, outputs=[q_end])
        f_s = open_session(fm, backend)
        q_s = open_session(qm, backend)
        fd = {v.name: np.asarray(acts[x]) for v, x in zip(fm.graph.inputs, ins)}
        qd = {v.name: np.asarray(acts[x]) for v, x in zip(qm.graph.inputs, ins)}
        f_ms, q_ms = _best_pair(lambda s=f_s, d=fd: s.run(None, d),
                                lambda s=q_s, d=qd: s.run(None, d), runs)
        out[name] = LayerTiming(f_ms, q_ms)
    return out


def whole_model_ms(base: Model, quant: Model, feed: dict, backend: str,
                   runs: int = 15) -> tuple[float, float]:
    """Best-of-``runs`` ms of the float and the quantized model on ``feed``, taking
    turns (one session each, on ``backend``)."""
    f_s, q_s = open_session(base, backend), open_session(quant, backend)
    return _best_pair(lambda: f_s.run(None, feed), lambda: q_s.run(None, feed), runs)


def one_sample(m: Model, feed: dict) -> dict | None:
    """``feed`` cut to its first sample: each input whose declared first dimension is not
    a fixed number and that holds more than one there, sliced to ``[:1]``; None when none
    does (the feed is one sample already, or the model's batch is fixed). A calibration
    feed is often one batch of many samples (16 windows, 16 text lines), while real-time
    use runs one: an int8 layer faster at 16 can be slower at 1 (silero's sequence VAD:
    kept quantized at 16, its file ran 0.76x fp32 at batch 1)."""
    declared = {v.name: v.shape for v in m.graph.inputs}
    out, cut_any = {}, False
    for name, x in feed.items():
        shape = declared.get(name)
        x = np.asarray(x)
        if shape and x.ndim and not isinstance(shape[0], int) and x.shape[0] > 1:
            out[name], cut_any = x[:1], True
        else:
            out[name] = x
    return out if cut_any else None


def slowest(timings: list[dict[str, LayerTiming]]) -> dict[str, LayerTiming]:
    """Per layer, the timing where quantized fared worst against float (``timings`` taken
    on several feeds): a layer stays quantized only if it was faster on every one."""
    out: dict[str, LayerTiming] = {}
    for each in timings:
        for name, t in each.items():
            old = out.get(name)
            if old is None or t.quant_ms * old.float_ms > old.quant_ms * t.float_ms:
                out[name] = t
    return out
