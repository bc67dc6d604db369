"""The torch kernel of ``ai.onnx.preview.training.Gradient``: the nodes computing ``y``
(``kiln.ops.training.gradient_slice``) run again through the backend's torch kernels with
autograd on, and ``torch.autograd.grad`` differentiates them; any op with a torch kernel
is covered. A node with no torch or generic kernel is refused rather than run on NumPy,
which would cut the gradient."""

from __future__ import annotations

import torch

from kiln.ops.registry import Site
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import to_torch
from kiln.ops.training import DOMAIN, bind_slice, gradient_slice, lazily, run_slice


def _differentiable(d) -> list:
    own = d.kernels.get("torch")
    return ([own] if own is not None else []) + ([d.reference] if d.generic else [])


@kernel("Gradient", 1, domain=DOMAIN, prepare=True)
def gradient(site: Site):
    device = site.target.device

    def build():
        sl = gradient_slice(site.node, site.opset_of)
        # built on the first run, inside the session's inference mode: leave it, since
        # inference tensors (constants kernels prepare) cannot be saved for backward
        with torch.inference_mode(False):
            bound = bind_slice(sl, site.target, _differentiable)
            consts = {v: to_torch(v.const).to(device) for v in sl.constants}

        def run(*inputs):
            with torch.inference_mode(False), torch.enable_grad():
                fed = [torch.as_tensor(x, device=device).clone() for x in inputs]
                xs = [x.requires_grad_(True) for x in fed[:sl.n_xs]]
                env = dict(consts)
                env.update(zip(sl.fed, fed))
                run_slice(bound, env)
                y = env[sl.y]
                if not y.requires_grad:  # y reads none of xs
                    return tuple(torch.zeros_like(x) for x in xs)
                grads = torch.autograd.grad(y, xs, torch.ones_like(y), allow_unused=True)
            return tuple(torch.zeros_like(x) if g is None else g.detach()
                         for x, g in zip(xs, grads))

        return run

    return lazily(build)
