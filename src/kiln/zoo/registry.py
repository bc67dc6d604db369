"""The zoo's model registry and seeded input generation (numpy only; torch is not imported)."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

__all__ = ["REGISTRY", "TensorSpec", "ZooEntry", "close_names", "get_entry", "make_inputs"]

Dim = int | str  # a fixed size, or a symbolic name ("batch", "seq")


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output: name, numpy dtype name, shape template and how to fill it.

    ``kind`` is ``"image"`` (standard normal float32), ``"ids"`` (integers in ``[low, high)``,
    ``pad`` on padded positions), ``"mask"`` (1 on real tokens, 0 on padding), ``"segment"``
    (token type: 0 for the first half of the real tokens, 1 after) or ``"output"``.
    """

    name: str
    shape: tuple[Dim, ...]
    dtype: str = "float32"
    kind: str = "image"
    low: int = 0
    high: int = 0
    pad: int = 0


@dataclass(frozen=True)
class ZooEntry:
    """A buildable zoo model.

    ``factory`` is ``"module:function"`` returning a torch ``nn.Module`` in eval mode whose
    positional ``forward`` arguments are ``inputs``. ``atol``/``rtol`` are the tolerances for
    comparing a float32 engine against the onnxruntime reference outputs
    (``np.allclose(got, ref, atol, rtol)``): about 10x the measured torch-vs-ORT disagreement,
    so they scale with each model's output magnitude (resnet50 logits reach ~300).
    """

    name: str
    family: str
    task: str
    description: str
    exporter: str  # "torchscript" or "dynamo"
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    factory: str = field(repr=False)
    atol: float = 1e-4
    rtol: float = 1e-4
    opset: int = 17
    seed: int = 0
    keep_bn: bool = False  # TorchScript only: export BatchNormalization unfused (PRESERVE mode)

    def make_model(self) -> Any:
        """Seed torch with ``self.seed`` and build the (eval-mode) torch module."""
        import torch

        torch.manual_seed(self.seed)
        mod, fn = self.factory.split(":")
        builder: Callable[[], Any] = getattr(importlib.import_module(mod), fn)
        return builder().eval()

    @property
    def is_text(self) -> bool:
        """True for models with a symbolic ``seq`` dimension."""
        return any("seq" in t.shape for t in self.inputs)


def _img(*chw: int) -> tuple[TensorSpec, ...]:
    return (TensorSpec("input", ("batch", *chw)),)


def _out(name: str, *dims: Dim) -> TensorSpec:
    return TensorSpec(name, ("batch", *dims), kind="output")


_V, _T = "kiln.zoo.vision", "kiln.zoo.text"
_IDS = dict(dtype="int64", kind="ids", low=5, high=8192)


def _tok(name: str, **kw: Any) -> TensorSpec:
    return TensorSpec(name, ("batch", "seq"), **{"dtype": "int64", **kw})


_BASE: list[ZooEntry] = [
    ZooEntry("resnet18", "resnet", "image-classification", "ResNet-18, 224x224, 1000 classes",
             "torchscript", _img(3, 224, 224), (_out("logits", 1000),), f"{_V}:resnet18"),
    ZooEntry("resnet50", "resnet", "image-classification", "ResNet-50 v1.5, 224x224, BN unfused",
             "torchscript", _img(3, 224, 224), (_out("logits", 1000),), f"{_V}:resnet50",
             atol=5e-3, rtol=1e-3, keep_bn=True),
    ZooEntry("mobilenetv2", "mobilenet", "image-classification",
             "MobileNetV2 1.0 (depthwise conv, ReLU6/Clip), 224x224", "torchscript",
             _img(3, 224, 224), (_out("logits", 1000),), f"{_V}:mobilenetv2", atol=3e-4),
    ZooEntry("shufflenetv2", "shufflenet", "image-classification",
             "ShuffleNetV2 x1.0 (Split/Concat/Reshape/Transpose shuffle), 224x224", "torchscript",
             _img(3, 224, 224), (_out("logits", 1000),), f"{_V}:shufflenetv2", atol=1e-3),
    ZooEntry("vgg16", "vgg", "image-classification", "VGG-16 (no BN), 224x224, 138M params",
             "torchscript", _img(3, 224, 224), (_out("logits", 1000),), f"{_V}:vgg16",
             atol=5e-4, rtol=1e-3),
    ZooEntry("tinyyolov2", "yolo", "object-detection",
             "Tiny-YOLOv2-style VOC detector, 416x416 -> 125x13x13 grid", "torchscript",
             _img(3, 416, 416), (_out("grid", 125, 13, 13),), f"{_V}:tinyyolov2", atol=3e-4),
    ZooEntry("arcface", "arcface", "face-embedding",
             "ArcFace-style IR-ResNet (PReLU, BN1d), 112x112 -> 512-d", "torchscript",
             _img(3, 112, 112), (_out("embedding", 512),), f"{_V}:arcface", atol=3e-4),
    ZooEntry("emotion_ferplus", "ferplus", "image-classification",
             "Emotion-FER+-style VGG13-like CNN, 1x64x64 grayscale, 8 emotions", "torchscript",
             _img(1, 64, 64), (_out("logits", 8),), f"{_V}:emotion_ferplus"),
    ZooEntry("bert", "bert", "question-answering",
             "BertForQuestionAnswering, 4 layers, hidden 256, 4 heads, vocab 8192",
             "torchscript",
             (_tok("input_ids", **_IDS), _tok("attention_mask", kind="mask"),
              _tok("token_type_ids", kind="segment")),
             (_out("start_logits", "seq"), _out("end_logits", "seq")), f"{_T}:bert",
             atol=1e-4, rtol=1e-3),
    ZooEntry("roberta", "roberta", "text-classification",
             "RobertaForSequenceClassification (3 labels), 4 layers, hidden 256, vocab 8192",
             "torchscript",
             (_tok("input_ids", **{**_IDS, "pad": 1}), _tok("attention_mask", kind="mask")),
             (_out("logits", 3),), f"{_T}:roberta", atol=1e-4, rtol=1e-3),
    ZooEntry("gpt2", "gpt2", "text-generation",
             "GPT2LMHeadModel (no KV cache), 4 layers, n_embd 256, vocab 8192", "torchscript",
             (_tok("input_ids", **_IDS), _tok("attention_mask", kind="mask")),
             (_out("logits", "seq", 8192),), f"{_T}:gpt2", atol=1e-4, rtol=1e-3),
]

