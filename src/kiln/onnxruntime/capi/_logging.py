"""onnxruntime's default logger on Kiln: a severity (0 verbose ... 4 fatal) and an optional
Python callback that receives Kiln's session messages as onnxruntime's log records
``(severity, category, logid, code_location, message)``."""

from __future__ import annotations

from collections.abc import Callable

from kiln.onnxruntime.capi._errors import runtime_error
from kiln.session_api import set_default_logger_severity as _kiln_severity

_state: dict = {"callback": None, "severity": 2}


def set_default_logger_severity(level: int) -> None:
    """Messages below ``level`` are dropped (Kiln's warnings too, from 3)."""
    _check(level)
    _kiln_severity(int(level))
    _state["severity"] = int(level)


def set_default_logger_verbosity(level: int) -> None:
    """onnxruntime's VLOG level; Kiln's verbose messages are all level 0."""
    if int(level) < 0:
        raise runtime_error(f"verbosity must be >= 0, got {level}")


def set_default_logger_callback(callback: Callable | None, severity: int | None = None
                                ) -> None:
    """Send log records to ``callback(severity, category, logid, code_location,
    message)``; None restores the default (nothing is printed)."""
    if callback is not None and not callable(callback):
        raise runtime_error("the logger callback must be callable or None")
    if severity is not None:
        set_default_logger_severity(severity)
    _state["callback"] = callback


def _check(level) -> None:
    if not isinstance(level, int) or not 0 <= level <= 4:
        raise runtime_error(f"log severity must be 0 (verbose) to 4 (fatal), got {level!r}")


def log(severity: int, category: str, logid: str, where: str, message: str) -> None:
    """One record: to the callback when set and ``severity`` is at or above the level.
    A callback that raises is not allowed to break the session (onnxruntime's promise)."""
    cb = _state["callback"]
    if cb is None or severity < _state["severity"]:
        return
    try:
        cb(int(severity), str(category), str(logid), str(where), str(message))
    except Exception:  # noqa: BLE001, S110 - a logger must never fail the session
        pass
