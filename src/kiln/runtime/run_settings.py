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
from kiln.runtime.backends import make_backend

__all__ = ["DEFAULT_BACKEND", "KEY", "backend_for", "encode", "stored"]

KEY = "kiln.run_settings"
"""The metadata_props key holding a JSON object ``{"backend": ..., "options": {...}}``."""
DEFAULT_BACKEND = "numpy"
"""The backend of a session given none, for a file without stored settings."""


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


def backend_for(metadata: dict[str, str], options: dict[str, Any]) -> Backend:
    """The backend of a session given no backend: the one the model's metadata stores,
    with the stored options under the caller's ``options`` (the caller's win); the default
    backend when none is stored or the stored one is not installed here."""
    got = stored(metadata)
    if got is None:
        return make_backend(DEFAULT_BACKEND, **options)
    backend, tuned = got
    try:
        return make_backend(backend, **{**tuned, **options})
    except MissingDependencyError as e:
        warnings.warn(f"the model was tuned to run on the {backend} backend, which is not "
                      f"installed here ({e}); it runs on {DEFAULT_BACKEND}", stacklevel=4)
        return make_backend(DEFAULT_BACKEND, **options)
