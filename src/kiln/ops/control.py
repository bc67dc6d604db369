"""Control flow: If, Loop and Scan. Subgraph attributes arrive compiled; ``ctx.run``
evaluates them with this node's enclosing values in scope. Sequences are Python lists and
an empty optional is None, so loop-carried values of any kind pass through unchanged.

Loop and Scan (9+) are generic: values stay arrays of the backend (only conditions and
trip counts are read on the host), so on torch a loop body's tensors never leave the
device between iterations."""

from __future__ import annotations

import time

import numpy as np

from kiln.errors import KernelError
from kiln.ir import TensorType
from kiln.ops._array import axis as norm_axis
from kiln.ops._array import namespace
from kiln.ops.registry import op

MAX_LOOP_ITERATIONS = 1_000_000
"""A Loop stops with KernelError after this many iterations (exporters write INT64_MAX as
the trip count of while-loops, so the count itself is no bound). Set this module attribute
to allow longer loops."""

MAX_LOOP_SCAN_BYTES = 2 << 30
"""A Loop stops with KernelError once its scan outputs hold more than this many bytes
(2 GiB): a runaway loop stacking 4 MiB an iteration would otherwise grow until the
process is killed for memory. Set this module attribute to allow more."""

MAX_LOOP_SECONDS = 300.0
"""A Loop stops with KernelError after running this long (a million iterations of a small
body take 14-40 s; a loop that runs minutes is almost always one that never ends). Set
this module attribute to allow longer; ``RunOptions.terminate`` stops any run sooner."""


def _scalar(ctx, x):
    """A control value (condition, trip count) as a NumPy scalar, read on the host. ONNX
    defines it as one element; reading the first of several would pick a branch or a trip
    count from data the model never meant as one (onnxruntime refuses it)."""
    a = np.asarray(ctx.target.take(x)).reshape(-1)
    if a.size != 1:
        raise KernelError(f"a condition or trip count must hold exactly one element, not "
                          f"{a.size}")
    return a[0]


def _outputs(out: list, ctx):
    return tuple(out) if ctx.num_outputs != 1 else out[0]


@op("If", 1)
def if_(ctx, cond, *, then_branch, else_branch):
    branch = then_branch if bool(_scalar(ctx, cond)) else else_branch
    return _outputs(ctx.run(branch, []), ctx)


def _empty_stack(ctx, body, index: int):
    """The stacked result of zero iterations of body output ``index``: shape ``(0,) +
    element shape`` where the body declares a static element shape."""
    t = body.graph.outputs[index].described_type()  # no iteration: nothing else says
    dtype, shape = np.float32, ()
    if isinstance(t, TensorType):
        if t.dtype:
            dtype = t.dtype.numpy
        if t.shape is not None and all(isinstance(d, int) for d in t.shape):
            shape = tuple(t.shape)
    return ctx.target.put(np.zeros((0, *shape), dtype=dtype))


def _stack(items: list):
    return namespace(*items).stack(items)


def _move_axis(x, src: int, dst: int):
    """``x`` with axis ``src`` moved to position ``dst`` (array-API permute_dims)."""
    if src == dst:
        return x
    order = [i for i in range(x.ndim) if i != src]
    order.insert(dst, src)
    return namespace(x).permute_dims(x, tuple(order))


@op("Loop", 1, generic=True)
def loop(ctx, max_trip_count, cond, *v_initial, body):
    trip = None if max_trip_count is None else int(_scalar(ctx, max_trip_count))
    keep_going = True if cond is None else bool(_scalar(ctx, cond))
    carried = list(v_initial)
    n = len(carried)
    num_scan = len(body.graph.outputs) - 1 - n
    scans: list[list] = [[] for _ in range(num_scan)]
    to_backend = ctx.target.put
    i, held = 0, 0
    start = time.monotonic()
    while keep_going and (trip is None or i < trip):
        if i >= MAX_LOOP_ITERATIONS:
            raise KernelError(
                f"Loop ran {i} iterations (trip count {trip}) without finishing; raise "
                "kiln.ops.control.MAX_LOOP_ITERATIONS if the model really loops this long")
        if i % 256 == 255 and time.monotonic() - start > MAX_LOOP_SECONDS:
            raise KernelError(
                f"Loop ran for more than {MAX_LOOP_SECONDS:g} s ({i} iterations, trip count "
                f"{trip}) without finishing; raise kiln.ops.control.MAX_LOOP_SECONDS if the "
                "model really loops this long")
        out = ctx.run(body, [to_backend(np.array(i, np.int64)),
                             to_backend(np.array(keep_going)), *carried])
        keep_going = bool(_scalar(ctx, out[0]))
        carried = out[1:1 + n]
        for acc, x in zip(scans, out[1 + n:]):
            acc.append(x)
            held += int(getattr(x, "nbytes", 0))
        if held > MAX_LOOP_SCAN_BYTES:
            raise KernelError(
                f"Loop's scan outputs reached {held / 2**20:,.0f} MiB after {i + 1} "
                f"iterations (trip count {trip}), over the {MAX_LOOP_SCAN_BYTES / 2**20:,.0f}"
                " MiB bound; raise kiln.ops.control.MAX_LOOP_SCAN_BYTES if the model really "
                "stacks this much")
        i += 1
    stacked = [_stack(acc) if acc else _empty_stack(ctx, body, 1 + n + k)
               for k, acc in enumerate(scans)]
    return _outputs(carried + stacked, ctx)


