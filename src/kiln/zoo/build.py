"""Export a zoo entry to ONNX, verify it with onnx.checker + onnxruntime, and cache the result."""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import platform
import shutil
import time
import warnings
from collections import Counter
from collections.abc import Callable
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np

from kiln.cache import location
from kiln.errors import MissingDependencyError
from kiln.zoo.registry import ZooEntry, get_entry, make_inputs

__all__ = ["BUILD_STEPS", "MODEL_FILE", "ZOO_INSTALL", "build_entry", "builder_modules",
           "cache_dir", "entry_dir", "is_built", "require_builder", "stale_reason"]

MODEL_FILE = "model.onnx"
_FILES = (MODEL_FILE, "inputs.npz", "outputs.npz", "meta.json")
# The extra of pyproject.toml with everything building needs (Kiln installs from its checkout).
ZOO_INSTALL = 'pip install -e ".[zoo]"'
BUILD_STEPS = 5  # the on_step calls build_entry makes


def cache_dir() -> Path:
    """The zoo cache: ``$KILN_ZOO_DIR`` if set, else ``zoo`` under Kiln's cache root
    (``~/.cache/kiln/zoo`` unless ``$XDG_CACHE_HOME`` is set)."""
    return location("KILN_ZOO_DIR", "zoo")


def entry_dir(name: str) -> Path:
    """Folder holding ``model.onnx``, ``inputs.npz``, ``outputs.npz`` and ``meta.json``."""
    return cache_dir() / name


def is_built(name: str) -> bool:
    """True when every artefact of ``name`` is present in the cache."""
    return all((entry_dir(name) / f).is_file() for f in _FILES)


def builder_modules(entry: ZooEntry) -> list[str]:
    """The optional packages building ``entry`` imports (all in the ``zoo`` extra)."""
    mods = ["onnxruntime", "torch"]  # the quick import first: a missing one is told at once
    if entry.factory.startswith("kiln.zoo.text:"):
        mods.append("transformers")
    if entry.exporter == "dynamo":
        mods.append("onnxscript")  # torch.onnx's dynamo exporter is written with it
    return mods


def require_builder(entry: ZooEntry) -> None:
    """Import what building ``entry`` needs; ``MissingDependencyError`` naming the first
    missing package and the extra that installs it (``pip install -e ".[zoo]"``) if not."""
    for mod in builder_modules(entry):
        try:
            importlib.import_module(mod)
        except ImportError:
            raise MissingDependencyError(mod, ZOO_INSTALL,
                                         f"building zoo model {entry.name}") from None


