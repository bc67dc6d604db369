"""Torch kernels for ops that make tensors: constants, ranges, dropout masks."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    TORCH_OF,
    floats,
    ints,
    known_dtype,
    output_read,
    scalar,
    to_torch,
)

NI = NotImplemented
_INTS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _out_device(site):
    """Where a node that creates a tensor from nothing puts it."""
    node = site.node
    outs = [v for v in node.outputs if v is not None]
    if outs and all(v.meta.get("host") for v in outs):
        return torch.device("cpu")
    return site.target.device


# -- constants ----------------------------------------------------------------------------


@kernel("Constant", 1, prepare=True)
def constant(site):
    a = site.attrs
    if "value" in a:
        val = np.asarray(a["value"])
    elif "value_float" in a:
        val = np.array(a["value_float"], dtype=np.float32)
    elif "value_floats" in a:
        val = np.array(a["value_floats"], dtype=np.float32)
    elif "value_int" in a:
        val = np.array(a["value_int"], dtype=np.int64)
    elif "value_ints" in a:
        val = np.array(a["value_ints"], dtype=np.int64)
    else:
        return None  # strings, sparse: NumPy kernel
    t = to_torch(val)
    if t is None:
        return None
    t = t.to(_out_device(site))

    def run():
        return t

    return run


@kernel("ConstantOfShape", 9, prepare=True)
def constant_of_shape(site):
    v = site.attr("value")
    val = np.zeros(1, np.float32) if v is None else np.asarray(v).reshape(-1)
    t = to_torch(val)
    if t is None:
        return None
    fill = val[0].item()
    dt = t.dtype
    dev = _out_device(site)

    def run(shape):
        return torch.full(ints(shape), fill, dtype=dt, device=dev)

    return run


@kernel("Range", 11, prepare=True)
def range_(site):
    dev = _out_device(site)
    consts = [site.const(i) for i in range(3)]
    if any(c is not None and c.dtype.kind not in "iu" for c in consts):
        return None  # float ranges: the shared kernel's rounding is ONNX's
    # Constant bounds arrive as Python numbers (host parameters): their dtype is the
    # constant's, known now.
    fixed = next((to_torch(c).dtype for c in consts if c is not None), None)
    if fixed is None and known_dtype(site) is not None:
        fixed = TORCH_OF.get(known_dtype(site))
    if fixed is not None and fixed not in _INTS:
        return None

    def run(start, limit, delta):
        dtype = fixed if fixed is not None else start.dtype
        if dtype not in _INTS:
            return NI  # a type the plan did not know
        s, lim, d = scalar(start), scalar(limit), scalar(delta)
        if d == 0:
            return NI  # a zero step read at run time: the NumPy kernel's error
        n = max(math.ceil((lim - s) / d), 0)
        return torch.arange(s, s + n * d, d, dtype=dtype, device=dev)  # integers: exact

    return run


# -- dropout ------------------------------------------------------------------------------


@kernel("Dropout", 7, prepare=True)
def dropout(site):
    """Identity in inference; in a training module (:func:`kiln.to_torch`) the module's
    train()/eval() flag decides, whatever ``training_mode`` says (exporters write it as a
    constant True when exporting in train mode): torch's dropout in train mode, with the
    mask output too when something reads it (in the input's type before opset 10), the
    identity in eval mode."""
    tg = site.target
    masked = output_read(site, 1)
    unread = (None,) * (site.num_outputs - 1)  # a mask output nothing reads
    input_typed_mask = site.opset < 10

    def ones(x):
        return torch.ones(
            x.shape, dtype=x.dtype if input_typed_mask else torch.bool, device=x.device
        )

    def drop(x, p: float):
        if not masked:  # torch.nn.Dropout's own draw: the same mask from the same seed
            return (F.dropout(x, p, True),) + unread if unread else F.dropout(x, p, True)
        keep = torch.rand(x.shape, device=x.device) >= p
        y = x * keep / (1.0 - p) if p < 1 else torch.zeros_like(x)
        return y, keep.to(x.dtype) if input_typed_mask else keep

    if site.opset >= 12:
        tm = site.const(2)
        # a graph asking for training-mode dropout (outside a module): the NumPy kernel's
        # seeded masks; only a training_mode fed at run time is read each call
        if not tg.module and tm is not None and tm.size and bool(tm.reshape(-1)[0]):
            return None
        fed = not tg.module and site.has_input(2) and tm is None

        def run12(x, ratio=None, training_mode=None):
            if tg.mode.training:
                return drop(x, 0.5 if ratio is None else floats(ratio)[0])
            if fed and bool(training_mode.reshape(-1)[0]):
                return NI  # a fed training_mode asks for it: the NumPy kernel's masks
            return (x, ones(x)) if masked else (x,) + unread if unread else x

        return run12

    ratio = float(site.attr("ratio", 0.5))

    def run(x):
        if tg.mode.training:
            return drop(x, ratio)
        return (x, ones(x)) if masked else (x,) + unread if unread else x

    return run
