"""Training imported models: :func:`to_torch` turns an ONNX model into a trainable
``torch.nn.Module`` run by Kiln's engine; :func:`kiln.save` writes it (or it with new
torch layers after it) back to ONNX. torch is imported only when a module is built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import onnx

from kiln.edit import cut
from kiln.errors import MissingDependencyError
from kiln.ir import Model
from kiln.onnxio.exporter import register_converter

if TYPE_CHECKING:
    from kiln.train.module import KilnModule

__all__ = ["to_torch"]


def to_torch(model_or_path: Model | str | os.PathLike | bytes | onnx.ModelProto,
             device: str = "cpu", outputs: Sequence[str] | str | None = None,
             last_layers: int | None = None) -> KilnModule:
    """The model as a trainable ``torch.nn.Module`` (a :class:`~kiln.train.module.KilnModule`).

    ``outputs``: end the graph at these tensor or layer names; ``last_layers=-k``: drop
    the last k layers (SINGA's meaning: the outputs of the layer before them are
    returned); both as :func:`kiln.cut`. The module runs a copy with the fusions that
    mean the same in training (Gelu, LayerNorm, attention); what is saved back is the
    model's own graph with the new weights. ``device``: "cpu" or "cuda[:N]", fixed when the
    module is built.
    """
    try:
        from kiln.train.module import KilnModule
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "torch":
            raise
        raise MissingDependencyError("torch", 'pip install -e ".[torch]"',
                                     "kiln.to_torch") from None

    # a private copy, typed by shape inference (a head is exported on the cut's output)
    model = cut(model_or_path, outputs=outputs, last_layers=last_layers)
    return KilnModule(model, device)


def _as_model(obj) -> Model | None:
    """kiln.save's converter for torch modules holding a KilnModule (see export.py)."""
    import sys

    if "torch" not in sys.modules:
        return None
    from kiln.train.export import module_to_model

    return module_to_model(obj)


register_converter(_as_model)
