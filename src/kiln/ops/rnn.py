"""Recurrent layers: RNN, GRU, LSTM (all directions, sequence_lens, layout, clip, custom
activations). The input projection of all time steps is one matmul up front; the loop
over time does only the recurrent matmul and the gates.

At batch 1 a step's arrays hold a few hundred values, so a step costs its number of NumPy
calls (each a fixed dispatch cost) plus the recurrent product. Layers with the default
activations, no clip and no ragged sequences therefore run a tighter loop (``_*_steps``):
every buffer allocated once, each call writing in place with ``out=``, at batch 1 the
recurrent product as R @ h on R as stored (``_product``), and the sigmoid gates computed
as ``0.5 + 0.5 * tanh(x / 2)``, so one ``tanh`` covers all of a step's gates."""

from __future__ import annotations

import numpy as np

from kiln.ops.conv import work_dtype
from kiln.ops.registry import op


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1 / (1 + np.exp(-x))


def _activation(name: str, alpha, beta):
    """The activation named ``name`` (case-insensitive) with its alpha/beta."""
    n = name.lower()
    a = alpha
    b = beta
    table = {
        "relu": lambda x: np.maximum(x, 0),
        "tanh": np.tanh,
        "sigmoid": _sigmoid,
        "affine": lambda x: a * x + b,
        "leakyrelu": lambda x: np.where(x >= 0, x, a * x),
        "thresholdedrelu": lambda x: np.where(x >= a, x, 0).astype(x.dtype),
        "scaledtanh": lambda x: a * np.tanh(b * x),
        "hardsigmoid": lambda x: np.clip(a * x + b, 0, 1),
        "elu": lambda x: np.where(x >= 0, x, a * (np.exp(np.minimum(x, 0)) - 1)),
        "softsign": lambda x: x / (1 + np.abs(x)),
        "softplus": lambda x: np.logaddexp(x, 0),
    }
    if n not in table:
        raise ValueError(f"unsupported RNN activation {name!r}")
    return table[n]


# Default alpha/beta of the activations that take them (those of the ONNX ops).
_ALPHA = {"affine": 1.0, "leakyrelu": 0.01, "thresholdedrelu": 1.0, "scaledtanh": 1.0,
          "hardsigmoid": 0.2, "elu": 1.0}
_BETA = {"affine": 0.0, "scaledtanh": 1.0, "hardsigmoid": 0.5}


def _activations(names, alphas, betas, defaults, num_dirs):
    """One list of activation functions per direction; alpha/beta values are consumed in
    order by the activations that use them."""
    names = list(names or defaults * num_dirs)
    if isinstance(names[0], bytes):
        names = [n.decode() for n in names]
    alphas, betas = list(alphas or []), list(betas or [])
    fns = []
    for name in names:
        n = name.lower()
        a = alphas.pop(0) if n in _ALPHA and alphas else _ALPHA.get(n, 0.0)
        b = betas.pop(0) if n in _BETA and betas else _BETA.get(n, 0.0)
        fns.append(_activation(n, a, b))
    per = len(defaults)
    if len(fns) == per and num_dirs == 2:
        fns = fns * 2
    return [fns[d * per:(d + 1) * per] for d in range(num_dirs)]


class _Setup:
    """What every recurrent op shares: layouts, directions, masks, the input projection."""

    def __init__(self, x, w, b, sequence_lens, initial, direction, layout, gates):
        if isinstance(direction, bytes):
            direction = direction.decode()
        self.dtype = x.dtype
        self.wd = work_dtype(x.dtype)
        self.layout = layout
        x = x.astype(self.wd, copy=False)
        if layout:
            x = np.swapaxes(x, 0, 1)
            initial = [None if s is None else np.swapaxes(s, 0, 1) for s in initial]
        self.t_len, self.batch = x.shape[:2]
        self.num_dirs = w.shape[0]
        self.hidden = w.shape[1] // gates
        self.reverse = [direction == "reverse" or d == 1 for d in range(self.num_dirs)]
        self.lens = None
        if sequence_lens is not None:
            lens = np.asarray(sequence_lens).astype(np.int64).reshape(-1)
            if not (lens == self.t_len).all():  # every sequence full: nothing to mask
                self.lens = lens
        # Input projection for all steps and both directions: (dirs, T, B, gates*H).
        wt = w.astype(self.wd, copy=False)
        self.xw = np.matmul(x.reshape(1, -1, x.shape[2]), np.swapaxes(wt, 1, 2))
        self.xw = self.xw.reshape(self.num_dirs, self.t_len, self.batch, -1)
        if b is not None:
            self.xw += b.astype(self.wd)[:, None, None, :gates * self.hidden]
        self.rb = None if b is None else b.astype(self.wd)[:, gates * self.hidden:]
        self.initial = [np.zeros((self.num_dirs, self.batch, self.hidden), self.wd)
                        if s is None else s.astype(self.wd) for s in initial]

    def steps(self, d):
        order = range(self.t_len - 1, -1, -1) if self.reverse[d] else range(self.t_len)
        for t in order:
            mask = None if self.lens is None else (t < self.lens)[:, None]
            yield t, mask

    def outputs(self, ctx, y, finals):
        """(Y, Y_h[, Y_c]) in the op's layout and dtype."""
        y = np.stack(y, axis=1)  # (T, dirs, B, H)
        finals = list(finals)
        if self.layout:
            y = np.transpose(y, (2, 0, 1, 3))
            finals = [np.swapaxes(f, 0, 1) for f in finals]
        outs = [y] + finals
        outs = [np.ascontiguousarray(o).astype(self.dtype, copy=False) for o in outs]
        return tuple(outs[:ctx.num_outputs]) if ctx.num_outputs > 1 else outs[0]


