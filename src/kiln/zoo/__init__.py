"""Kiln model zoo: reproducible ONNX models built offline from seeded, randomly initialised
torch definitions, with onnxruntime reference inputs/outputs for numerical testing.

Cache layout (``$KILN_ZOO_DIR`` or ``~/.cache/kiln/zoo``)::

    <cache>/<name>/model.onnx    symbolic batch dim "batch" (and "seq" for text models)
    <cache>/<name>/inputs.npz    seeded inputs (batch 2; text: seq 16, one padded row)
    <cache>/<name>/outputs.npz   onnxruntime CPUExecutionProvider outputs on those inputs
    <cache>/<name>/meta.json     exporter, opset, io, tolerance, op histogram, versions, timing

Example::

    from kiln import zoo
    inputs, expected, meta = zoo.load_reference("resnet18")
    np.testing.assert_allclose(got, expected["logits"], **meta["tolerance"])
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from kiln.zoo.build import MODEL_FILE, build_entry, cache_dir, entry_dir, is_built
from kiln.zoo.registry import REGISTRY, ZooEntry, get_entry, make_inputs

__all__ = [
    "ZooEntry",
    "build",
    "cache_dir",
    "is_built",
    "list_models",
    "load_reference",
    "make_inputs",
    "path",
]


def list_models() -> list[ZooEntry]:
    """All registered zoo models (TorchScript-exported ones, then ``*_dynamo`` variants)."""
    return list(REGISTRY.values())


def _progress(items: list[str], enabled: bool) -> Any:
    if not enabled:
        return items
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc="kiln zoo", unit="model", file=sys.stderr)


def _say(bar: Any, msg: str) -> None:
    if hasattr(bar, "write"):
        bar.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr, flush=True)


def build(
    names: list[str] | None = None, force: bool = False, progress: bool = True
) -> list[Path]:
    """Build (or reuse from cache) the named models, all of them by default.

    Returns the ``model.onnx`` paths in order. Every requested model is attempted; if any
    fail, a ``RuntimeError`` naming each failure is raised after the others are built.
    """
    names = list(REGISTRY) if not names else list(names)
    for n in names:
        get_entry(n)  # fail fast on typos
    paths: list[Path] = []
    failures: list[str] = []
    bar = _progress(names, progress)
    for name in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(name)
        cached = not force and is_built(name)
        t0 = time.perf_counter()
        try:
            p = build_entry(get_entry(name), force=force)
        except Exception as exc:  # noqa: BLE001 - report and keep going
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            if progress:
                _say(bar, f"{name:<22} FAILED  {type(exc).__name__}: {exc}")
            continue
        paths.append(p)
        if progress:
            how = "cached" if cached else f"built in {time.perf_counter() - t0:.1f}s"
            _say(bar, f"{name:<22} {how:<16} {p.stat().st_size / 1e6:8.1f} MB  {p}")
    if failures:
        raise RuntimeError("zoo build failed for:\n  " + "\n  ".join(failures))
    return paths


def path(name: str) -> Path:
    """Path of ``<cache>/<name>/model.onnx``, building the model first if it is missing."""
    get_entry(name)
    if not is_built(name):
        build_entry(get_entry(name))
    return entry_dir(name) / MODEL_FILE


def load_reference(
    name: str,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """``(inputs, outputs, meta)`` for ``name``: seeded inputs, onnxruntime outputs, meta.json.

    Builds the model first if needed. Compare an engine's outputs with
    ``np.testing.assert_allclose(got, outputs[k], **meta["tolerance"])``.
    """
    d = path(name).parent
    with np.load(d / "inputs.npz") as f:
        inputs = {k: f[k] for k in f.files}
    with np.load(d / "outputs.npz") as f:
        outputs = {k: f[k] for k in f.files}
    return inputs, outputs, json.loads((d / "meta.json").read_text())
