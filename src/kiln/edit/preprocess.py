"""Embedded preprocessing (OpenVINO's PrePostProcessor and Model Optimizer's
``--mean_values``/``--scale_values``/``--reverse_input_channels``/``--layout``): an image
input of the model takes what a camera or decoder gives (``uint8``, NHWC or NCHW, BGR or
RGB, any size) and the model itself does the conversion.

For the model input ``x`` (NCHW, float) the new input ``u`` is turned into
``x = (reverse(resize(transpose(cast(u)))) - mean) / scale``, in that order (Model
Optimizer's: channels are reversed first, then the mean subtracted, then divided by the
scale; mean and scale are given in the model's channel order).

What stays in the graph: the Cast (when the input type changes), a Transpose (NHWC), the
Resize (with, below opset 18, the Shape/Concat nodes computing its sizes when the batch is
symbolic). The constant rest folds into the first layer when it is a Conv (``group=1``,
constant weights) that alone reads the input: the scale divides its weights, the channel
reversal permutes its weights' input channels, and the mean moves into its bias. A mean
folds only when the Conv pads nothing: a zero-padded border of ``x - mean`` is not a
border of ``x`` shifted by the bias, so with padding the mean stays one ``Sub`` node (on
the un-reversed channels; scale and reversal still fold). Without such a Conv, the steps
are plain ``Gather``/``Sub``/``Div`` nodes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kiln.edit.common import (
    ModelLike,
    all_names,
    named_or_only,
    private_copy,
    prune,
    retype,
    tensor_type,
    unique_name,
)
from kiln.errors import KilnError
from kiln.ir import DType, Graph, Model, Node, SymDim, TensorType, Value, as_dim
from kiln.passes.base import add_const, const_value

LAYOUTS = ("NCHW", "NHWC")
RESIZE_MODES = ("linear", "nearest")


def preprocess(model: ModelLike, input: str | None = None, *,
               input_type: str | DType | None = None, layout: str = "NCHW",
               mean: Sequence[float] | float | None = None,
               scale: Sequence[float] | float | None = None,
               reverse_channels: bool = False, resize: str | None = None,
               size: Sequence[int | str] | None = None, fold: bool = True) -> Model:
    """``model`` whose image input ``input`` (or its only input) takes ``input_type``
    (``"uint8"``...; None: the model's) in ``layout`` (NCHW or NHWC), reverses its channels
    (BGR <-> RGB) when ``reverse_channels``, subtracts ``mean`` and divides by ``scale``
    (one number or one per channel, in the model's channel order), and, when ``resize`` is
    ``"linear"`` or ``"nearest"``, takes images of ``size`` (height, width; None: any, as
    symbolic dims) and resizes them to the model's. ``fold=False`` keeps every step a node
    (what the fold must equal). See the module docstring for what remains in the graph."""
    layout = layout.upper()
    if layout not in LAYOUTS:
        raise KilnError(f"unknown layout {layout!r}; use NCHW or NHWC")
    if resize is not None and resize not in RESIZE_MODES:
        raise KilnError(f"unknown resize mode {resize!r}; use linear or nearest")
    if size is not None and resize is None:
        raise KilnError("size= is the size of the images given, which only differs from the "
                        "model's with resize='linear' or 'nearest'")
    m = private_copy(model)
    g = m.graph
    x = named_or_only(g.inputs, input, "input", "takes images")
    input = x.name
    t = tensor_type(x, "input")
    if t.shape is None or len(t.shape) != 4:
        raise KilnError(f"input {input!r} has shape {t.shape}; preprocessing needs an NCHW "
                        "image input (rank 4)")
    if t.dtype not in (DType.FLOAT, DType.DOUBLE, DType.FLOAT16):
        raise KilnError(f"input {input!r} is {t.dtype.name}; preprocessing expects a "
                        "floating-point image input")
    n_dim, channels, height, width = t.shape
    src_type = _dtype(input_type) if input_type is not None else t.dtype
    mean_v = _per_channel(mean, channels, "mean", input)
    scale_v = _per_channel(scale, channels, "scale", input)
    if scale_v is not None and np.any(scale_v == 0):
        raise KilnError(f"scale values for {input!r} contain 0: the input would be divided "
                        "by zero")
    if reverse_channels and not isinstance(channels, int):
        raise KilnError(f"input {input!r} has no fixed channel count to reverse")
    if resize is not None:
        if not isinstance(height, int) or not isinstance(width, int):
            raise KilnError(f"input {input!r} has no fixed height and width to resize to")
        src_h, src_w = (as_dim(d) for d in size) if size is not None else \
            (SymDim(f"{input}_height"), SymDim(f"{input}_width"))
    else:
        src_h, src_w = height, width
    dims = (n_dim, channels, src_h, src_w) if layout == "NCHW" else \
        (n_dim, src_h, src_w, channels)

    names = all_names(g)
    u = Value(input, TensorType(src_type, dims))
    x.name = unique_name(names, f"{input}/preprocessed")
    chain = _Chain(g, names, input)
    cur = u
    if src_type != t.dtype:
        cur = chain.add("Cast", [cur], to=int(t.dtype))
    if layout == "NHWC":
        cur = chain.add("Transpose", [cur], perm=[0, 3, 1, 2])
    if resize is not None:
        cur = _resize(chain, cur, m.opset, resize, n_dim, channels, height, width)

    conv = _foldable_conv(x, channels) if fold else None
    if conv is not None:
        cur = _fold(chain, conv, cur, mean_v, scale_v, reverse_channels)
    else:
        if reverse_channels:
            cur = chain.add("Gather", [cur, chain.const("reverse", np.arange(channels)[::-1]
                                                          .astype(np.int64))], axis=1)
        float_np = t.dtype.numpy
        if mean_v is not None:
            cur = chain.add("Sub", [cur, chain.const("mean", mean_v.astype(float_np)
                                                     .reshape(1, -1, 1, 1))])
        if scale_v is not None:
            cur = chain.add("Div", [cur, chain.const("scale", scale_v.astype(float_np)
                                                     .reshape(1, -1, 1, 1))])
    first = g.nodes[0] if g.nodes else None
    x.replace_all_uses_with(cur)
    if first is not None:
        g.insert_before(first, chain.nodes)
    else:
        for n in chain.nodes:
            g.append(n)
    g.inputs = [u if v is x else v for v in g.inputs]
    prune(g)  # the Conv's old weights, when folded
    retype(m)
    return m


class _Chain:
    """The preprocessing nodes being built, named after the input."""

    def __init__(self, g: Graph, names: set[str], input: str):
        self.g, self.names, self.prefix = g, names, f"{input}/preprocess"
        self.nodes: list[Node] = []

    def add(self, op: str, inputs: list[Value | None], **attrs) -> Value:
        name = unique_name(self.names, f"{self.prefix}/{op}")
        out = Value(unique_name(self.names, f"{name}_output"))
        self.nodes.append(Node(op, inputs, [out], attrs, name=name))
        return out

    def const(self, what: str, array: np.ndarray) -> Value:
        return add_const(self.g, unique_name(self.names, f"{self.prefix}/{what}"), array)


def _dtype(name: str | DType) -> DType:
    if isinstance(name, DType):
        return name
    try:
        return DType.from_numpy(np.dtype(name))
    except TypeError:
        raise KilnError(f"unknown input type {name!r}; use a NumPy dtype name such as "
                        "uint8 or float32") from None


def _per_channel(values, channels, what: str, input: str) -> np.ndarray | None:
    if values is None:
        return None
    arr = np.atleast_1d(np.asarray(values, dtype=np.float64)).reshape(-1)
    if arr.size == 1 and isinstance(channels, int):
        arr = np.repeat(arr, channels)
    if not isinstance(channels, int) or arr.size != channels:
        raise KilnError(f"{arr.size} {what} values for input {input!r}, which has "
                        f"{channels} channels; give one value or one per channel")
    return arr


def _resize(chain: _Chain, cur: Value, opset: int, mode: str, n_dim, channels, height,
            width) -> Value:
    if opset < 11:
        raise KilnError(f"resizing needs opset 11 or later (the model has {opset}); convert "
                        "it with onnx.version_converter first")
    attrs = {"mode": mode}
    if mode == "linear":
        attrs["coordinate_transformation_mode"] = "half_pixel"
    else:  # OpenCV's INTER_NEAREST: the source pixel is floor(dst * in / out)
        attrs.update(coordinate_transformation_mode="asymmetric", nearest_mode="floor")
    if opset >= 18:
        sizes = chain.const("resize_sizes", np.array([height, width], np.int64))
        return chain.add("Resize", [cur, None, None, sizes], axes=[2, 3], **attrs)
    if isinstance(n_dim, int):
        sizes = chain.const("resize_sizes", np.array([n_dim, channels, height, width],
                                                     np.int64))
    else:  # the batch is only known at run time: sizes = [N] + [C, H, W]
        if opset >= 15:
            batch = chain.add("Shape", [cur], start=0, end=1)
        else:
            shape = chain.add("Shape", [cur])
            one = chain.const("batch_axis", np.array([0], np.int64))
            batch = chain.add("Slice", [shape, one, chain.const("batch_end",
                                                                np.array([1], np.int64))])
        rest = chain.const("resize_chw", np.array([channels, height, width], np.int64))
        sizes = chain.add("Concat", [batch, rest], axis=0)
    if opset >= 13:  # roi and scales became optional
        return chain.add("Resize", [cur, None, None, sizes], **attrs)
    return chain.add("Resize", [cur, chain.const("roi", np.zeros(0, np.float32)),
                                chain.const("scales", np.zeros(0, np.float32)), sizes],
                     **attrs)


def _foldable_conv(x: Value, channels) -> Node | None:
    """The Conv that alone reads ``x`` and whose weights can absorb per-channel steps."""
    readers = x.consumers()
    if len(readers) != 1 or x.output_of() or not isinstance(channels, int):
        return None
    conv = readers[0]
    if conv.op_type != "Conv" or conv.domain != "" or conv.inputs[0] is not x or \
            conv.attrs.get("group", 1) != 1 or x in conv.inputs[1:]:
        return None
    w = const_value(conv.inputs[1])
    b = const_value(conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] is not None \
        else None
    if w is None or w.ndim < 3 or w.shape[1] != channels:
        return None
    if len(conv.inputs) > 2 and conv.inputs[2] is not None and b is None:
        return None
    return conv


def _pads(conv: Node) -> bool:
    auto = conv.attrs.get("auto_pad", "NOTSET")
    auto = auto.decode() if isinstance(auto, bytes) else auto
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        return True
    return auto != "VALID" and any(p != 0 for p in conv.attrs.get("pads", []))


def _fold(chain: _Chain, conv: Node, cur: Value, mean: np.ndarray | None,
          scale: np.ndarray | None, reverse: bool) -> Value:
    """Fold scale, reversal and (without padding) mean into ``conv``'s weights and bias;
    returns what ``conv`` reads now (``cur``, or a Sub of the mean on it)."""
    w = const_value(conv.inputs[1])
    dtype = w.dtype
    w1 = w.astype(np.float64)
    if scale is not None:
        w1 = w1 / scale.reshape((1, -1) + (1,) * (w.ndim - 2))
    bias_in = conv.inputs[2] if len(conv.inputs) > 2 else None
    b = const_value(bias_in).astype(np.float64) if bias_in is not None else \
        np.zeros(w.shape[0])
    padded = _pads(conv)
    if mean is not None and not padded:
        b = b - (w1 * mean.reshape((1, -1) + (1,) * (w.ndim - 2))).sum(
            axis=tuple(range(1, w.ndim)))
    if reverse:
        w1 = w1[:, ::-1]
    conv.set_input(1, chain.const("weight", np.ascontiguousarray(w1.astype(dtype))))
    if bias_in is not None or (mean is not None and not padded):
        conv.set_input(2, chain.const("bias", b.astype(dtype)))
    if mean is not None and padded:
        m_in = mean[::-1] if reverse else mean  # the mean of each channel as the input has it
        cur = chain.add("Sub", [cur, chain.const("mean", m_in.astype(dtype).reshape(1, -1, 1,
                                                                                    1))])
    return cur


__all__ = ["LAYOUTS", "RESIZE_MODES", "preprocess"]