def _clip(v, clip):
    return v if clip is None else np.clip(v, -clip, clip)


def _blend(mask, new, old):
    return new if mask is None else np.where(mask, new, old)


def _masked_out(mask, h):
    return h if mask is None else np.where(mask, h, 0)


def _plain(activations, activation_alpha, activation_beta, clip, defaults, s) -> bool:
    """Whether the layer takes the tight loop: ``defaults`` activations (for each
    direction), no clip, no ragged sequences."""
    if clip is not None or activation_alpha or activation_beta or s.lens is not None \
            or s.t_len == 0:
        return False
    if not activations:
        return True
    names = [(n.decode() if isinstance(n, bytes) else n).lower() for n in activations]
    return names in (defaults, defaults * s.num_dirs)


def _order(s, d, *seqs):
    """Per-step views of each of ``seqs`` (arrays over time), in direction ``d``'s order."""
    lists = [list(q) for q in seqs]
    return zip(*(q[::-1] for q in lists)) if s.reverse[d] else zip(*lists)


def _product(s, r, d):
    """(step views of an array over time, ``mv(h, out)``: out = h @ R^T for R = ``r``'s
    rows of direction ``d``). At batch 1 the state is a vector and the product R @ h reads
    R as stored: no transposed copy of R a call, and OpenBLAS's matrix-vector product of a
    C-ordered matrix is its fast one; a batch multiplies by R's transposed view."""
    rd = r[d] if r.dtype == s.wd else r[d].astype(s.wd)
    if s.batch == 1:
        def rows(a):
            return a[:, 0]

        def mv(rr, h, out):
            return np.matmul(rr, h, out=out)
    else:
        def rows(a):
            return a

        def mv(rr, h, out):
            return np.matmul(h, rr.T, out=out)
    return rows, rd, mv


def _rnn_steps(s, r, d, relu: bool):
    """RNN (tanh or relu), direction ``d``: (Y over time, final h)."""
    rows, rd, mv = _product(s, r, d)
    xw = s.xw[d] if s.rb is None else s.xw[d] + s.rb[d]
    y = np.empty((s.t_len, s.batch, s.hidden), s.wd)
    h = rows(s.initial[0][d][None])[0]
    add, act = np.add, np.tanh
    for yt, xt in _order(s, d, rows(y), rows(xw)):
        mv(rd, h, yt)
        add(yt, xt, out=yt)
        if relu:
            np.maximum(yt, 0, out=yt)
        else:
            act(yt, out=yt)
        h = yt
    return y, y[0 if s.reverse[d] else -1]


def _sigmoid_(v: np.ndarray, half: np.ndarray) -> None:
    """``v`` = sigmoid(``v``) in place, as 0.5 + 0.5 * tanh(v / 2): four in-place passes
    and no temporary (``half`` holds 0.5 in ``v``'s shape)."""
    np.multiply(v, half, out=v)
    np.tanh(v, out=v)
    np.multiply(v, half, out=v)
    np.add(v, half, out=v)


