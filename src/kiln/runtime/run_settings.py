"""How to run a model, stored in the model file itself: ``kiln tune`` writes the backend
and its options it chose into the ONNX ``metadata_props`` under :data:`KEY` (the file
stays a standard one that any engine loads), and a session built without a backend
reads them back, so a tuned file is one line to run."""

from __future__ import annotations

import importlib.util
import json
import warnings
from typing import Any

from kiln.errors import MissingDependencyError
from kiln.runtime.backend import Backend
from kiln.runtime.backends import make_backend

__all__ = ["KEY", "backend_for", "default_backend", "default_backend_name", "encode", "stored"]

KEY = "kiln.run_settings"
"""The metadata_props key holding a JSON object ``{"backend": ..., "options": {...}}``."""


def default_backend_name() -> str:
    """The backend of a session given none, for a file without stored settings: "torch"
    when torch is installed, else "numpy". On the real-model benchmark and the zoo
    (docs/performance.md) the torch backend is faster at batch 1 on most models, and the
    NumPy one is many times slower than onnxruntime on every conv net (OpenBLAS threading
    on small matmuls, Python loops); the few tiny models where NumPy wins are a small
    absolute difference, so one rule, not a per-model guess, picks the backend. Installed
    means importable: a broken or shadowed torch leaves NumPy the default (the import is
    the one the torch backend would do anyway)."""
    if importlib.util.find_spec("torch") is None:
        return "numpy"
    try:
        importlib.import_module("torch")
    except ImportError:
        return "numpy"
    return "torch"


def default_backend(options: dict[str, Any]) -> Backend:
    """The default backend (:func:`default_backend_name`) built with ``options``; NumPy
    when torch is installed but cannot be imported. On the CPU its fallback layers are not
    warned about: the user chose no backend, and on the CPU a fallback moves no data
    between devices (``session.placement()`` still lists them)."""
    if default_backend_name() == "torch":
        opts = dict(options)
        if not str(opts.get("device", "cpu")).startswith("cuda"):
            opts.setdefault("warn", False)
        try:
            return make_backend("torch", **opts)
        except MissingDependencyError:
            pass
    return make_backend("numpy", **options)


def encode(backend: str, options: dict[str, Any]) -> str:
    """The metadata value for running on ``backend`` with ``options``."""
    return json.dumps({"backend": backend, "options": options}, sort_keys=True)


def stored(metadata: dict[str, str]) -> tuple[str, dict[str, Any]] | None:
    """The backend and options stored in ``metadata``; None when there are none, or
    (with a warning) when they cannot be read."""
    text = metadata.get(KEY)
    if text is None:
        return None
    try:
        got = json.loads(text)
        backend, options = str(got["backend"]), dict(got.get("options") or {})
    except (ValueError, KeyError, TypeError, AttributeError):
        warnings.warn(f"the model's {KEY!r} metadata is not the JSON Kiln writes; it "
                      "runs with the default settings", stacklevel=4)
        return None
    return backend, options


DEFAULT_WHY = "the default backend: torch when installed, else numpy"
TUNED_WHY = "stored in the file by kiln tune"


def backend_for(metadata: dict[str, str], options: dict[str, Any]) -> tuple[Backend, str]:
    """The backend of a session given no backend, and why it is that one (for placement
    reports): the one the model's metadata stores, with the stored options under the
    caller's ``options`` (the caller's win); the default backend when none is stored or
    the stored one is not installed here."""
    got = stored(metadata)
    if got is None:
        return default_backend(options), DEFAULT_WHY
    backend, tuned = got
    try:
        return make_backend(backend, **{**tuned, **options}), TUNED_WHY
    except MissingDependencyError as e:
        warnings.warn(f"the model was tuned to run on the {backend} backend, which is not "
                      f"installed here ({e}); it runs on {default_backend_name()}",
                      stacklevel=4)
        return default_backend(options), DEFAULT_WHY
