"""Load-time validation's facts about ONNX's op schemas, kept on disk per onnx version.

The first ``onnx.defs.get_schema`` call in a process builds every schema of every domain,
which takes about as long as the rest of loading a small model. The facts the importer checks
(input and output counts, attribute names and types) are derived from those schemas once
and kept in ``onnx-<version>-schemas-v1.json`` under Kiln's cache root (``kiln.cache``;
``$KILN_SCHEMA_CACHE`` names another file, ``0`` or ``off`` turns it off), so later
processes read a few kilobytes of JSON instead.
It is data, never code, and read only when the user owns it and nobody else can write it:
a loosened entry would let a malformed model through validation.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import onnx

from kiln.cache import optional_location


def path() -> Path | None:
    """The file for the installed onnx, or None when the cache is turned off."""
    return optional_location("KILN_SCHEMA_CACHE", f"onnx-{onnx.__version__}-schemas-v1.json")


def read(file: Path | None) -> dict:
    """The facts kept so far (empty when missing, unreadable or not safely owned)."""
    if file is None:
        return {}
    try:
        st = file.stat()
        if (hasattr(os, "getuid") and st.st_uid != os.getuid()) or st.st_mode & 0o022:
            return {}
        with open(file, encoding="utf-8") as f:
            facts = json.load(f)
    except (OSError, ValueError):
        return {}
    return facts if isinstance(facts, dict) else {}


def write(file: Path | None, facts: dict) -> None:
    """Replace the file with ``facts`` in one step (readers never see half a file); a
    folder that cannot be written leaves the cache as it was."""
    if file is None:
        return
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=".schemas-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(facts, f, separators=(",", ":"))
            os.replace(tmp, file)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass
