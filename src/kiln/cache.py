"""Where Kiln keeps files between processes: the op-schema facts, compiled programs and the
zoo, each in a folder of one root (``$XDG_CACHE_HOME/kiln``, else ``~/.cache/kiln``) unless
its own environment variable names another place."""

from __future__ import annotations

import os
from pathlib import Path

OFF = ("0", "off", "false", "no")
"""Values of a cache's variable that turn the cache off (where it can be)."""


def root() -> Path:
    """Kiln's cache root: ``$XDG_CACHE_HOME/kiln`` when that is an absolute path (as the
    XDG spec asks), else ``~/.cache/kiln``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "kiln"


def location(env: str, name: str) -> Path:
    """The path the environment variable ``env`` names (``~`` expanded), else ``name``
    under :func:`root`. An empty variable counts as unset."""
    value = os.environ.get(env, "").strip()
    return Path(value).expanduser() if value else root() / name


def optional_location(env: str, name: str) -> Path | None:
    """:func:`location` for a cache that can be turned off: None when ``env`` is one of
    :data:`OFF`."""
    return None if os.environ.get(env, "").strip().lower() in OFF else location(env, name)
