"""SmoothQuant-style migration of activation range into weights, per input channel.

A per-tensor activation grid is shared by every channel of the tensor: channels far
below one step of it (PaddleOCR's v4 recognizer: a Conv with 28 of 480 input channels
below one uint8 step while the weights reading them reach 22.5) are rounded away, and a
few loud channels stretch the grid for all. For a Conv/MatMul/Gemm with a constant
weight, ``x @ W == (x / s) @ (s * W)`` for any positive per-input-channel ``s``:
with ``s_j = max|x_j|^a / max|W_j|^(1-a)`` (Xiao et al., SmoothQuant, 2022) the input's
channels come to comparable ranges, and the weights, quantized per output channel,
take the difference. ``a`` (``alpha``) sets how much moves: 0 leaves the activations
as they are, 1 makes every channel's range equal.

The ``1/s`` is folded into what produces ``x`` where that is exact: a constant Mul or
Add (a folded BatchNorm's affine), a Conv/Gemm's weights and bias, through a Relu,
MaxPool or average pool (positive scales commute with them); otherwise a float ``Mul``
by ``1/s`` is inserted in front of the layer (its output is what gets quantized).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from kiln.ir import DType, Model, Node, TensorType, Value
from kiln.passes.base import add_const
from kiln.quantize.calibrate import session_with

__all__ = ["Smoothing", "smooth"]

SMOOTH_OPS = ("Conv", "MatMul", "Gemm")
# Positive per-channel scales pass through these unchanged: f(x / s) == f(x) / s.
_COMMUTE = ("Relu", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool")


@dataclass
class Smoothing:
    """What :func:`smooth` did: per layer, how its scales were applied."""

    layers: dict[str, str] = field(default_factory=dict)
    inserted: list[str] = field(default_factory=list)
    """Names of the inserted float Mul nodes (to keep out of quantization)."""
    skipped: dict[str, str] = field(default_factory=dict)
    """Layers left as they were, and why."""


def _site(n: Node) -> tuple[np.ndarray, int] | None:
    """(weight, input-channel axis of the activation) for a smoothable layer."""
    if n.op_type not in SMOOTH_OPS or len(n.inputs) < 2:
        return None
    x, w = n.inputs[0], n.inputs[1]
    if (
        x is None
        or x.const is not None
        or w is None
        or w.const is None
        or x.dtype != DType.FLOAT
        or w.meta.get("overridable")
    ):
        return None
    wc = np.asarray(w.const)
    if n.op_type == "Conv" and wc.ndim >= 3:
        return wc, 1
    if n.op_type == "MatMul" and wc.ndim == 2:
        return wc, -1
    if n.op_type == "Gemm" and wc.ndim == 2 and not n.attrs.get("transA", 0):
        return wc, -1
    return None


def _weight_view(n: Node, wc: np.ndarray) -> np.ndarray:
    """The weight as (groups, outputs per group, inputs per group, rest)."""
    if n.op_type == "Conv":
        g = int(n.attrs.get("group", 1))
        return wc.reshape(g, wc.shape[0] // g, wc.shape[1], -1)
    if n.op_type == "Gemm" and n.attrs.get("transB", 0):
        return wc.reshape(1, wc.shape[0], wc.shape[1], 1)
    return wc.T.reshape(1, wc.shape[1], wc.shape[0], 1)  # (K, N) -> (N, K)


def _scaled_weight(n: Node, wc: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``wc`` with its input channel c multiplied by ``s[c]``."""
    v = _weight_view(n, wc)
    g, _, cpg, _ = v.shape
    out = v * s.reshape(g, 1, cpg, 1)
    if n.op_type == "Conv":
        return out.reshape(wc.shape).astype(wc.dtype)
    if n.op_type == "Gemm" and n.attrs.get("transB", 0):
        return out.reshape(wc.shape).astype(wc.dtype)
    return out.reshape(wc.shape[1], wc.shape[0]).T.astype(wc.dtype)


