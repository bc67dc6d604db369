"""Zoo model names wherever the tools take a model (``kiln bench resnet18``,
``kiln.profile("resnet18")``): the zoo is a layer above the tools, so it is plugged into
:data:`kiln.tools.common.MODEL_NAMES` from here, the package's top, when Kiln is imported.
"""

from __future__ import annotations

from pathlib import Path

from kiln.errors import ModelLoadError
from kiln.tools.common import MODEL_NAMES


def zoo_model(name: str, progress: bool | None = None) -> Path | None:
    """The zoo file for ``name`` (built first when missing), None when no zoo model is
    called that; ModelLoadError when the name is close to some (``resnet``)."""
    try:
        from kiln import zoo
    except ImportError:
        return None
    if name in {e.name for e in zoo.list_models()}:
        return zoo.path(name, progress=progress)
    close = zoo.close_names(name)
    if close:
        raise ModelLoadError(
            f"no model file at {name} and no zoo model of that name; did you mean the zoo "
            f"model {' or '.join(close)}? (`kiln zoo list` shows them all)")
    return None


def register() -> None:
    """Let the tools resolve zoo names (once)."""
    if zoo_model not in MODEL_NAMES:
        MODEL_NAMES.append(zoo_model)
