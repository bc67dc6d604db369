"""Running models: the precomputed plan, the backends and their executors, and the
``Session`` that ties them together (``kiln.session_api`` puts onnxruntime's API on it)."""

from kiln.runtime.backends import backend_names, make_backend, register_backend
from kiln.runtime.session import NodeArg, Session

__all__ = ["NodeArg", "Session", "backend_names", "make_backend", "register_backend"]
