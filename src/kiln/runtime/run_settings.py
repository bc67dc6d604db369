"""How to run a model, stored in the model file itself: ``kiln tune`` writes the backend
and its options it chose into the ONNX ``metadata_props`` under :data:`KEY` (the file
stays a standard one that any engine loads), and a session built without a backend
reads them back, so a tuned file is one line to run."""

from __future__ import annotations

import json
import warnings
from typing import Any

from kiln.errors import MissingDependencyError
from kiln.runtime.backend import Backend
from kiln.runtime.backends import (
    backend_entry,
    default_backend_name,
    make_backend,
    reference_backend_name,
)

__all__ = ["KEY", "backend_for", "default_backend", "default_backend_name", "encode", "stored"]

KEY = "kiln.run_settings"
"""The metadata_props key holding a JSON object ``{"backend": ..., "options": {...}}``."""


def default_backend(options: dict[str, Any]) -> Backend:
    """The default backend (:func:`default_backend_name`: torch where it imports, see the
    registry) built with ``options``; the reference backend when the default's dependency
    turns out missing. On the CPU its fallback layers are not warned about: the user chose
    no backend, and on the CPU a fallback moves no data between devices
    (``session.placement()`` still lists them)."""
    name = default_backend_name()
    opts = dict(options)
    if backend_entry(name).takes("warn") and \
            not str(opts.get("device", "cpu")).startswith("cuda"):
        opts.setdefault("warn", False)
    try:
        return make_backend(name, **opts)
    except MissingDependencyError:
        return make_backend(reference_backend_name(), **options)


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
