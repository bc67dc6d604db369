"""Winograd F(2x2, 3x3) for 3x3, stride-1, undilated, ungrouped float32 convolutions.

Each 2x2 block of outputs comes from a 4x4 input tile through 16 channel-mixing products
instead of 36: the BLAS work drops 2.25x, for two cheap add-only transforms of the input
and output. It pays once channels are wide enough for the products to dominate (measured
on 2 cores: faster from 128 channels, slower at 64). Constant weights are
transformed once, when the node's kernel is prepared (:func:`transform`). Relative error
stays near 1e-6 in float32.
"""

from __future__ import annotations

import numpy as np

# Minimum input and output channels for the transform costs to be worth it.
MIN_CHANNELS = 96

_G = np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float32)
# G w G^T of every 3x3 filter at once: row-major vec(G w G^T) = (G kron G) vec(w), so one
# (16, 9) x (9, K*C) product (much faster than two tensordots and a transposing copy).
_GG = np.kron(_G, _G)


def applies(x: np.ndarray, w: np.ndarray, group: int, strides, dilations, begin,
            end) -> bool:
    """Whether this convolution is one Winograd F(2x2, 3x3) computes well."""
    return (x.dtype == np.float32 and w.dtype == np.float32 and x.ndim == 4 and group == 1
            and w.shape[2:] == (3, 3) and list(strides) == [1, 1]
            and list(dilations) == [1, 1] and min(begin) >= 0 and min(end) >= 0
            and min(w.shape[0], w.shape[1]) >= MIN_CHANNELS)


def transform(w: np.ndarray | None, group: int, strides, dilations) -> np.ndarray | None:
    """(16, K, C) transformed weights G w G^T for constant weights ``w`` of a convolution
    Winograd computes well, else None. Made once, when the node is prepared."""
    if w is None or w.dtype != np.float32 or w.ndim != 4 or group != 1 \
            or w.shape[2:] != (3, 3) or list(strides) != [1, 1] \
            or list(dilations) != [1, 1] or min(w.shape[0], w.shape[1]) < MIN_CHANNELS:
        return None
    k, c = w.shape[:2]
    return (_GG @ w.reshape(k * c, 9).T).reshape(16, k, c)


def conv3x3(x: np.ndarray, u: np.ndarray, begin, end) -> np.ndarray:
    """Convolution (no bias) of (N, C, H, W) ``x`` by the weights ``u`` that
    :func:`transform` made, padded by ``begin``/``end`` (per spatial axis), stride 1."""
    n, c, h, wd = x.shape
    k = u.shape[1]
    oh, ow = h + begin[0] + end[0] - 2, wd + begin[1] + end[1] - 2
    th, tw = -(-oh // 2), -(-ow // 2)
    # Zero-padded input covering whole tiles; tile (t, s) reads rows 2t..2t+3, cols 2s..2s+3.
    xp = np.zeros((c, n, 2 * th + 2, 2 * tw + 2), np.float32)
    rows, cols = min(h, xp.shape[2] - begin[0]), min(wd, xp.shape[3] - begin[1])
    xp[:, :, begin[0]:begin[0] + rows, begin[1]:begin[1] + cols] = \
        x[:, :, :rows, :cols].transpose(1, 0, 2, 3)
    s = xp.strides
    d = np.lib.stride_tricks.as_strided(
        xp, (4, 4, c, n, th, tw), (s[2], s[3], s[0], s[1], 2 * s[2], 2 * s[3]))
    # V = B^T d B, with B^T = [[1,0,-1,0], [0,1,1,0], [0,-1,1,0], [0,1,0,-1]].
    t = np.empty((4, 4, c, n, th, tw), np.float32)
    np.subtract(d[0], d[2], out=t[0])
    np.add(d[1], d[2], out=t[1])
    np.subtract(d[2], d[1], out=t[2])
    np.subtract(d[1], d[3], out=t[3])
    v = np.empty_like(t)
    np.subtract(t[:, 0], t[:, 2], out=v[:, 0])
    np.add(t[:, 1], t[:, 2], out=v[:, 1])
    np.subtract(t[:, 2], t[:, 1], out=v[:, 2])
    np.subtract(t[:, 1], t[:, 3], out=v[:, 3])
    m = np.matmul(u, v.reshape(16, c, -1)).reshape(4, 4, k, n, th, tw)
    # Y = A^T m A, with A^T = [[1,1,1,0], [0,1,-1,-1]].
    r = np.empty((2, 4, k, n, th, tw), np.float32)
    np.add(m[0], m[1], out=r[0])
    r[0] += m[2]
    np.subtract(m[1], m[2], out=r[1])
    r[1] -= m[3]
    y = np.empty((n, k, th, 2, tw, 2), np.float32)
    for i in range(2):
        q = r[i]
        y[:, :, :, i, :, 0] = (q[0] + q[1] + q[2]).transpose(1, 0, 2, 3)
        y[:, :, :, i, :, 1] = (q[1] - q[2] - q[3]).transpose(1, 0, 2, 3)
    return np.ascontiguousarray(y.reshape(n, k, 2 * th, 2 * tw)[:, :, :oh, :ow])
