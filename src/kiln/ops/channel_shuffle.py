"""Kiln's ChannelShuffle (domain ``ai.kiln``): ShuffleNet's interleaving of channel groups,

    ChannelShuffle(x, group=g) = Reshape(Transpose(Reshape(x, [N, g, C/g, *S]),
                                                   [0, 2, 1, 3, ...]), [N, C, *S])

which is how exporters write it (``kiln.passes.fuse_shuffle`` fuses the three back). One
op lets a backend move the channels in one pass in the input's own layout: torch's
``channel_shuffle`` keeps an NHWC tensor NHWC, where the three ops copy it to NCHW twice.
"""

from __future__ import annotations

from kiln.ir import TensorType
from kiln.ops import cost
from kiln.ops._array import namespace
from kiln.ops.function_body import NoBody, function_body
from kiln.ops.registry import KILN_DOMAIN, op


def _infer(x, **attrs):
    return x if isinstance(x, TensorType) else None


@op("ChannelShuffle", 1, domain=KILN_DOMAIN, generic=True, infer=_infer,
    cost=cost.elementwise)
def channel_shuffle(x, *, group=1):
    """Channel ``k * g + j`` of the output is channel ``j * (C / g) + k`` of ``x``."""
    xp = namespace(x)
    n, c = x.shape[:2]
    y = xp.reshape(x, (n, group, c // group) + tuple(x.shape[2:]))
    y = xp.permute_dims(y, (0, 2, 1) + tuple(range(3, y.ndim)))
    return xp.reshape(y, tuple(x.shape))


@function_body("ChannelShuffle")
def _body(b):
    shape = b.node.inputs[0].shape
    if shape is None or not all(isinstance(d, int) for d in shape[1:]):
        raise NoBody("ChannelShuffle: the channel and spatial sizes are not known")
    g, c, rest = int(b.attrs.get("group", 1)), shape[1], list(shape[2:])
    y = b.op("Reshape", b.input(0), b.ints([0, g, c // g] + rest))
    y = b.op("Transpose", y, perm=[0, 2, 1] + list(range(3, len(shape) + 1)))
    b.finish(b.op("Reshape", y, b.ints([0, c] + rest)))