def _channel_max(
    model: Model, sites: dict[str, tuple[Node, int]], feeds: list[dict], backend: str
) -> dict[str, np.ndarray]:
    """max |x_c| over ``feeds`` for each tensor of ``sites`` (name -> (node, axis))."""
    sess, names = session_with(model, sorted(sites), backend)
    out: dict[str, np.ndarray] = {}
    for feed in feeds:
        for t, a in zip(names, sess.run(names, feed)):
            a = np.abs(np.asarray(a, np.float32))
            if a.size == 0:
                continue
            axis = sites[t][1] % a.ndim
            m = a.max(axis=tuple(i for i in range(a.ndim) if i != axis))
            out[t] = m if t not in out else np.maximum(out[t], m)
    return out


def _fold(v: Value, inv: np.ndarray, axis: int) -> tuple[str, list] | None:
    """How to multiply the tensor ``v`` by ``inv`` (per channel on ``axis``) inside what
    produces it, where that is exact and ``v`` has no other reader: (how, edits to make),
    or None. Nothing is changed until the caller runs the edits, so a branch that
    cannot fold leaves the graph as it was."""
    p = v.producer
    if p is None or len(v.uses) != 1 or v.is_output_of(p.graph) or v.shape is None:
        return None
    rank = len(v.shape)
    axis %= rank
    if p.op_type in _COMMUTE and p.inputs[0] is not None:
        inner = _fold(p.inputs[0], inv, axis)
        return (f"through {p.op_type}, {inner[0]}", inner[1]) if inner else None
    if p.op_type == "Transpose" and p.inputs[0] is not None:
        perm = p.attrs.get("perm") or list(range(rank))[::-1]
        inner = _fold(p.inputs[0], inv, int(perm[axis]))
        return (f"through Transpose, {inner[0]}", inner[1]) if inner else None
    if (
        p.op_type == "Add"
        and len(p.inputs) == 2
        and all(u is not None and u.const is None for u in p.inputs)
    ):
        # (a + b) / s == a / s + b / s: both branches must take it
        parts = [_fold(u, inv, axis) for u in p.inputs]
        if None in parts:
            return None
        return (
            f"into both inputs of Add {p.name} ({parts[0][0]}; {parts[1][0]})",
            parts[0][1] + parts[1][1],
        )
    if p.op_type in ("Mul", "Add") and len(p.inputs) == 2:
        consts = [i for i, u in enumerate(p.inputs) if u is not None and u.const is not None]
        if len(consts) != 1:
            return None
        ci = consts[0]
        c = np.asarray(p.inputs[ci].const)
        if c.dtype != np.float32 or c.ndim > rank:
            return None
        shape = [1] * rank
        shape[axis] = -1
        new = (c * inv.reshape(shape)).astype(np.float32)
        dims = [d if isinstance(d, int) else None for d in v.shape]
        if any(k != 1 and d is not None and k != d for k, d in zip(new.shape[::-1], dims[::-1])):
            return None
        how, edits = f"into {p.op_type} {p.name}", []
        deeper = _fold(p.inputs[1 - ci], inv, axis) if p.op_type == "Mul" else None
        if deeper is not None:
            # (x * c) / s == (x / s) * c: as deep as it goes, so that every tensor on the
            # way (each may have its own grid) carries the smoothed channels
            return f"through Mul {p.name}, {deeper[0]}", deeper[1]
        if p.op_type == "Add":  # (x + b) / s == x / s + b / s: x must take 1/s too
            inner = _fold(p.inputs[1 - ci], inv, axis)
            if inner is None:
                return None
            how, edits = f"{how}, {inner[0]}", inner[1]
        name = f"{p.inputs[ci].name}_smoothed"
        return how, edits + [lambda: p.set_input(ci, add_const(p.graph, name, new))]
    if p.op_type == "Conv" and axis == 1 and len(p.inputs) > 1:
        w = p.inputs[1]
        b = p.inputs[2] if len(p.inputs) > 2 else None
        if w is None or w.const is None or b is not None and b.const is None:
            return None
        wc = np.asarray(w.const)
        if wc.shape[0] != inv.size:
            return None
        new_w = (wc * inv.reshape(-1, *[1] * (wc.ndim - 1))).astype(wc.dtype)
        edits = [lambda: p.set_input(1, add_const(p.graph, f"{w.name}_smoothed", new_w))]
        if b is not None:
            new_b = (np.asarray(b.const) * inv).astype(np.float32)
            edits.append(lambda: p.set_input(2, add_const(p.graph, f"{b.name}_smoothed", new_b)))
        return f"into Conv {p.name}'s weights", edits
    return None