# Dynamo-exporter (torch.export + onnxscript) variants, at its native opset 18. resnet50 and
# vgg16 export fine too but are left out: same op set as resnet18 / emotion_ferplus, big files.
DYNAMO_VARIANTS = ("resnet18", "mobilenetv2", "shufflenetv2", "tinyyolov2", "arcface",
                   "emotion_ferplus", "bert", "roberta", "gpt2")

REGISTRY: dict[str, ZooEntry] = {e.name: e for e in _BASE}
for _name in DYNAMO_VARIANTS:
    _e = REGISTRY[_name]
    REGISTRY[f"{_name}_dynamo"] = replace(
        _e, name=f"{_name}_dynamo", exporter="dynamo", opset=18,
        description=f"{_e.description} (dynamo exporter)",
    )


def get_entry(name: str) -> ZooEntry:
    """Look up a registry entry; raises ``KeyError`` listing the known names."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise KeyError(f"unknown zoo model {name!r}; known: {', '.join(REGISTRY)}") from None


def close_names(name: str, n: int = 3) -> list[str]:
    """Up to ``n`` registered names that ``name`` may be a typo of (``resnet`` ->
    ``resnet18``, ``resnet50``), most alike first, ties in registry order."""
    names = list(REGISTRY)
    close = difflib.get_close_matches(name, names, n=n, cutoff=0.6)
    return sorted(close, key=lambda c: (-difflib.SequenceMatcher(None, name, c).ratio(),
                                        names.index(c)))


def make_inputs(
    entry: ZooEntry | str, batch: int = 2, seq: int = 16, seed: int = 0
) -> dict[str, np.ndarray]:
    """Seeded inputs for ``entry`` with the given batch (and sequence) size.

    Text models get right-padding on every odd row (the last ``max(1, seq // 3)`` tokens), so the
    default ``batch=2, seq=16`` has one full row and one row with 5 padding tokens.
    """
    entry = get_entry(entry) if isinstance(entry, str) else entry
    rng = np.random.default_rng(seed)
    lengths = np.array([seq - (b % 2) * max(1, seq // 3) for b in range(batch)])
    pos = np.arange(seq)[None, :]
    valid = pos < lengths[:, None]
    out: dict[str, np.ndarray] = {}
    for t in entry.inputs:
        shape = tuple({"batch": batch, "seq": seq}.get(d, d) if isinstance(d, str) else d
                      for d in t.shape)
        if t.kind == "image":
            arr = rng.standard_normal(shape, dtype=np.float32)
        elif t.kind == "ids":
            arr = np.where(valid, rng.integers(t.low, t.high, shape), t.pad)
        elif t.kind == "mask":
            arr = valid
        elif t.kind == "segment":
            arr = valid & (pos >= (lengths // 2)[:, None])
        else:
            raise ValueError(f"cannot generate input of kind {t.kind!r}")
        out[t.name] = np.ascontiguousarray(arr, dtype=t.dtype)
    return out