def _scan_body(ctx, body, states: list, slices: list, num_outputs: int):
    """Run ``body`` over the leading axis of ``slices``; returns the final states and, per
    scan output, the list of per-iteration values."""
    n = len(states)
    acc: list[list] = [[] for _ in range(num_outputs)]
    steps = slices[0].shape[0] if slices else 0
    for t in range(steps):
        out = ctx.run(body, states + [s[t, ...] for s in slices])
        states = out[:n]
        for a, x in zip(acc, out[n:]):
            a.append(x)
    return states, acc


@op("Scan", 9, generic=True)
def scan(ctx, *args, body, num_scan_inputs, scan_input_axes=None,
         scan_input_directions=None, scan_output_axes=None, scan_output_directions=None):
    m = num_scan_inputs
    n = len(args) - m
    in_axes = scan_input_axes or [0] * m
    in_dirs = scan_input_directions or [0] * m
    slices = []
    for x, ax, d in zip(args[n:], in_axes, in_dirs):
        s = _move_axis(x, norm_axis(ax, x.ndim), 0)
        slices.append(namespace(s).flip(s, axis=0) if d else s)
    k = len(body.graph.outputs) - n
    states, acc = _scan_body(ctx, body, list(args[:n]), slices, k)
    out_axes = scan_output_axes or [0] * k
    out_dirs = scan_output_directions or [0] * k
    results = []
    for j, a in enumerate(acc):
        y = _stack(a[::-1] if out_dirs[j] else a) if a else _empty_stack(ctx, body, n + j)
        results.append(_move_axis(y, 0, norm_axis(out_axes[j], y.ndim)))
    return _outputs(list(states) + results, ctx)


@op("Scan", 8)
def scan_v8(ctx, sequence_lens, *args, body, num_scan_inputs, directions=None):
    """Opset-8 Scan: axis 0 is the batch, axis 1 the sequence; each batch entry runs on its
    own, for its own length, and scan outputs are zero-padded to the longest."""
    m = num_scan_inputs
    n = len(args) - m
    to_np = ctx.target.take
    inits = [np.asarray(to_np(x)) for x in args[:n]]
    xs = [np.asarray(to_np(x)) for x in args[n:]]
    batch, max_len = xs[0].shape[:2]
    lens = ([max_len] * batch if sequence_lens is None
            else [int(v) for v in np.asarray(to_np(sequence_lens)).reshape(-1)])
    dirs = directions or [0] * m
    k = len(body.graph.outputs) - n
    final_states: list[list] = [[] for _ in range(n)]
    outs: list[list] = [[] for _ in range(k)]
    for b in range(batch):
        length = lens[b]
        slices = [x[b, :length][::-1] if d else x[b, :length] for x, d in zip(xs, dirs)]
        states, acc = _scan_body(ctx, body, [s[b] for s in inits], slices, k)
        for f, s in zip(final_states, states):
            f.append(np.asarray(to_np(s)))
        for j, a in enumerate(acc):
            y = np.stack([to_np(x) for x in a]) if a else to_np(_empty_stack(ctx, body, n + j))
            if length < max_len:
                pad = [(0, max_len - length)] + [(0, 0)] * (y.ndim - 1)
                y = np.pad(y, pad)
            outs[j].append(y)
    results = [np.stack(f) for f in final_states] + [np.stack(o) for o in outs]
    return _outputs(results, ctx)
