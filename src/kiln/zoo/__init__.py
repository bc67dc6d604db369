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

from kiln.zoo.build import (
    BUILD_STEPS,
    MODEL_FILE,
    build_entry,
    cache_dir,
    entry_dir,
    is_built,
    require_builder,
    stale_reason,
)
from kiln.zoo.registry import REGISTRY, ZooEntry, close_names, get_entry, make_inputs

__all__ = [
    "ZooEntry",
    "build",
    "cache_dir",
    "close_names",
    "is_built",
    "list_models",
    "load_reference",
    "make_inputs",
    "path",
    "stale_reason",
]


def list_models() -> list[ZooEntry]:
    """All registered zoo models (TorchScript-exported ones, then ``*_dynamo`` variants)."""
    return list(REGISTRY.values())


def _bar(total: int, enabled: bool) -> Any:
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None  # the per-model lines are progress enough
    return tqdm(total=total, desc="kiln zoo", unit="model", file=sys.stderr)


def _say(bar: Any, msg: str) -> None:
    if bar is not None:
        bar.write(msg, file=sys.stderr)  # above the bar, which is redrawn below it
    else:
        print(msg, file=sys.stderr, flush=True)


def build(
    names: list[str] | None = None, force: bool = False, progress: bool | None = None
) -> list[Path]:
    """Build (or reuse from cache) the named models, all of them by default.

    Returns the ``model.onnx`` paths in order. Every requested model is attempted; if any
    fail, a ``RuntimeError`` naming each failure is raised after the others are built. A
    missing optional dependency (torch, onnxruntime, ...) raises ``MissingDependencyError``
    at once, naming the extra to install, since no model could be built without it.

    ``progress``: False prints nothing; otherwise one line per model goes to stderr, and
    a bar (tqdm, with the step being done) is drawn when ``progress`` is True or, for None,
    when stderr is a terminal -- never into logs and pipes.
    """
    from kiln.tools.progress import Heartbeat, wants_progress

    names = list(REGISTRY) if not names else list(names)
    for n in names:
        get_entry(n)  # fail fast on typos
    for n in names:
        if force or not is_built(n):
            require_builder(get_entry(n))
    paths: list[Path] = []
    failures: list[str] = []
    bar = _bar(len(names), progress is not False and wants_progress(progress))
    for name in names:
        cached = not force and is_built(name)
        t0 = time.perf_counter()

        # Without a bar (a pipe, a log) a step that runs on says so every few seconds.
        beat = Heartbeat(name, enabled=bar is None and progress is not False and not cached)

        def on_step(text: str, name: str = name, beat: Heartbeat = beat) -> None:
            beat.update(f"{text} (still running)")
            if bar is not None:
                bar.set_postfix_str(f"{name}: {text}")
            elif progress is not False and text.startswith("exporting"):
                # The export is the long part; say when it starts (one line per model).
                _say(None, f"{name:<22} {text} ...")

        try:
            with beat:
                p = build_entry(get_entry(name), force=force, on_step=on_step)
        except Exception as exc:  # noqa: BLE001 - report and keep going
            failures.append(f"{name}: {type(exc).__name__}: {exc}")
            if progress is not False:
                _say(bar, f"{name:<22} FAILED  {type(exc).__name__}: {exc}")
            if bar is not None:
                bar.update(1)
            continue
        paths.append(p)
        if progress is not False:
            how = "cached" if cached else f"built in {time.perf_counter() - t0:.1f}s"
            _say(bar, f"{name:<22} {how:<16} {p.stat().st_size / 1e6:8.1f} MB  {p}")
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if failures:
        raise RuntimeError("zoo build failed for:\n  " + "\n  ".join(failures))
    return paths


def path(name: str, progress: bool | None = None) -> Path:
    """Path of ``<cache>/<name>/model.onnx``, building the model first if it is missing.

    A build (seconds to about two minutes) says so on stderr: what is being built, each
    step, and the time it took; ``progress=False`` keeps it silent. Without a package the
    build needs, ``MissingDependencyError`` says which extra to install. The current step is
    redrawn in place with a running clock when ``progress`` is True or, for None, when
    stderr is a terminal; otherwise it is written as plain lines.
    """
    entry = get_entry(name)
    if not is_built(name):
        require_builder(entry)  # a missing package: one line saying what to install
        if progress is False:
            build_entry(entry)
        else:
            from kiln.tools.progress import StepReporter

            print(f"kiln: zoo model {name} is not built yet; building it into "
                  f"{entry_dir(name)} (once: later uses read the cache)",
                  file=sys.stderr, flush=True)
            with StepReporter(f"building {name}", BUILD_STEPS, live=progress) as rep:
                build_entry(entry, on_step=rep.step)
                rep.done(f"built in {rep.elapsed():.1f} s")
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
