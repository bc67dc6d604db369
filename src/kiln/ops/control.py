"""Control flow: If (Loop and Scan live beside it). Subgraph attributes arrive compiled;
``ctx.run`` evaluates them with this node's enclosing values in scope."""

from __future__ import annotations

import numpy as np

from kiln.ops.registry import op


@op("If", 1)
def if_(ctx, cond, *, then_branch, else_branch):
    branch = then_branch if bool(np.asarray(ctx.backend.to_numpy(cond)).reshape(-1)[0]) \
        else else_branch
    out = ctx.run(branch, [])
    return tuple(out) if len(out) != 1 else out[0]
