"""LSTM, GRU and RNN as one call of torch's fused recurrent kernel (``torch.lstm``,
``torch.gru``, ``torch.rnn_tanh``/``rnn_relu``): the whole sequence, both directions, in
C++. The NumPy kernel loops over time steps in Python and, on this backend, copied its
inputs to NumPy and back, which dominated silero VAD's one-step LSTM.

torch's cells are ONNX's default ones with the gates in another order; the weights are
reordered once when they are constants. What torch's cells do not compute (other
activations, ``clip``, peepholes, ``input_forget``, ragged ``sequence_lens``) runs on the
NumPy kernel. GRU and RNN inference on the CPU runs the NumPy kernel's step loop on the
tensors' memory instead (``NUMPY_LOOPS``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.ops import rnn as numpy_rnn
from kiln.ops.torch import kernel
from kiln.ops.torch.arrays import (
    FLOATS,
    TORCH_OF,
    decided,
    dtype_in,
    fact,
    known_dim,
    known_dtype,
    known_rank,
    to_numpy,
    to_torch,
)

NI = NotImplemented

_SINGLE_MACS = 1 << 18
"""Recurrent layers whose one step is under this many multiply-adds run on one thread: the
step's products are too small to split, and split over two threads each of the many steps
waits for the slower one (silero VAD's LSTM on the shared 2-core VM)."""


def _records_grad(args: tuple) -> bool:
    """Whether autograd records an op on ``args`` (tensors, or lists/tuples of them)."""
    if not torch.is_grad_enabled():
        return False
    flat = [a for x in args for a in (x if isinstance(x, (list, tuple)) else (x,))]
    return any(isinstance(a, torch.Tensor) and a.requires_grad for a in flat)


def _single_threaded(fn: Callable, *args):
    """``fn(*args)`` with torch's intra-op threads at one. The count is process-wide, so
    another thread's op running meanwhile may also run on one thread: slower, never wrong.

    Not when autograd records the op (training): oneDNN may pick another algorithm on one
    thread, so the forward would not round as the PyTorch module's does."""
    n = torch.get_num_threads()
    if n == 1 or _records_grad(args):
        return fn(*args)
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(n)


NUMPY_LOOPS = frozenset({"GRU", "RNN"})
"""Ops whose CPU inference runs the NumPy kernel's step loop on the tensors' memory: at
batch 1 its in-place loop took half of ``torch.gru``'s/``torch.rnn_tanh``'s time (the ATen
loop dispatches a dozen ops a step), and it computes ONNX's GRU without
``linear_before_reset`` as well, which torch's cell does not. (LSTM stays on
``torch.lstm``: oneDNN's whole-sequence kernel beats any Python loop.) The backend holds
BLAS at one thread with torch's for plans holding them."""
_ATTRS = {"GRU": ("activation_alpha", "activation_beta", "activations", "clip", "direction",
                  "hidden_size", "layout", "linear_before_reset"),
          "RNN": ("activation_alpha", "activation_beta", "activations", "clip", "direction",
                  "hidden_size", "layout")}


def _numpy_loop(site, op: str):
    """The NumPy kernel of ``op`` on zero-copy views of CPU tensors."""
    fn = {"GRU": numpy_rnn.gru, "RNN": numpy_rnn.rnn}[op]
    attrs = {k: site.attr(k) for k in _ATTRS[op] if site.attr(k) is not None}
    ctx = _Outputs(site.num_outputs)

    def run(*args):
        got = fn(ctx, *(None if a is None else to_numpy(a) for a in args), **attrs)
        outs = [to_torch(y) for y in (got if isinstance(got, tuple) else (got,))]
        return tuple(outs) if isinstance(got, tuple) else outs[0]
    site.notes.append("the NumPy kernel's step loop on the tensors' memory")
    # float X, W and R (other types take the shared kernel)
    return decided(site, [dtype_in(site, i, FLOATS) for i in range(3)], run,
                   lambda *args: all(a.dtype in FLOATS for a in args[:3]))


class _Outputs:
    """The one thing the NumPy kernels read from their context."""

    __slots__ = ("num_outputs",)

    def __init__(self, n: int):
        self.num_outputs = n

# ONNX gate blocks in torch's order: LSTM iofc -> ifco (torch's i, f, g, o); GRU zrh -> rzn.
_ORDER = {"LSTM": [0, 2, 3, 1], "GRU": [1, 0, 2], "RNN": [0]}
_DEFAULTS = {"LSTM": ["sigmoid", "tanh", "tanh"], "GRU": ["sigmoid", "tanh"]}
_CALL = {"LSTM": torch.lstm, "GRU": torch.gru}


def _activation_names(site) -> list[str]:
    acts = site.attr("activations") or []
    return [a.decode().lower() if isinstance(a, bytes) else str(a).lower() for a in acts]


def _plan(site, op: str):
    """(torch function, direction) for this node, or None where torch's cell differs."""
    if site.attr("clip") is not None or int(site.attr("input_forget", 0)):
        return None
    if site.attr("activation_alpha") or site.attr("activation_beta"):
        return None
    if op == "GRU" and not int(site.attr("linear_before_reset", 0)):
        return None  # torch's GRU applies the reset gate after the recurrent linear map
    if op == "LSTM" and site.has_input(7):
        p = site.const(7)
        if p is None or p.any():
            return None
    acts = _activation_names(site)
    if op == "RNN":
        kinds = set(acts) or {"tanh"}
        if kinds not in ({"tanh"}, {"relu"}):
            return None
        fn = torch.rnn_tanh if kinds == {"tanh"} else torch.rnn_relu
    else:
        per = _DEFAULTS[op]
        if acts and acts not in (per, per * 2):
            return None
        fn = _CALL[op]
    d = site.attr("direction", "forward")
    d = d.decode() if isinstance(d, bytes) else d
    return fn, d


def _reorder(w, order: list[int]):
    """(dirs, G*H, k) ONNX gate blocks -> torch's order, one (G*H, k) tensor per direction."""
    blocks = w.reshape(w.shape[0], len(order), -1, *w.shape[2:])
    return [blocks[d][order].reshape(-1, *w.shape[2:]).contiguous()
            for d in range(w.shape[0])]


def _params(w, r, b, order: list[int]) -> list:
    ws, rs = _reorder(w, order), _reorder(r, order)
    g_h = r.shape[1]
    if b is None:
        b = torch.zeros((w.shape[0], 2 * g_h), dtype=w.dtype, device=w.device)
    wb, rb = _reorder(b[:, :g_h], order), _reorder(b[:, g_h:], order)
    out = []
    for d in range(w.shape[0]):
        out += [ws[d], rs[d], wb[d], rb[d]]
    return out


def _recurrent(site, op: str):
    if op in NUMPY_LOOPS and site.target.device.type == "cpu" and not site.target.module \
            and not site.target.tracing:
        return _numpy_loop(site, op)
    planned = _plan(site, op)
    if planned is None:
        return None
    fn, direction = planned
    order = _ORDER[op]
    layout = int(site.attr("layout", 0))
    n_out = site.num_outputs
    consts = [site.const(i) for i in (1, 2)] + [site.const(3) if site.has_input(3) else None]
    fixed: list = []
    if not site.target.module and consts[0] is not None and consts[1] is not None and (
            consts[2] is not None or not site.has_input(3)):
        fixed = _params(*(None if c is None else torch.from_numpy(c.copy()) for c in consts),
                        order)

    one_thread_ok = site.target.device.type == "cpu" and not site.target.tracing
    kx, kw = known_dtype(site, 0), known_dtype(site, 1)
    if kx is not None and (TORCH_OF.get(kx) not in FLOATS or kw not in (None, kx)):
        return None  # types the plan knows and torch's RNNs lack: the NumPy kernel
    two = direction == "bidirectional"
    dirs_w = known_dim(site, 1, 0)
    # a 3-D X, and weights for the direction asked for: else the NumPy kernel's error
    facts = [None if kx is None or kw is None else True,
             fact(known_rank(site, 0), lambda n: n == 3),
             fact(dirs_w, lambda d: (d == 2) == two)]

    def check(x, w, *rest):
        return x.dtype in FLOATS and w.dtype == x.dtype and x.dim() == 3 and \
            (w.shape[0] == 2) == two

    def run(x, w, r, b=None, seq=None, h0=None, c0=None, p=None):
        dirs, hidden = w.shape[0], r.shape[-1]
        if layout:
            x = x.transpose(0, 1)
            h0 = None if h0 is None else h0.transpose(0, 1)
            c0 = None if c0 is None else c0.transpose(0, 1)
        steps, batch = x.shape[:2]
        if seq is not None and seq.numel() and bool((seq != steps).any()):
            return NI  # ragged sequences: the NumPy kernel masks them
        if fixed and fixed[0].dtype == x.dtype and fixed[0].device == x.device:
            params = fixed
        else:
            params = _params(w, r, b, order)
        zeros = None
        if h0 is None or op == "LSTM" and c0 is None:
            zeros = x.new_zeros((dirs, batch, hidden))
        h0 = zeros if h0 is None else h0.to(x.dtype).contiguous()
        hx = (h0, zeros if c0 is None else c0.to(x.dtype).contiguous()) if op == "LSTM" \
            else h0
        if direction == "reverse":
            x = x.flip(0)
        args = (x.contiguous(), hx, params, True, 1, 0.0, False, dirs == 2, False)
        # One step's products are tiny at batch 1 (silero VAD's: 131k MACs): split over two
        # threads every step, a 50-step layer ran far slower on the loaded VM than on one
        if one_thread_ok and batch * params[0].shape[0] * (x.shape[2] + hidden) < _SINGLE_MACS:
            res = _single_threaded(fn, *args)
        else:
            res = fn(*args)
        y = res[0]
        if direction == "reverse":
            y = y.flip(0)
        y = y.view(steps, batch, dirs, hidden).permute(0, 2, 1, 3)  # (T, dirs, B, H)
        finals = list(res[1:])
        if layout:
            y = y.permute(2, 0, 1, 3)
            finals = [f.transpose(0, 1) for f in finals]
        outs = [y.contiguous()] + [f.contiguous() for f in finals]
        return tuple(outs[:n_out]) if n_out > 1 else outs[0]
    site.notes.append(f"torch.{fn.__name__}: the sequence in one call")
    return decided(site, facts, run, check)


@kernel("LSTM", 1, prepare=True)
def lstm(site):
    return _recurrent(site, "LSTM")


@kernel("GRU", 1, prepare=True)
def gru(site):
    return _recurrent(site, "GRU")


@kernel("RNN", 1, prepare=True)
def rnn(site):
    return _recurrent(site, "RNN")