def smooth(
    model: Model,
    layers: list[Node],
    feeds: list[dict],
    alpha: float = 0.5,
    backend: str | None = None,
    quantized: Iterable[Node] = (),
) -> Smoothing:
    """Migrate activation range into the weights of ``layers`` (nodes of ``model``;
    those with a constant weight and a computed float input) in place, measured on
    ``feeds``. ``quantized``: every node the quantization plan will quantize (a layer
    whose input is such a node's output is smoothed only where 1/s folds into it).
    Returns what was done."""
    done = Smoothing()
    quantized = set(quantized)
    sites = {}
    for n in layers:
        site = _site(n)
        if site is not None and n.name:
            sites.setdefault(n.inputs[0].name, (n, site[1]))
    if not sites or not feeds:
        return done
    amax = _channel_max(model, sites, feeds, backend)
    g = model.graph
    for n in [n for n in layers if n.name]:
        site = _site(n)
        if site is None:
            continue
        wc, axis = site
        x = n.inputs[0]
        a = amax.get(x.name)
        v = _weight_view(n, wc)
        gr, _, cpg, _ = v.shape
        wmax = np.abs(v).max(axis=(1, 3)).reshape(-1)
        if a is None or a.size != wmax.size:
            continue
        s = np.power(np.maximum(a, 1e-8), alpha) / np.power(np.maximum(wmax, 1e-8), 1 - alpha)
        # Channels that are silent on the data, or read by zero weights, stay as they are.
        s = np.where((a > 0) & (wmax > 0), s, 1.0)
        s = (s / np.exp(np.mean(np.log(s)))).astype(np.float32)  # keep the overall scale
        inv = (1.0 / s).astype(np.float32)
        w = n.inputs[1]
        folded = _fold(x, inv, axis)
        if folded is not None:
            how = folded[0]
            for edit in folded[1]:
                edit()
        elif x.producer is not None and x.producer in quantized:
            # x gets its own per-tensor grid as a quantized node's output: a Mul after it
            # would only round the quiet channels away first.
            done.skipped[n.name] = (
                f"not smoothed: 1/s cannot be folded into "
                f"{x.producer.op_type} {x.producer.name}, whose "
                "output is quantized"
            )
            continue
        else:
            shape = [-1] + [1] * (len(x.shape) - 2) if axis == 1 and x.shape is not None else [-1]
            if axis == 1 and x.shape is None:
                continue
            out = Value(f"{x.name}_smoothed_{n.name}", TensorType(DType.FLOAT, x.shape))
            mul = Node(
                "Mul",
                [x, add_const(g, f"{n.name}_smooth_scale", inv.reshape(shape))],
                [out],
                name=f"{n.name}_smooth",
            )
            g.insert_before(n, [mul])
            n.set_input(0, out)
            done.inserted.append(mul.name)
            how = "a float Mul in front"
        n.set_input(1, add_const(g, f"{w.name}_smoothed_{n.name}", _scaled_weight(n, wc, s)))
        done.layers[n.name] = f"smoothed (alpha {alpha:g}; 1/s {how})"
    return done
