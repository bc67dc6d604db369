"""Torch kernels for matrix products."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ops.quant_fused import EXACT_F32
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    const_tensor,
    decided,
    dtype_in,
    fact,
    gated,
    known_rank,
    one_element,
)
from kiln.ops.torch.conv import linear

_EIGHT = (torch.uint8, torch.int8)


# -- matrix products ----------------------------------------------------------------------


def _lowp(site):
    """The reduced compute dtype for fp32 matmul/conv, or None."""
    return site.target.compute_dtype


def _new_tensors_ok(site) -> bool:
    """Whether ``prepare`` may keep tensors of its own (a transposed or cast weight). Not
    while tracing for AOTInductor on the CPU: such a tensor becomes a lifted constant
    that AOTInductor with frozen weights fails on (torch 2.13: "references nonexistent
    attribute _tensor_constant0"), where the same cast inside the program folds."""
    tg = site.target
    return not (tg.tracing and tg.device.type == "cpu")


# faster than the generic kernel, and computes in bf16/fp16 when the session asks for it
@kernel("MatMul", 1, prepare=True)
def matmul(site):
    low = _lowp(site)
    wc = const_tensor(site, 1)
    wlow = (
        wc.to(low)
        if low is not None
        and wc is not None
        and wc.dtype == torch.float32
        and _new_tensors_ok(site)
        else None
    )
    lin = (
        linear(site, wc)
        if wc is not None and wc.dim() == 2 and wc.dtype == torch.float32 and low is None
        else None
    )

    def run(a, b):
        if lin is not None and a.dtype == torch.float32 and a.dim() >= 2:
            return lin(a, None)
        if low is not None and a.dtype == torch.float32:
            bb = wlow if wlow is not None else b.to(low)
            return torch.matmul(a.to(low), bb).to(torch.float32)
        return torch.matmul(a, b)

    if low is not None:
        site.notes.append(f"computes in {low}")
    # (integer products: torch has none on CUDA)
    on_cuda = str(site.target.device).startswith("cuda")
    return gated(site, FLOATS if on_cuda else FLOATS + (torch.int32, torch.int64), run,
                 same=True)


# faster than the generic kernel (F.linear with bias), computes in bf16/fp16 when asked
@kernel("Gemm", 7, prepare=True)
def gemm(site):
    alpha = float(site.attr("alpha", 1.0))
    beta = float(site.attr("beta", 1.0))
    ta = int(site.attr("transA", 0))
    tb = int(site.attr("transB", 0))
    low = _lowp(site)
    wc = const_tensor(site, 1)
    lin = None
    if (
        wc is not None
        and wc.dim() == 2
        and wc.dtype == torch.float32
        and low is None
        and not ta
        and alpha == 1.0
    ):
        lin = linear(site, wc.t() if tb else wc)
    # Otherwise keep a constant B as the (N, K) matrix F.linear wants, cast once for low
    # precision.
    w = None
    if (
        lin is None
        and wc is not None
        and wc.dim() == 2
        and wc.dtype in FLOATS
        and _new_tensors_ok(site)
    ):
        w = wc if tb else wc.t().contiguous()
        if low is not None and w.dtype == torch.float32:
            w = w.to(low)

    def run(a, b, c=None):
        if lin is not None:
            bias = None if c is None or beta == 0.0 else c if beta == 1.0 else c * beta
            if bias is None or (bias.dim() == 1 and bias.shape[0] == wc.shape[0 if tb else 1]):
                return lin(a, bias)
            return lin(a, None) + bias
        out_dtype = a.dtype
        if ta:
            a = a.t()
        wt = w if w is not None else (b if tb else b.t())
        if low is not None and out_dtype == torch.float32:
            a = a.to(low)
            wt = wt.to(low)
        if alpha != 1.0:
            a = a * alpha
        bias = None
        if c is not None and beta != 0.0:
            bias = c if beta == 1.0 else c * beta
        if bias is not None and bias.dim() == 1 and bias.shape[0] == wt.shape[0] and low is None:
            return F.linear(a, wt, bias)
        y = F.linear(a, wt)
        if y.dtype != out_dtype:
            y = y.to(out_dtype)
        if bias is not None:
            y = y + bias
        return y

    if low is not None:
        site.notes.append(f"computes in {low}")
    # 2-D A and B (else the NumPy kernel's error)
    b_rank = fact(known_rank(site, 1), lambda r: r == 2)
    if b_rank is not True:
        run = decided(site, [b_rank], run, lambda a, b, c=None: b.dim() == 2)
    return run and gated(site, FLOATS, run, same=True, rank=lambda r: r == 2)


@kernel("Einsum", 12, prepare=True)
def einsum(site):
    equation = site.attr("equation")
    if equation is None:
        return None
    return gated(site, FLOATS, lambda *xs: torch.einsum(equation, *xs), same=True)


@kernel("MatMulInteger", 10, prepare=True)
def matmul_integer(site):
    """Exact int32 MatMulInteger (onnxruntime's dynamic quantization writes one per layer)
    with a constant B on float32 BLAS: B minus its zero point is converted once, and K is
    cut into chunks short enough that float32 sums the integer products exactly; the
    chunks' sums add in float64. The shared kernel's float64 product on NumPy costs
    several times more a layer (BERT's 16 x 256 x 256 layers)."""
    b, bz = site.const(1), site.const(3)
    if (
        b is None
        or b.ndim != 2
        or site.has_input(3)
        and bz is None
        or b.dtype not in (np.int8, np.uint8)
    ):
        return None
    w = b.astype(np.float32) - (0 if bz is None else bz.astype(np.float32))
    chunk = max(1, int(EXACT_F32 // (255 * max(float(np.abs(w).max(initial=0)), 1.0))))
    pieces = [
        (k, site.target.put(np.ascontiguousarray(w[k : k + chunk])))
        for k in range(0, w.shape[0], chunk)
    ]

    def run(a, b_, a_zero_point=None, b_zero_point=None):
        x = a.to(torch.float32)  # |a - a_zero_point| <= 255
        if a_zero_point is not None:
            x -= a_zero_point.reshape(()).to(torch.float32)
        if len(pieces) == 1:
            return torch.matmul(x, pieces[0][1]).to(torch.int32)
        acc = None
        for k, p in pieces:
            part = torch.matmul(x[..., k : k + p.shape[0]], p).to(torch.float64)
            acc = part if acc is None else acc.add_(part)
        return acc.to(torch.int32)

    # 8-bit A with one zero point (a per-row one takes the shared kernel)
    return decided(site, [dtype_in(site, 0, _EIGHT), one_element(site, 2)], run,
                   lambda a, b_, a_zero_point=None, b_zero_point=None: a.dtype in _EIGHT
                   and (a_zero_point is None or a_zero_point.numel() == 1))

