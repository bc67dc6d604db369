"""Running models: the precomputed plan, backends, and the InferenceSession."""

from kiln.runtime.session import InferenceSession, NodeArg

__all__ = ["InferenceSession", "NodeArg"]
