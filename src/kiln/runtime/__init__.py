"""Running models: the precomputed plan, the backends and their executors, and the
``Session`` that ties them together (``kiln.ort`` puts onnxruntime's API on it)."""

from kiln.runtime.session import NodeArg, Session, make_backend

__all__ = ["NodeArg", "Session", "make_backend"]
