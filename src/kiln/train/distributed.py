"""SINGA's distributed training options as DistributedDataParallel communication hooks.

SINGA's ``DistOpt`` trains data-parallel with one of five ``dist_option`` values; here each
is a hook on ``torch.nn.parallel.DistributedDataParallel`` (any module, a Kiln module
included), registered by :func:`dist_option`:

- ``"fp32"``: plain all-reduce of the gradients, averaged: DDP's own, no hook.
- ``"fp16"`` / ``"bf16"``: each gradient bucket is cast to half (or bfloat16) precision,
  all-reduced in it and cast back: half the bytes. Divided by the number of processes
  before the cast, so the sum stays in half's range.
- ``"partialUpdate"``: no gradient is exchanged. Each process steps with its own gradient,
  and every step one partition of the parameters (``threshold`` elements of each DDP
  bucket, rotating) is averaged over the processes, so every parameter is re-synchronised
  once per cycle. SINGA averages partition k after the local update; a hook runs before
  the optimizer's step, so here partition k is averaged just before it (that step's own
  update of partition k stays local until the next cycle).
- ``"sparseTopK"``: each process sends only the ``spars`` fraction of each bucket's
  gradient elements largest in magnitude (indices and values); ``"sparseThreshold"``:
  only the elements whose magnitude is at least ``spars``. The sparse gradients are
  gathered, summed and averaged. With ``corr=True`` (SINGA's default) what was not sent
  is kept and added to the next step's gradient (error feedback), so no gradient is lost,
  only delayed.

DDP's buckets (``bucket_cap_mb``) play the part of SINGA's fused tensors. The returned
:class:`DistState` counts the bytes this process handed to collectives per step
(``payload_bytes``; not counted for ``"fp32"``, which is DDP's own all-reduce).
"""

# No `from __future__ import annotations`: DDP checks a hook's annotations as objects.
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kiln.errors import OptionError

__all__ = ["OPTIONS", "DistState", "dist_option"]

OPTIONS = ("fp32", "fp16", "bf16", "partialUpdate", "sparseTopK", "sparseThreshold")
_LOW = {"fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class DistState:
    """The state of one process's hook: the option, its settings, the step counter (steps
    are counted at the last bucket), the error-feedback residuals per parameter, and the
    bytes the hook handed to collectives (``payload_bytes``, summed over steps; stays 0
    for ``"fp32"``)."""

    option: str
    spars: float = 0.05
    threshold: int = 2097152
    corr: bool = True
    group: object = None
    step: int = 0
    payload_bytes: int = 0
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)  # by id(parameter)

    @property
    def world(self) -> int:
        """The number of processes in the group."""
        return dist.get_world_size(self.group)


def dist_option(
    ddp: torch.nn.parallel.DistributedDataParallel,
    option: str = "fp32",
    *,
    spars: float = 0.05,
    threshold: int = 2097152,
    corr: bool = True,
    process_group: object = None,
) -> DistState:
    """Register SINGA's ``option`` (one of :data:`OPTIONS`) as ``ddp``'s communication hook
    and return its :class:`DistState`. Call once, before the first backward.

    ``spars``: the fraction of elements sent (``sparseTopK``) or the magnitude an element
    must reach to be sent (``sparseThreshold``); ``corr``: error feedback for both;
    ``threshold``: the elements of each bucket averaged per step (``partialUpdate``).
    """
    if option not in OPTIONS:
        raise OptionError(f"unknown dist_option {option!r}; choose one of {', '.join(OPTIONS)}")
    if option == "sparseTopK" and not 0 < spars <= 1:
        raise OptionError(
            f"sparseTopK sends a fraction of the gradient: spars={spars} is not in (0, 1]"
        )
    if option == "sparseThreshold" and spars < 0:
        raise OptionError(f"sparseThreshold needs a magnitude >= 0, got spars={spars}")
    if threshold < 1:
        raise OptionError(f"threshold must be at least 1 element, got {threshold}")
    state = DistState(option, spars, threshold, corr, process_group)
    if option != "fp32":  # fp32 is DDP's own all-reduce: no hook
        hook = {
            "fp16": _low,
            "bf16": _low,
            "partialUpdate": _partial,
            "sparseTopK": _sparse,
            "sparseThreshold": _sparse,
        }[option]
        ddp.register_comm_hook(state, hook)
    return state


def _done(state: DistState, bucket: dist.GradBucket) -> None:
    if bucket.is_last():
        state.step += 1


def _ready(t: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(t)
    return fut


def _low(state: DistState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    low = buf.div(state.world).to(_LOW[state.option])  # averaged first: no overflow in half
    state.payload_bytes += low.numel() * low.element_size()
    _done(state, bucket)
    fut = dist.all_reduce(low, group=state.group, async_op=True).get_future()

    def back(f: torch.futures.Future) -> torch.Tensor:
        buf.copy_(f.value()[0])
        return buf

    return fut.then(back)


def _partial(state: DistState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()  # this process's own gradient, returned as it is
    params = bucket.parameters()
    n = sum(p.numel() for p in params)
    parts = math.ceil(n / state.threshold)
    lo = (state.step % parts) * state.threshold
    hi = min(n, lo + state.threshold)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    part = flat[lo:hi].div_(state.world)
    state.payload_bytes += part.numel() * part.element_size()
    dist.all_reduce(part, group=state.group)
    at = 0
    with torch.no_grad():
        for p in params:  # write the averaged slice back into the parameters it covers
            a, b = max(lo, at), min(hi, at + p.numel())
            if a < b:
                p.view(-1)[a - at : b - at].copy_(part[a - lo : b - lo])
            at += p.numel()
    _done(state, bucket)
    return _ready(buf)


def _sparse(state: DistState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    g = buf.float()
    params = bucket.parameters()
    if state.corr and state.residuals:
        # kept per parameter: DDP re-forms its buckets after the first step
        g = g + torch.cat(
            [state.residuals.get(id(p), g.new_zeros(p.numel())).reshape(-1) for p in params]
        )
    mag = g.abs()
    if state.option == "sparseTopK":
        idx = mag.topk(max(1, math.ceil(state.spars * g.numel())), sorted=False).indices
    else:
        idx = torch.nonzero(mag >= state.spars).reshape(-1)
    vals = g[idx]
    if state.corr:  # error feedback: what is not sent now is added to the next gradient
        rest = g.clone()
        rest[idx] = 0
        state.residuals.update(
            (id(p), r) for p, r in zip(params, rest.split([p.numel() for p in params]))
        )
    counts = [idx.numel()] * state.world
    if state.option == "sparseThreshold":  # counts differ per process: pad to the largest
        got_n = [torch.zeros(1, dtype=torch.int64) for _ in range(state.world)]
        dist.all_gather(got_n, torch.tensor([idx.numel()]), group=state.group)
        state.payload_bytes += 8
        counts = [int(c.item()) for c in got_n]
    pad = vals.new_zeros(max(counts) - idx.numel())
    # indices (int32, bit-cast) then values, in one float32 message per process
    msg = torch.cat([idx.to(torch.int32).view(torch.float32), pad, vals, pad])
    got = [torch.empty_like(msg) for _ in range(state.world)]
    state.payload_bytes += msg.numel() * msg.element_size()
    dist.all_gather(got, msg, group=state.group)
    total = torch.zeros_like(g)
    width = max(counts)
    for k, m in zip(counts, got):
        total.index_add_(0, m[:k].view(torch.int32).long(), m[width : width + k])
    buf.copy_(total.div_(state.world))
    _done(state, bucket)
    return _ready(buf)