def stale_reason(name: str) -> str | None:
    """Why the cached ``name`` is not what building it here would give, or None if it is.

    Missing files, a registry change (exporter, opset) or a different version of a package
    the build used (torch, onnx, onnxruntime, ...) make an entry stale: the reference outputs
    and the exported graph can change with them. Building is otherwise deterministic (seeded
    weights and inputs), so a current entry equals a fresh build.
    """
    entry = get_entry(name)
    if not is_built(name):
        return "not built"
    try:
        meta = json.loads((entry_dir(name) / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"unreadable meta.json ({e})"
    if (meta.get("exporter"), meta.get("opset")) != (entry.exporter, entry.opset):
        return (f"built with exporter {meta.get('exporter')} opset {meta.get('opset')}, the "
                f"registry says {entry.exporter} opset {entry.opset}")
    built = meta.get("versions", {})
    for pkg in ("onnx", *builder_modules(entry)):
        if built.get(pkg) != _version(pkg):
            return f"built with {pkg} {built.get(pkg)}, installed is {_version(pkg)}"
    return None


def _version(pkg: str) -> str:
    try:
        return metadata.version(pkg)
    except metadata.PackageNotFoundError:
        return "unknown"


@contextlib.contextmanager
def _quiet():
    """Silence exporter warnings, logging and the dynamo exporter's stdout chatter."""
    loggers = [logging.getLogger(n) for n in ("torch.onnx", "torch.export", "torch._dynamo")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, lvl in zip(loggers, levels):
            lg.setLevel(lvl)


def _dynamic_axes(entry: ZooEntry) -> dict[str, dict[int, str]]:
    """The TorchScript exporter's ``dynamic_axes``: the entry's named (symbolic) dims."""
    return {t.name: {i: d for i, d in enumerate(t.shape) if isinstance(d, str)}
            for t in (*entry.inputs, *entry.outputs)}


def export_trainable(entry: ZooEntry, model: Any, args: tuple) -> bytes:
    """``model`` (the entry's PyTorch module) exported for training as ONNX bytes:
    BatchNormalization kept with its statistics, no constant folding, opset 17 — the file
    ``kiln.to_torch`` is checked and measured against the module with."""
    import torch

    buf = io.BytesIO()
    torch.onnx.export(model, args, buf, dynamo=False,
                      input_names=[t.name for t in entry.inputs],
                      output_names=[t.name for t in entry.outputs],
                      dynamic_axes=_dynamic_axes(entry),
                      training=torch.onnx.TrainingMode.PRESERVE, do_constant_folding=False,
                      opset_version=17)
    return buf.getvalue()


def _export(entry: ZooEntry, model: Any, args: tuple, path: Path) -> None:
    import torch

    in_names = [t.name for t in entry.inputs]
    out_names = [t.name for t in entry.outputs]
    common = dict(input_names=in_names, output_names=out_names, opset_version=entry.opset)
    with _quiet(), torch.no_grad():
        if entry.exporter == "torchscript":
            axes = _dynamic_axes(entry)
            if entry.keep_bn:  # skips the eval-mode Conv+BN fusion (and constant folding)
                common["training"] = torch.onnx.TrainingMode.PRESERVE
            torch.onnx.export(model, args, str(path), dynamo=False, dynamic_axes=axes, **common)
        elif entry.exporter == "dynamo":
            dims = {"batch": torch.export.Dim("batch", max=4096),
                    "seq": torch.export.Dim("seq", max=512)}
            shapes = tuple({i: dims[d] for i, d in enumerate(t.shape) if isinstance(d, str)}
                           for t in entry.inputs)
            torch.onnx.export(model, args, str(path), dynamo=True, dynamic_shapes=shapes,
                              external_data=False, verbose=False, **common)
        else:
            raise ValueError(f"unknown exporter {entry.exporter!r}")


def _io_meta(values: Any) -> list[dict[str, Any]]:
    from onnx import helper

    out = []
    for v in values:
        tt = v.type.tensor_type
        shape = [d.dim_param or d.dim_value for d in tt.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(tt.elem_type).name
        out.append({"name": v.name, "dtype": dtype, "shape": shape})
    return out


def _fix_output_shapes(proto: Any, entry: ZooEntry) -> list[str]:
    """Overwrite declared graph-output shapes that disagree with the entry's spec.

    The TorchScript exporter sometimes mislabels dims after ops it cannot infer (tinyyolov2's
    edge Pad yields ``grid: [batch, 125, batch, Convgrid_dim_3]``). Returns one note per fix.
    """
    notes = []
    for v, spec in zip(proto.graph.output, entry.outputs):
        shape = v.type.tensor_type.shape
        declared = [d.dim_param or d.dim_value for d in shape.dim]
        if declared != list(spec.shape):
            shape.ClearField("dim")
            for s in spec.shape:
                d = shape.dim.add()
                if isinstance(s, str):
                    d.dim_param = s
                else:
                    d.dim_value = s
            notes.append(f"output {v.name}: declared shape {declared} -> {list(spec.shape)}")
    return notes


def _compare(ref: np.ndarray, got: np.ndarray) -> dict[str, float]:
    diff = np.abs(ref.astype(np.float64) - got.astype(np.float64))
    scale = np.maximum(np.abs(ref.astype(np.float64)), 1e-12)
    return {"max_abs": float(diff.max()), "max_rel": float((diff / scale).max()),
            "ref_max_abs": float(np.abs(ref).max())}


def build_entry(entry: ZooEntry, force: bool = False,
                on_step: Callable[[str], None] | None = None) -> Path:
    """Build ``entry`` into the cache (unless already built) and return its ``model.onnx`` path.

    Steps: seeded torch model -> ONNX export -> ``onnx.checker.check_model`` -> symbolic-dim check
    -> onnxruntime (CPU) run on seeded inputs, compared to torch within the entry tolerance ->
    write ``inputs.npz``, ``outputs.npz`` (the ORT outputs) and ``meta.json``. The folder is
    written under a temporary name and renamed, so a crash never leaves a half-built entry.

    ``on_step`` is called with a description as each of the ``BUILD_STEPS`` steps starts
    (a build takes from a second to about two minutes). A missing torch, onnxruntime,
    transformers or onnxscript raises ``MissingDependencyError`` before anything is done.
    """
    final = entry_dir(entry.name)
    if not force and is_built(entry.name):
        return final / MODEL_FILE
    step = on_step or (lambda _text: None)
    step("importing torch and onnxruntime")
    require_builder(entry)
    import onnx
    import onnxruntime as ort
    import torch

    t0 = time.perf_counter()
    tmp = final.with_name(f".{entry.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        step("making the seeded torch model and its outputs")
        model = entry.make_model()
        inputs = make_inputs(entry, batch=2, seq=16, seed=entry.seed)
        args = tuple(torch.from_numpy(v) for v in inputs.values())
        with torch.no_grad():
            expected = model(*args)
        expected = [t.numpy() for t in (expected if isinstance(expected, tuple) else (expected,))]
        path = tmp / MODEL_FILE
        step(f"exporting to ONNX ({entry.exporter} exporter, opset {entry.opset})")
        _export(entry, model, args, path)
        export_s = time.perf_counter() - t0
        step("checking the ONNX file")
        onnx.checker.check_model(str(path), full_check=True)
        proto = onnx.load(str(path))
        fixups = _fix_output_shapes(proto, entry)
        if fixups:
            onnx.save(proto, str(path))
            onnx.checker.check_model(str(path), full_check=True)
        ins, outs = _io_meta(proto.graph.input), _io_meta(proto.graph.output)
        for spec, got in zip((*entry.inputs, *entry.outputs), (*ins, *outs)):
            if spec.name != got["name"] or got["shape"] != list(spec.shape):
                raise RuntimeError(f"{entry.name}: bad graph io {got} (expected {spec})")
        step("computing reference outputs with onnxruntime")
        sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        outputs = dict(zip([o["name"] for o in outs], sess.run(None, inputs)))
        for o, got in zip(outs, outputs.values()):
            want = [2 if d == "batch" else 16 if d == "seq" else d for d in o["shape"]]
            if list(got.shape) != want:
                raise RuntimeError(f"{entry.name}: ORT output {o['name']} {got.shape} != {want}")
        diffs = {}
        for (k, got), ref in zip(outputs.items(), expected):
            if not np.allclose(got, ref, atol=entry.atol, rtol=entry.rtol):
                raise RuntimeError(f"{entry.name}: ORT vs torch mismatch on {k}: "
                                   f"{_compare(ref, got)} (atol={entry.atol}, rtol={entry.rtol})")
            diffs[k] = _compare(ref, got)
        np.savez(tmp / "inputs.npz", **inputs)
        np.savez(tmp / "outputs.npz", **outputs)
        hist = Counter(n.op_type for n in proto.graph.node)
        meta = {
            "name": entry.name, "family": entry.family, "task": entry.task,
            "description": entry.description, "exporter": entry.exporter,
            "opset": next(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")),
            "ir_version": proto.ir_version, "inputs": ins, "outputs": outs,
            "reference": {"batch": 2, "seq": 16 if entry.is_text else None, "seed": entry.seed,
                          "provider": "CPUExecutionProvider"},
            "tolerance": {"atol": entry.atol, "rtol": entry.rtol},
            "torch_vs_ort": diffs,
            "fixups": fixups,
            "params": sum(p.numel() for p in model.parameters()),
            "file_size_bytes": path.stat().st_size, "node_count": len(proto.graph.node),
            "op_histogram": dict(hist.most_common()),
            "versions": {p: _version(p) for p in ("kiln", "torch", "transformers", "onnx",
                                                  "onnxruntime", "onnxscript", "numpy")},
            "python": platform.python_version(),
            "export_time_s": round(export_s, 2),
            "build_time_s": round(time.perf_counter() - t0, 2),
            "built_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final / MODEL_FILE
