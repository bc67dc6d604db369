"""Weight-only quantization of MatMul/Gemm weights: int4 or int8 in blocks along the reduction
axis, each block of ``block_size`` rows with its own float scale, stored as a blocked
DequantizeLinear (opset 21), activations untouched. Transformer weights shrink ~4x
(int8) or ~8x (int4) at a small accuracy cost; compute stays float."""

from __future__ import annotations

import ml_dtypes
import numpy as np

from kiln.errors import OptionError
from kiln.ir import DType, Model, Node, TensorType, Value
from kiln.passes.base import add_const
from kiln.quantize.qdq import Plan

__all__ = ["BLOCK_SIZES", "quantize_blocked", "rewrite_weight_only"]

BLOCK_SIZES = (32, 64, 128)


def quantize_blocked(w: np.ndarray, block_size: int, bits: int, axis: int = 0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric ``bits``-bit blocks of the 2-D ``w`` along ``axis`` (the reduction axis):
    the integers (int4 or int8, shaped like ``w``) and the scales (``w``'s shape with
    ``ceil(K / block_size)`` along ``axis``)."""
    if axis == 1:
        q, scale = quantize_blocked(w.T, block_size, bits)
        return np.ascontiguousarray(q.T), np.ascontiguousarray(scale.T)
    k, n = w.shape
    blocks = -(-k // block_size)
    padded = np.zeros((blocks * block_size, n), np.float32)
    padded[:k] = w
    amax = np.abs(padded.reshape(blocks, block_size, n)).max(axis=1)
    qmax = 2 ** (bits - 1) - 1
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / np.repeat(scale, block_size, axis=0)[:k]), -qmax, qmax)
    dtype = ml_dtypes.int4 if bits == 4 else np.int8
    return q.astype(np.int8).astype(dtype), scale


def _reduction_axis(n: Node) -> int:
    """The axis of ``n``'s weight that the product sums over."""
    return 1 if n.op_type == "Gemm" and n.attrs.get("transB", 0) else 0


def rewrite_weight_only(m: Model, plan: Plan, block_size: int, bits: int) -> None:
    """Replace the constant 2-D weight of every MatMul/Gemm in ``plan`` by a blocked DQ."""
    if block_size not in BLOCK_SIZES:
        raise OptionError(f"block_size must be one of {BLOCK_SIZES}, not {block_size}")
    if bits not in (4, 8):
        raise OptionError(f"weight-only quantization takes bits=4 or 8, not {bits}")
    g = m.graph
    done: dict[Value, Value] = {}
    for n in list(plan.quantized):
        w = n.inputs[1]
        if w not in done:
            axis = _reduction_axis(n)
            q, scale = quantize_blocked(w.const.astype(np.float32), block_size, bits, axis)
            qv = add_const(g, f"{w.name}_int{bits}", q)
            sv = add_const(g, f"{w.name}_scale", scale)
            out = Value(f"{w.name}_dequantized", TensorType(DType.FLOAT, w.shape))
            g.insert_before(n, [Node("DequantizeLinear", [qv, sv], [out],
                                     {"axis": axis, "block_size": block_size},
                                     name=f"{w.name}_DequantizeLinear")])
            done[w] = out
        n.set_input(1, done[w])
    for name, v in list(g.initializers.items()):
        if not v.is_used():
            del g.initializers[name]


def plan_weight_only(m: Model, exclude: set[str]) -> Plan:
    """MatMuls and Gemms whose second input is a constant 2-D float weight."""
    plan = Plan()
    for n in m.graph.nodes:
        if n.op_type not in ("MatMul", "Gemm"):
            continue
        label = n.name or f"{n.op_type}({n.outputs[0].name})"
        w = n.inputs[1]
        if n.name in exclude:
            plan.kept[label] = "excluded by the caller"
        elif w is None or w.const is None or w.const.ndim != 2 or w.dtype != DType.FLOAT:
            plan.kept[label] = "weight not a constant 2-D float32 matrix"
        else:
            plan.quantized.append(n)
    return plan
