"""Estimated floating-point operations per layer, from the shapes the IR knows.

A multiply-add counts as 2. Convolutions and matrix products are counted exactly from
shapes; elementwise ops, normalizations and pooling get a per-element estimate; ops with
no rule (shape plumbing, control flow) count 0. Symbolic dims take given sizes (default 1).
"""

from __future__ import annotations

from math import prod

from kiln.ir import Node, Value
from kiln.tools._common import concrete_shape, dims_of

_ELEMENTWISE = frozenset(
    "Abs Acos Acosh Add And Asin Asinh Atan Atanh BitShift Ceil Celu Clip Cos Cosh Div Elu "
    "Equal Erf Exp Floor Gelu Greater GreaterOrEqual HardSigmoid HardSwish IsInf IsNaN "
    "LeakyRelu Less LessOrEqual Log Max Mean Min Mish Mod Mul Neg Not Or PRelu Pow Reciprocal "
    "Relu Round Selu Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Sub Sum Swish Tan Tanh "
    "ThresholdedRelu Where Xor Shrink Dropout Cast QuantizeLinear DequantizeLinear".split())
_PER_ELEMENT = {"BatchNormalization": 2, "InstanceNormalization": 5, "LayerNormalization": 5,
                "LayerNorm": 5, "GroupNormalization": 5, "RMSNormalization": 4,
                "SkipLayerNormalization": 6, "Softmax": 3, "LogSoftmax": 3, "LRN": 5,
                "SwiGLU": 4}
_REDUCE = frozenset("ReduceSum ReduceMean ReduceMax ReduceMin ReduceProd ReduceL1 ReduceL2 "
                    "ReduceLogSum ReduceLogSumExp ReduceSumSquare GlobalAveragePool "
                    "GlobalMaxPool GlobalLpPool ArgMax ArgMin".split())


def _shape(v: Value | None, sizes) -> tuple[int, ...] | None:
    return None if v is None else concrete_shape(dims_of(v), sizes)


def _in(n: Node, i: int) -> Value | None:
    return n.inputs[i] if i < len(n.inputs) else None


def _conv(y, w) -> int | None:
    if y is None or w is None or len(y) < 2 or len(w) < 2:
        return None
    macs = prod(y) * prod(w[1:])  # each output: C/g * kernel MACs
    return 2 * macs + prod(y)  # + bias


def _conv_transpose(x, w) -> int | None:
    if x is None or w is None or len(x) < 2 or len(w) < 2:
        return None
    return 2 * prod(x) * prod(w[1:])


def _matmul(a, y) -> int | None:
    if a is None or y is None or not a:
        return None
    return 2 * prod(y) * a[-1]


def _gemm(n: Node, a, y) -> int | None:
    if a is None or y is None or len(a) != 2:
        return None
    k = a[0] if n.attrs.get("transA", 0) else a[1]
    return 2 * prod(y) * k + (prod(y) if _in(n, 2) is not None else 0)


def layer_flops(n: Node, sizes: dict[str, int] | None = None) -> int | None:
    """Estimated FLOPs of one node; None when a shape it needs is unknown."""
    op = n.op_type
    base = op.removeprefix("Fused").removeprefix("QLinear").removesuffix("Integer")
    y = _shape(n.outputs[0], sizes) if n.outputs and n.outputs[0] is not None else None
    x = _shape(_in(n, 0), sizes)
    if base == "Conv":
        return _conv(y, _shape(_in(n, 3 if op.startswith("QLinear") else 1), sizes))
    if base == "ConvTranspose":
        return _conv_transpose(x, _shape(_in(n, 1), sizes))
    if base == "MatMul":
        return _matmul(x, y)
    if base == "Gemm":
        return _gemm(n, x, y)
    if op == "Attention" and x is not None and len(x) == 4:
        k = _shape(_in(n, 1), sizes)
        if k is None or len(k) != 4:
            return None
        b, h, s, d = x
        return 4 * b * h * s * k[2] * d
    if op in ("MaxPool", "AveragePool", "LpPool"):
        ks = n.attrs.get("kernel_shape")
        return None if y is None or not ks else prod(y) * prod(ks)
    if op in _REDUCE:
        return None if x is None else prod(x)
    if op in _ELEMENTWISE:
        return None if y is None else prod(y)
    if op in _PER_ELEMENT:
        return None if y is None else _PER_ELEMENT[op] * prod(y)
    return 0
