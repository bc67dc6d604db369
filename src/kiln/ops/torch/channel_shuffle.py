"""Torch kernel for Kiln's ChannelShuffle."""

from __future__ import annotations

import torch

from kiln.ops.registry import KILN_DOMAIN
from kiln.ops.torch import kernel

NI = NotImplemented


@kernel("ChannelShuffle", 1, domain=KILN_DOMAIN)  # one op for three; NHWC stays NHWC
def channel_shuffle(x, *, group=1):
    if x.dim() < 3 or x.shape[1] % group:
        return NI  # a shape read at run time that the groups do not divide
    return torch.channel_shuffle(x, group)
