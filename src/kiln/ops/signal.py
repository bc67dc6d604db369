"""Signal processing: DFT, STFT, window functions and the mel filterbank matrix.
Complex tensors are real tensors with a trailing [real, imag] axis of size 2."""

from __future__ import annotations

import numpy as np

from kiln.ir import DType
from kiln.ops.registry import op


def _scalar_int(x) -> int:
    return int(np.asarray(x).reshape(-1)[0])


def _to_complex(x: np.ndarray) -> np.ndarray:
    """[..., 1] real or [..., 2] (real, imag) -> complex array without the last axis."""
    if x.shape[-1] == 1:
        return x[..., 0]
    return x[..., 0] + 1j * x[..., 1].astype(np.result_type(x.dtype, np.float32))


def _from_complex(c: np.ndarray, dtype) -> np.ndarray:
    return np.stack([c.real, c.imag], axis=-1).astype(dtype, copy=False)


def _dft(x, dft_length, axis: int, inverse: int, onesided: int):
    x = np.asarray(x)
    ax = axis + x.ndim if axis < 0 else axis
    if not 0 <= ax < x.ndim - 1:
        raise ValueError(f"DFT axis {axis} is out of range for an input of rank {x.ndim}")
    c = _to_complex(x)
    n = None if dft_length is None else _scalar_int(dft_length)
    if onesided and inverse:  # IRFFT: one-sided spectrum in, real signal out
        if n is None:
            n = 2 * (c.shape[ax] - 1)
        return np.fft.irfft(c, n=n, axis=ax)[..., None].astype(x.dtype, copy=False)
    if onesided:
        if n is None:
            n = c.shape[ax]
        spec = (np.fft.rfft(c, n=n, axis=ax) if not np.iscomplexobj(c)
                else np.take(np.fft.fft(c, n=n, axis=ax), np.arange(n // 2 + 1), axis=ax))
        return _from_complex(spec, x.dtype)
    y = np.fft.ifft(c, n=n, axis=ax) if inverse else np.fft.fft(c, n=n, axis=ax)
    return _from_complex(y, x.dtype)


@op("DFT", 17, host_inputs=(1,))
def dft_v17(x, dft_length=None, *, axis=1, inverse=0, onesided=0):
    return _dft(x, dft_length, axis, inverse, onesided)


@op("DFT", 20, host_inputs=(1, 2))
def dft(x, dft_length=None, axis=None, *, inverse=0, onesided=0):
    return _dft(x, dft_length, -2 if axis is None else _scalar_int(axis), inverse, onesided)


@op("STFT", 17, host_inputs=(1, 3))
def stft(signal, frame_step, window=None, frame_length=None, *, onesided=1):
    """Frames [batch, frames, frame_length] of the signal, windowed, then DFT'd."""
    x = np.asarray(signal)
    c = _to_complex(x)
    step = _scalar_int(frame_step)
    if frame_length is not None:
        length = _scalar_int(frame_length)
    elif window is not None:
        length = np.asarray(window).shape[0]
    else:
        length = c.shape[1]
    w = np.ones(length) if window is None else np.asarray(window)
    if w.shape[0] != length:
        raise ValueError(f"STFT window has length {w.shape[0]}, frame_length is {length}")
    frames = (c.shape[1] - length) // step + 1
    idx = np.arange(frames)[:, None] * step + np.arange(length)
    framed = c[:, idx] * w  # [batch, frames, length]
    if onesided and not np.iscomplexobj(framed):
        spec = np.fft.rfft(framed, axis=-1)
    else:
        spec = np.fft.fft(framed, axis=-1)
        if onesided:
            spec = spec[..., :length // 2 + 1]
    return _from_complex(spec, x.dtype)


def _cosine_window(size, coeffs: tuple[float, ...], periodic: int, output_datatype: int):
    """sum_k (-1)^k a_k cos(2 pi k n / N), N = size (periodic) or size - 1 (symmetric)."""
    n = _scalar_int(size)
    denom = n if periodic else n - 1
    phase = 2 * np.pi * np.arange(n) / max(denom, 1)
    w = np.zeros(n)
    for k, a in enumerate(coeffs):
        w += (-1) ** k * a * np.cos(k * phase)
    return w.astype(DType(output_datatype).numpy)


@op("HannWindow", 17)
def hann_window(size, *, output_datatype=1, periodic=1):
    return _cosine_window(size, (0.5, 0.5), periodic, output_datatype)


@op("HammingWindow", 17)
def hamming_window(size, *, output_datatype=1, periodic=1):
    return _cosine_window(size, (25 / 46, 21 / 46), periodic, output_datatype)


@op("BlackmanWindow", 17)
def blackman_window(size, *, output_datatype=1, periodic=1):
    return _cosine_window(size, (0.42, 0.5, 0.08), periodic, output_datatype)


def _hz_to_mel(f):
    return 2595.0 * np.log10(1.0 + f / 700.0)


def _mel_to_hz(m):
    return 700.0 * (10.0 ** (m / 2595.0) - 1.0)


@op("MelWeightMatrix", 17)
def mel_weight_matrix(num_mel_bins, dft_length, sample_rate, lower_edge_hertz,
                      upper_edge_hertz, *, output_datatype=1):
    """[dft_length // 2 + 1, num_mel_bins] triangular filters, evenly spaced on the mel
    scale from lower_edge_hertz, each peaking at 1 on its centre spectrogram bin."""
    bins, n_fft = _scalar_int(num_mel_bins), _scalar_int(dft_length)
    rate = float(np.asarray(sample_rate).reshape(-1)[0])
    lo = float(np.asarray(lower_edge_hertz).reshape(-1)[0])
    hi = float(np.asarray(upper_edge_hertz).reshape(-1)[0])
    # The bands' edges are bins + 2 points spaced by (mel(hi) - mel(lo)) / (bins + 2), so
    # the top edge stops one step short of hi: what ONNX's test data and ORT compute.
    low_mel = _hz_to_mel(lo)
    mels = low_mel + np.arange(bins + 2) * ((_hz_to_mel(hi) - low_mel) / (bins + 2))
    edges = np.floor((n_fft + 1) * _mel_to_hz(mels) / rate).astype(np.int64)
    lower, center, upper = edges[:-2], edges[1:-1], edges[2:]
    j = np.arange(n_fft // 2 + 1)[:, None]
    rise_len, fall_len = center - lower, upper - center
    rise = np.where(rise_len > 0, (j - lower) / np.maximum(rise_len, 1), 1.0)
    fall = (upper - j) / np.maximum(fall_len, 1)
    w = np.where((j >= lower) & (j <= center), rise, 0.0)
    w = np.where((j > center) & (j < upper) & (fall_len > 0), fall, w)
    return w.astype(DType(output_datatype).numpy)
