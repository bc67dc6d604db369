"""Trained ONNX models that pip packages ship in their wheels, with realistic inputs and a
task metric, for tests and benchmarks (quantization, fp16, real-model speed).

Each :class:`TrainedModel` finds its file inside an installed package (``None`` when the
package is missing: callers skip), makes inputs from real data (files on this machine,
text lines rendered with PIL, synthesized audio) split into calibration and evaluation
sets that share no sample, and scores a converted model by *task agreement* with the fp32
model: the fraction of evaluation samples where both give the same answer (label, string,
mask pixel, speech decision). Packages are found, never imported (several pull OpenCV).

Used by tests/quantize/test_quantize_trained.py, benchmarks/quantization_trained.py and
benchmarks/real_models.py.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

__all__ = ["MODELS", "TrainedModel", "available", "get"]


def _package_file(package: str, rel: str) -> str | None:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = os.path.join(os.path.dirname(spec.origin), rel)
    return path if os.path.exists(path) else None


@dataclass
class TrainedModel:
    """One shipped model: where it is, how to feed it, how to score agreement."""

    name: str
    package: str
    rel_path: str
    task: str
    """What agreement means, in words (for tables)."""
    make_feeds: Callable[[int, int], tuple[list[dict], list[dict]]]
    """(n_calibration, n_evaluation) -> (calibration feeds, evaluation feeds), disjoint."""
    answers: Callable[[list[np.ndarray]], list]
    """A run's outputs (one feed) -> its per-sample task answers."""
    batch_axes: dict[str, int | None] | None = None
    """Each input's batch axis (None: shared by the batch, like a sample rate); the default
    None means axis 0 of every input."""
    max_batch: int | None = None
    """The largest batch the file accepts (its batch dimension is fixed), or None."""

    @property
    def path(self) -> str | None:
        """The model file, or None when the package is not installed."""
        return _package_file(self.package, self.rel_path)

    def agreement(self, ref_outputs: list[list[np.ndarray]],
                  outputs: list[list[np.ndarray]]) -> float:
        """Fraction of samples whose task answer equals the reference's."""
        same = total = 0
        for r, o in zip(ref_outputs, outputs):
            for a, b in zip(self.answers(r), self.answers(o)):
                same += bool(np.array_equal(a, b))
                total += 1
        return same / max(total, 1)


# --- magika: a file-type classifier (Conv1D, GlobalMaxPool, LayerNorm) on file bytes ----

def _real_files(limit: int) -> list[str]:
    """Files of many kinds on any Python installation: sources, data, binaries, docs."""
    roots = [os.path.dirname(os.__file__), sys.prefix]
    seen: list[str] = []
    kinds: dict[str, int] = {}
    for root in roots:
        for path in sorted(glob.glob(os.path.join(root, "**", "*"), recursive=True)):
            if not os.path.isfile(path) or os.path.islink(path) or "__pycache__" in path:
                continue
            ext = os.path.splitext(path)[1].lower() or os.path.basename(path)
            if kinds.get(ext, 0) >= 6:  # spread over kinds, not 1,000 .py files
                continue
            if os.path.getsize(path) < 64:
                continue
            kinds[ext] = kinds.get(ext, 0) + 1
            seen.append(path)
            if len(seen) >= limit:
                return seen
    return seen


def _magika_features(path: str, size: int = 1024, pad: int = 256) -> np.ndarray:
    """Magika v3's input: the first and last ``size`` bytes after stripping whitespace,
    padded with ``pad`` (its config: beg_size=end_size=1024, padding_token=256)."""
    with open(path, "rb") as f:
        head = f.read(4096)
        f.seek(max(0, os.path.getsize(path) - 4096))
        tail = f.read(4096)
    head, tail = head.lstrip(), tail.rstrip()
    beg = np.full(size, pad, np.int32)
    end = np.full(size, pad, np.int32)
    b = np.frombuffer(head[:size], np.uint8)
    e = np.frombuffer(tail[-size:], np.uint8) if tail else np.zeros(0, np.uint8)
    beg[:b.size] = b
    end[size - e.size:] = e
    return np.concatenate([beg, end])