def _gru_steps(s, r, d, linear_before_reset: int):
    """GRU with sigmoid/tanh, direction ``d``: (Y over time, final h)."""
    hsz, wd = s.hidden, s.wd
    rows, rd, mv = _product(s, r, d)
    rb = np.zeros(3 * hsz, wd) if s.rb is None else s.rb[d]
    # z and r take the recurrent bias with the input's; h's goes inside the reset product
    # when linear_before_reset, else it is a plain bias
    xw = s.xw[d] + (np.concatenate([rb[:2 * hsz], np.zeros(hsz, wd)]) if linear_before_reset
                    else rb)
    y = np.empty((s.t_len, s.batch, hsz), wd)
    h = rows(s.initial[0][d][None])[0]
    shape = (3 * hsz,) if s.batch == 1 else (s.batch, 3 * hsz)
    half = np.full(shape[:-1] + (2 * hsz,), 0.5, wd)
    gates = np.empty(shape, wd)
    zr, z, rg, n = (gates[..., :2 * hsz], gates[..., :hsz], gates[..., hsz:2 * hsz],
                    gates[..., 2 * hsz:])
    rh, diff = np.empty(shape[:-1] + (hsz,), wd), np.empty(shape[:-1] + (hsz,), wd)
    add, mul, sub, tanh = np.add, np.multiply, np.subtract, np.tanh
    xz, xh = rows(xw)[..., :2 * hsz], rows(xw)[..., 2 * hsz:]
    if linear_before_reset:
        bh = np.broadcast_to(rb[2 * hsz:], rh.shape)
        for yt, xzt, xht in _order(s, d, rows(y), xz, xh):
            mv(rd, h, gates)
            add(zr, xzt, out=zr)
            _sigmoid_(zr, half)
            add(n, bh, out=n)
            mul(n, rg, out=n)
            add(n, xht, out=n)
            tanh(n, out=n)
            sub(h, n, out=diff)
            mul(diff, z, out=diff)
            add(n, diff, out=yt)
            h = yt
        return y, y[0 if s.reverse[d] else -1]
    rzr, rhh = rd[:2 * hsz], rd[2 * hsz:]
    for yt, xzt, xht in _order(s, d, rows(y), xz, xh):
        mv(rzr, h, zr)
        add(zr, xzt, out=zr)
        _sigmoid_(zr, half)
        mul(rg, h, out=rh)
        mv(rhh, rh, n)
        add(n, xht, out=n)
        tanh(n, out=n)
        sub(h, n, out=diff)
        mul(diff, z, out=diff)
        add(n, diff, out=yt)
        h = yt
    return y, y[0 if s.reverse[d] else -1]


def _lstm_steps(s, r, d):
    """LSTM with sigmoid/tanh/tanh and no peepholes, direction ``d``: (Y, final h, c)."""
    hsz, wd = s.hidden, s.wd
    rows, rd, mv = _product(s, r, d)
    xw = s.xw[d] if s.rb is None else s.xw[d] + s.rb[d]
    y = np.empty((s.t_len, s.batch, hsz), wd)
    h = rows(s.initial[0][d][None])[0]
    c = rows(s.initial[1][d][None])[0].copy()
    shape = (4 * hsz,) if s.batch == 1 else (s.batch, 4 * hsz)
    half = np.full(shape[:-1] + (3 * hsz,), 0.5, wd)
    gates = np.empty(shape, wd)
    sig = gates[..., :3 * hsz]  # ONNX's gate order i, o, f, c: the sigmoids first
    i, o, f, g = (gates[..., j * hsz:(j + 1) * hsz] for j in range(4))
    tmp = np.empty(c.shape, wd)
    add, mul, tanh = np.add, np.multiply, np.tanh
    for yt, xt in _order(s, d, rows(y), rows(xw)):
        mv(rd, h, gates)
        add(gates, xt, out=gates)
        mul(sig, half, out=sig)  # sigmoid(x) = 0.5 + 0.5 * tanh(x / 2)
        tanh(gates, out=gates)
        mul(sig, half, out=sig)
        add(sig, half, out=sig)
        mul(c, f, out=c)
        mul(i, g, out=tmp)
        add(c, tmp, out=c)
        tanh(c, out=tmp)
        mul(o, tmp, out=yt)
        h = yt
    return y, y[0 if s.reverse[d] else -1], c.reshape(s.batch, hsz)


@op("RNN", 1)
def rnn(ctx, x, w, r, b=None, sequence_lens=None, initial_h=None, *, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward",
        hidden_size=None, layout=0):
    s = _Setup(x, w, b, sequence_lens, [initial_h], direction, layout, 1)
    for kind in ("tanh", "relu"):
        if _plain(activations, activation_alpha, activation_beta, clip, [kind], s):
            done = [_rnn_steps(s, r, d, kind == "relu") for d in range(s.num_dirs)]
            return s.outputs(ctx, [y for y, _ in done], [np.stack([h for _, h in done])])
    acts = _activations(activations, activation_alpha, activation_beta, ["Tanh"], s.num_dirs)
    ys, hs = [], []
    for d in range(s.num_dirs):
        f = acts[d][0]
        rt = r[d].astype(s.wd).T
        bias = 0 if s.rb is None else s.rb[d]
        h = s.initial[0][d]
        y = np.zeros((s.t_len, s.batch, s.hidden), s.wd)
        for t, mask in s.steps(d):
            hn = f(_clip(s.xw[d, t] + h @ rt + bias, clip))
            h = _blend(mask, hn, h)
            y[t] = _masked_out(mask, hn)
        ys.append(y)
        hs.append(h)
    return s.outputs(ctx, ys, [np.stack(hs)])


