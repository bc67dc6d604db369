"""Torch kernel for If: the condition is read on the host, the branch runs on torch as is
(the NumPy kernel would download and re-upload every branch output)."""

from __future__ import annotations

from kiln.errors import KernelError
from kiln.ops.torch import kernel


@kernel("If", 1, prepare=True)
def if_(site):
    site.wants_ctx = True
    then_branch = site.attr("then_branch")
    else_branch = site.attr("else_branch")

    def run(ctx, cond):
        if cond.numel() != 1:  # ONNX's condition is one element (onnxruntime refuses more)
            raise KernelError(f"If's condition must hold exactly one element, not "
                              f"{cond.numel()}")
        c = cond.reshape(-1)[0]
        branch = then_branch if bool(c) else else_branch
        out = ctx.run(branch, [])
        return tuple(out) if len(out) != 1 else out[0]
    return run