def _magika_feeds(n_cal: int, n_eval: int, batch: int = 8):
    files = _real_files(n_cal + n_eval)
    x = np.stack([_magika_features(p) for p in files])
    rng = np.random.default_rng(0)
    x = x[rng.permutation(len(x))]
    def feeds(a):
        return [{"bytes": a[i:i + batch]} for i in range(0, len(a), batch)]
    return feeds(x[:n_cal]), feeds(x[n_cal:n_cal + n_eval])


# --- rendered text lines (PIL) for the OCR models ---------------------------------------

_WORDS = ("invoice total amount due date paid shipping order number customer account "
          "balance kiln quantize model layer tensor float integer scale zero point Q3 2026 "
          "42.50 EUR 1,337 #A-17 hello world receipt station platform gate 09:45").split()


def _text_lines(n: int, h: int, w: int, seed: int, flip_half: bool = False) -> np.ndarray:
    """``n`` RGB images (n, 3, h, w) in [-1, 1] of dark text on light paper, the
    normalization PaddleOCR's classifier and recognizer expect."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    out = np.empty((n, 3, h, w), np.float32)
    for i in range(n):
        words = " ".join(rng.choice(_WORDS, size=int(rng.integers(2, 5))))
        size = int(rng.integers(h // 2, h - 8))
        try:
            font = ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1
            font = ImageFont.load_default()
        bg = tuple(int(v) for v in rng.integers(200, 256, 3))
        fg = tuple(int(v) for v in rng.integers(0, 70, 3))
        img = Image.new("RGB", (w, h), bg)
        ImageDraw.Draw(img).text((int(rng.integers(2, 12)), (h - size) // 2 - 2), words,
                                 fill=fg, font=font)
        if flip_half and i % 2:
            img = img.rotate(180)
        a = np.asarray(img, np.float32) / 255.0
        a += rng.normal(0, 0.02, a.shape).astype(np.float32)  # scanner noise
        out[i] = ((a - 0.5) / 0.5).transpose(2, 0, 1)
    return out


def _batched(x: np.ndarray, name: str, batch: int) -> list[dict]:
    return [{name: x[i:i + batch]} for i in range(0, len(x), batch)]


def _ocr_cls_feeds(n_cal: int, n_eval: int):
    return (_batched(_text_lines(n_cal, 48, 192, 1, True), "x", 8),
            _batched(_text_lines(n_eval, 48, 192, 2, True), "x", 8))


def _ocr_rec_feeds(n_cal: int, n_eval: int):
    return (_batched(_text_lines(n_cal, 48, 320, 3), "x", 4),
            _batched(_text_lines(n_eval, 48, 320, 4), "x", 4))


def _ctc_strings(outs: list[np.ndarray]) -> list:
    """Greedy CTC decode of (batch, time, classes) scores: the label sequence read."""
    ids = outs[0].argmax(-1)
    res = []
    for row in ids:
        keep = [int(c) for j, c in enumerate(row) if c != 0 and (j == 0 or c != row[j - 1])]
        res.append(tuple(keep))
    return res


def _page(h: int, w: int, seed: int) -> np.ndarray:
    """A page (3, h, w) with several rendered text lines, normalized like PaddleOCR's
    detector input (ImageNet mean/std)."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    img = Image.new("RGB", (w, h), tuple(int(v) for v in rng.integers(215, 256, 3)))
    d = ImageDraw.Draw(img)
    y = int(rng.integers(4, 20))
    while y < h - 24:
        size = int(rng.integers(14, 30))
        try:
            font = ImageFont.load_default(size=size)
        except TypeError:
            font = ImageFont.load_default()
        words = " ".join(rng.choice(_WORDS, size=int(rng.integers(2, 6))))
        d.text((int(rng.integers(4, w // 3)), y), words,
               fill=tuple(int(v) for v in rng.integers(0, 80, 3)), font=font)
        y += size + int(rng.integers(6, 30))
    a = np.asarray(img, np.float32) / 255.0
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    std = np.array([0.229, 0.224, 0.225], np.float32)
    return ((a - mean) / std).transpose(2, 0, 1)


def _ocr_det_feeds(n_cal: int, n_eval: int):
    cal = [{"x": _page(256, 320, 100 + i)[None]} for i in range(n_cal)]
    ev = [{"x": _page(256, 320, 500 + i)[None]} for i in range(n_eval)]
    return cal, ev


def _text_mask(outs: list[np.ndarray]) -> list:
    """Per page, the text/background mask at PaddleOCR's binarization threshold 0.3,
    kept as one answer per 8x8 block (a block agrees when its text pixels agree)."""
    prob = outs[0][:, 0]
    mask = prob > 0.3
    n, h, w = mask.shape
    blocks = mask[:, :h // 8 * 8, :w // 8 * 8].reshape(n, h // 8, 8, w // 8, 8)
    return [b for page in blocks.any(axis=(2, 4)) for b in page.reshape(-1)]


# --- silero VAD: speech probability of 512-sample windows of synthesized audio ----------

def _vad_audio(n: int, seed: int) -> list[np.ndarray]:
    """``n`` windows of 512 samples at 16 kHz: voiced vowels (harmonics with a formant
    envelope and jitter), noise, silence and tones."""
    rng = np.random.default_rng(seed)
    t = np.arange(512) / 16000.0
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            f0 = rng.uniform(90, 250)
            x = sum(np.sin(2 * np.pi * f0 * k * t * (1 + rng.normal(0, 0.002))) *
                    np.exp(-((f0 * k - rng.uniform(500, 900)) / 400) ** 2) for k in range(1, 30))
        elif kind == 1:
            x = rng.normal(0, rng.uniform(0.01, 0.3), 512)
        elif kind == 2:
            x = rng.normal(0, 1e-4, 512)
        else:
            x = np.sin(2 * np.pi * rng.uniform(200, 3000) * t)
        x = np.asarray(x, np.float64)
        x = x / max(np.abs(x).max(), 1e-9) * rng.uniform(0.05, 0.9)
        out.append(x.astype(np.float32))
    return out


def _vad_feeds(n_cal: int, n_eval: int):
    def feeds(wins):
        return [{"input": w[None], "state": np.zeros((2, 1, 128), np.float32),
                 "sr": np.array(16000, np.int64)} for w in wins]
    return feeds(_vad_audio(n_cal, 7)), feeds(_vad_audio(n_eval, 8))


def _vad_seq_feeds(n_cal: int, n_eval: int):
    """Sequences of 576-sample frames (64 context + 512 new samples) of varying length: the
    sequence model's 1-D output follows the number of frames."""
    def feeds(wins, seed):
        rng = np.random.default_rng(seed)
        out, i = [], 0
        while i < len(wins):
            k = int(rng.integers(3, 13))
            chunk = wins[i:i + k]
            frames = np.stack([np.concatenate([p[-64:], w]) for p, w in
                               zip([np.zeros(512, np.float32)] + chunk[:-1], chunk)])
            out.append({"input": frames.astype(np.float32),
                        "h": np.zeros((1, 1, 128), np.float32),
                        "c": np.zeros((1, 1, 128), np.float32)})
            i += k
        return out
    return feeds(_vad_audio(n_cal, 7), 1), feeds(_vad_audio(n_eval, 8), 2)


# --- openWakeWord: log-mel front end, speech embedding, a wake-word head ----------------

_OWW = "resources/models/"


def _speech(n_samples: int, seed: int) -> np.ndarray:
    """Speech-like audio at 16 kHz as openWakeWord receives it (int16-scaled floats):
    voiced windows, noise, silence and tones in a row."""
    wins = _vad_audio(n_samples // 512 + 1, seed)
    return (np.concatenate(wins)[:n_samples] * 32767).astype(np.float32)


def _ort(path_of: str, feed: dict) -> list[np.ndarray]:
    import onnxruntime as ort  # the upstream stages' outputs: the oracle makes them
    s = ort.InferenceSession(_package_file("openwakeword", _OWW + path_of),
                             providers=["CPUExecutionProvider"])
    return s.run(None, feed)


def _oww_mel_feeds(n_cal: int, n_eval: int):
    """openWakeWord's streaming step: 1280 new samples (80 ms) and 480 of context."""
    def feeds(n, seed):
        a = _speech(1760 * max(n, 1), seed).reshape(-1, 1760)[:n]
        return [{"input": a[i:i + 1]} for i in range(n)]
    return feeds(n_cal, 11), feeds(n_eval, 12)


def _oww_mels(n: int, seed: int) -> np.ndarray:
    """``n`` windows of 76 log-mel frames, scaled as openWakeWord does (x / 10 + 2)."""
    audio = _speech(160 * (76 + 8 * n) + 480, seed)
    mel = _ort("melspectrogram.onnx", {"input": audio[None]})[0].squeeze() / 10 + 2
    return np.stack([mel[8 * i:8 * i + 76] for i in range(n)])[..., None].astype(np.float32)


def _oww_emb_feeds(n_cal: int, n_eval: int):
    return (_batched(_oww_mels(n_cal, 13), "input_1", 1) if n_cal else [],
            _batched(_oww_mels(n_eval, 14), "input_1", 1))


def _oww_head_feeds(n_cal: int, n_eval: int):
    """16 consecutive speech embeddings (1.28 s), as the wake-word heads read them."""
    def feeds(n, seed):
        if not n:
            return []
        mels = _oww_mels(n + 15, seed)
        emb = _ort("embedding_model.onnx", {"input_1": mels})[0].reshape(-1, 96)
        return [{"x.1": emb[i:i + 16][None]} for i in range(n)]
    return feeds(n_cal, 15), feeds(n_eval, 16)


# --- ddddocr's object detector (YOLOX) on real photos -------------------------------------

def _photos() -> list[np.ndarray]:
    """scikit-learn's two sample photos (HWC uint8 RGB), found on disk, not imported."""
    from PIL import Image

    d = _package_file("sklearn", "datasets/images")
    if d is None:
        return []
    return [np.asarray(Image.open(os.path.join(d, f)).convert("RGB"))
            for f in ("china.jpg", "flower.jpg")]


def _letterbox(img: np.ndarray, size: int, shift: int) -> np.ndarray:
    """ddddocr's preprocessing: fit into ``size`` keeping the aspect, pad with 114, BGR,
    CHW float of 0-255 values; ``shift`` crops a little to make distinct samples."""
    from PIL import Image

    img = img[shift:, shift:]
    r = min(size / img.shape[0], size / img.shape[1])
    h, w = int(img.shape[0] * r), int(img.shape[1] * r)
    out = np.full((size, size, 3), 114, np.uint8)
    out[:h, :w] = np.asarray(Image.fromarray(img).resize((w, h), Image.BILINEAR))
    return np.ascontiguousarray(out[..., ::-1].transpose(2, 0, 1), np.float32)


def _captcha(photo: np.ndarray, seed: int) -> np.ndarray:
    """A click captcha, what the detector is for: a few characters drawn over a photo."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    img = Image.fromarray(photo)
    d = ImageDraw.Draw(img)
    for _ in range(int(rng.integers(3, 6))):
        size = int(rng.integers(32, 64))
        try:
            font = ImageFont.load_default(size=size)
        except TypeError:  # Pillow < 10.1
            font = ImageFont.load_default()
        xy = (int(rng.integers(0, photo.shape[1] - size)), int(rng.integers(0, photo.shape[0]
                                                                            - size)))
        d.text(xy, str(rng.choice(list("AKQRWX3479"))), font=font,
               fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    return np.asarray(img)


def _dddd_det_feeds(n_cal: int, n_eval: int):
    photos = _photos()
    def feeds(n, off):
        return [{"images": _letterbox(_captcha(photos[i % len(photos)], off + i), 416,
                                      (7 * i + off) % 64)[None]} for i in range(n)]
    return feeds(n_cal, 0), feeds(n_eval, 1000)


def _boxes(outs: list[np.ndarray]) -> list:
    """Per anchor, whether it detects something (objectness x class score > 0.1, ddddocr's
    threshold)."""
    p = outs[0][0]
    return list((p[:, 4] * p[:, 5:].max(-1)) > 0.1)


MODELS: dict[str, TrainedModel] = {m.name: m for m in [
    TrainedModel("magika", "magika", "models/standard_v3_3/model.onnx",
                 "file type (top-1 label) of real files", _magika_feeds,
                 lambda o: list(o[0].argmax(-1))),
    TrainedModel("ppocr_cls", "rapidocr_onnxruntime",
                 "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
                 "text orientation (0/180) of rendered lines", _ocr_cls_feeds,
                 lambda o: list(o[0].argmax(-1))),
    TrainedModel("ppocr_rec_v4", "rapidocr_onnxruntime", "models/ch_PP-OCRv4_rec_infer.onnx",
                 "line read exactly like fp32 (greedy CTC) on rendered lines",
                 _ocr_rec_feeds, _ctc_strings),
    TrainedModel("ppocr_det_v4", "rapidocr_onnxruntime", "models/ch_PP-OCRv4_det_infer.onnx",
                 "text mask (8x8 blocks at threshold 0.3) of rendered pages",
                 _ocr_det_feeds, _text_mask),
    TrainedModel("silero_vad", "silero_vad", "data/silero_vad.onnx",
                 "speech decision (p > 0.5) of 32 ms windows of synthesized audio",
                 _vad_feeds, lambda o: list((o[0] > 0.5).reshape(-1)),
                 batch_axes={"input": 0, "state": 1, "sr": None}),
    TrainedModel("silero_vad_seq", "silero_vad", "data/silero_vad_16k_sequence.onnx",
                 "speech decision (p > 0.5) per 32 ms window, sequences of 3-12 windows",
                 _vad_seq_feeds, lambda o: list(o[0].reshape(-1) > 0.5),
                 batch_axes={"input": 0, "h": None, "c": None}),
    TrainedModel("silero_vad_ifless", "silero_vad", "data/silero_vad_op18_ifless.onnx",
                 "speech decision (p > 0.5) of 32 ms windows of synthesized audio",
                 _vad_feeds, lambda o: list((o[0] > 0.5).reshape(-1)),
                 batch_axes={"input": 0, "state": 1, "sr": None}),
    TrainedModel("oww_melspec", "openwakeword", _OWW + "melspectrogram.onnx",
                 "log-mel bins equal to fp32's once both are rounded to 0.05, on 110 ms of speech",
                 _oww_mel_feeds, lambda o: list(np.round(o[0].reshape(-1) * 20))),
    TrainedModel("oww_embedding", "openwakeword", _OWW + "embedding_model.onnx",
                 "speech embedding (96 values, rounded to 0.1) of 76 log-mel frames",
                 _oww_emb_feeds, lambda o: list(np.round(o[0].reshape(-1) * 10))),
    TrainedModel("oww_hey_jarvis", "openwakeword", _OWW + "hey_jarvis_v0.1.onnx",
                 "wake-word decision (score > 0.5) on 16 speech embeddings",
                 _oww_head_feeds, lambda o: list(o[0].reshape(-1) > 0.5), max_batch=1),
    TrainedModel("dddd_det", "ddddocr", "common_det.onnx",
                 "detecting anchors (score > 0.1) on characters drawn over scikit-learn's photos",
                 _dddd_det_feeds, _boxes, max_batch=1),
]}


def feed_at_batch(m: TrainedModel, batch: int, seed_samples: int = 16) -> dict | None:
    """One feed of ``batch`` evaluation samples of ``m`` (samples repeat when there are
    fewer), or None when the file's batch dimension does not allow ``batch``."""
    if m.max_batch is not None and batch > m.max_batch:
        return None
    _, ev = m.make_feeds(0, seed_samples)
    axes = m.batch_axes or {k: 0 for k in ev[0]}
    out = {}
    for name, first in ev[0].items():
        ax = axes.get(name, 0)
        if ax is None:
            out[name] = first
            continue
        parts = np.concatenate([f[name] for f in ev], axis=ax)
        while parts.shape[ax] < batch:
            parts = np.concatenate([parts, parts], axis=ax)
        out[name] = np.ascontiguousarray(np.take(parts, range(batch), axis=ax))
    return out


def get(name: str) -> TrainedModel:
    """The model called ``name`` (a key of :data:`MODELS`)."""
    return MODELS[name]


def available() -> list[str]:
    """Names of the models whose package is installed here."""
    return [k for k, m in MODELS.items() if m.path is not None]