@op("GRU", 1)
def gru(ctx, x, w, r, b=None, sequence_lens=None, initial_h=None, *, activation_alpha=None,
        activation_beta=None, activations=None, clip=None, direction="forward",
        hidden_size=None, layout=0, linear_before_reset=0):
    s = _Setup(x, w, b, sequence_lens, [initial_h], direction, layout, 3)
    if _plain(activations, activation_alpha, activation_beta, clip, ["sigmoid", "tanh"], s):
        done = [_gru_steps(s, r, d, linear_before_reset) for d in range(s.num_dirs)]
        return s.outputs(ctx, [y for y, _ in done], [np.stack([h for _, h in done])])
    acts = _activations(activations, activation_alpha, activation_beta, ["Sigmoid", "Tanh"],
                        s.num_dirs)
    hsz = s.hidden
    ys, hs = [], []
    for d in range(s.num_dirs):
        f, g = acts[d]
        rd = r[d].astype(s.wd)
        rzr_t = rd[:2 * hsz].T
        rh_t = rd[2 * hsz:].T
        rb = np.zeros(3 * hsz, s.wd) if s.rb is None else s.rb[d]
        h = s.initial[0][d]
        y = np.zeros((s.t_len, s.batch, hsz), s.wd)
        for t, mask in s.steps(d):
            xw = s.xw[d, t]
            zr = f(_clip(xw[:, :2 * hsz] + h @ rzr_t + rb[:2 * hsz], clip))
            z, rg = zr[:, :hsz], zr[:, hsz:]
            if linear_before_reset:
                hh = xw[:, 2 * hsz:] + rg * (h @ rh_t + rb[2 * hsz:])
            else:
                hh = xw[:, 2 * hsz:] + (rg * h) @ rh_t + rb[2 * hsz:]
            hh = g(_clip(hh, clip))
            hn = (1 - z) * hh + z * h
            h = _blend(mask, hn, h)
            y[t] = _masked_out(mask, hn)
        ys.append(y)
        hs.append(h)
    return s.outputs(ctx, ys, [np.stack(hs)])


@op("LSTM", 1)
def lstm(ctx, x, w, r, b=None, sequence_lens=None, initial_h=None, initial_c=None, p=None,
         *, activation_alpha=None, activation_beta=None, activations=None, clip=None,
         direction="forward", hidden_size=None, input_forget=0, layout=0):
    s = _Setup(x, w, b, sequence_lens, [initial_h, initial_c], direction, layout, 4)
    if not input_forget and (p is None or not np.any(p)) and _plain(
            activations, activation_alpha, activation_beta, clip, ["sigmoid", "tanh", "tanh"], s):
        done = [_lstm_steps(s, r, d) for d in range(s.num_dirs)]
        return s.outputs(ctx, [x[0] for x in done], [np.stack([x[1] for x in done]),
                                                     np.stack([x[2] for x in done])])
    acts = _activations(activations, activation_alpha, activation_beta,
                        ["Sigmoid", "Tanh", "Tanh"], s.num_dirs)
    hsz = s.hidden
    ys, hs, cs = [], [], []
    for d in range(s.num_dirs):
        f, g, hf = acts[d]
        rt = r[d].astype(s.wd).T
        rb = 0 if s.rb is None else s.rb[d]
        pi, po, pf = (np.zeros(hsz, s.wd),) * 3 if p is None else \
            np.split(p[d].astype(s.wd), 3)
        h, c = s.initial[0][d], s.initial[1][d]
        y = np.zeros((s.t_len, s.batch, hsz), s.wd)
        for t, mask in s.steps(d):
            gates = s.xw[d, t] + h @ rt + rb
            gi, go, gf, gc = (gates[:, k * hsz:(k + 1) * hsz] for k in range(4))
            i = f(_clip(gi + pi * c, clip))
            fg = 1 - i if input_forget else f(_clip(gf + pf * c, clip))
            cn = fg * c + i * g(_clip(gc, clip))
            o = f(_clip(go + po * cn, clip))
            hn = o * hf(cn)
            h = _blend(mask, hn, h)
            c = _blend(mask, cn, c)
            y[t] = _masked_out(mask, hn)
        ys.append(y)
        hs.append(h)
        cs.append(c)
    return s.outputs(ctx, ys, [np.stack(hs), np.stack(cs)])
