"""Torch kernel for Kiln's ChannelShuffle."""

from __future__ import annotations

import torch

from kiln.ops.registry import KILN_DOMAIN
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import decided, known_dim, known_rank


@kernel("ChannelShuffle", 1, domain=KILN_DOMAIN, prepare=True)  # one op for three; NHWC stays NHWC
def channel_shuffle(site):
    group = int(site.attr("group", 1))
    # 3 dims or more, channels the groups divide (else the shared kernel's error)
    rank, channels = known_rank(site), known_dim(site, 0, 1)
    fits = False if rank is not None and rank < 3 else \
        None if channels is None else channels % group == 0
    return decided(site, [fits], lambda x: torch.channel_shuffle(x, group),
                   lambda x: x.dim() >= 3 and x.shape[1] % group == 0)
