"""Training imported models: :func:`to_torch` turns an ONNX model into a trainable
``torch.nn.Module`` run by Kiln's engine; :func:`kiln.save` writes it (or it with new
torch layers after it) back to ONNX. torch is imported only when a module is built.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING

import onnx

from kiln.edit import cut
from kiln.errors import MissingDependencyError
from kiln.ir import Model
from kiln.onnxio.exporter import register_converter

if TYPE_CHECKING:
    from kiln.train.module import KilnModule

__all__ = ["FoldedBatchNormWarning", "to_torch"]


def to_torch(model_or_path: Model | str | os.PathLike | bytes | onnx.ModelProto,
             device: str = "cpu", outputs: Sequence[str] | str | None = None,
             last_layers: int | None = None) -> KilnModule:
    """The model as a trainable ``torch.nn.Module`` (a :class:`~kiln.train.module.KilnModule`).

    ``outputs``: end the graph at these tensor or layer names; ``last_layers=-k``: drop
    the last k layers (SINGA's meaning: the outputs of the layer before them are
    returned); both as :func:`kiln.cut`, and the module's ``removed_layers`` names the
    layers the cut dropped ("name (OpType)"); ``output_shapes`` gives its outputs' shapes
    (the feature width a new head takes). The module runs a copy with the fusions that
    mean the same in training (Gelu, LayerNorm, attention); what is saved back is the
    model's own graph with the new weights. ``device``: "cpu" or "cuda[:N]", fixed when the
    module is built. Warns (:class:`FoldedBatchNormWarning`) when the file records that its
    exporter folded BatchNorm into the convolutions.
    """
    try:
        from kiln.train.module import KilnModule
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "torch":
            raise
        raise MissingDependencyError("torch", 'pip install -e ".[torch]"',
                                     "kiln.to_torch") from None

    # a private copy, typed by shape inference (a head is exported on the cut's output)
    model = cut(model_or_path)
    folded = _batchnorm_folded(model_or_path)
    removed: list[str] = []
    if outputs is not None or last_layers is not None:
        full = model
        model = cut(full, outputs=outputs, last_layers=last_layers)
        kept = {_layer(n) for n in model.graph.nodes}
        removed = [_layer(n) for n in full.graph.nodes if _layer(n) not in kept]
    module = KilnModule(model, device)
    module.removed_layers = removed
    if folded:
        warnings.warn(
            f"the exporter folded BatchNormalization into the convolutions ({folded} nodes "
            "say so: onnxscript's FuseBatchNormIntoConv, what torch.onnx.export(dynamo=True) "
            "does even in train mode): training trains the folded weights without batch "
            "statistics, which can diverge. To train a CNN, export it with "
            "torch.onnx.export(..., dynamo=False, training=torch.onnx.TrainingMode.PRESERVE, "
            "do_constant_folding=False) (docs/training.md)", FoldedBatchNormWarning,
            stacklevel=2)
    return module


class FoldedBatchNormWarning(UserWarning):
    """The model's exporter folded BatchNorm into its convolutions (see :func:`to_torch`)."""


def _layer(n) -> str:
    return f"{n.name or next((v.name for v in n.outputs if v is not None), '?')} ({n.op_type})"


def _batchnorm_folded(src) -> int:
    """How many nodes record that their exporter folded a BatchNorm into them (node
    metadata, which Kiln's graph does not keep, so the file is read for it)."""
    if isinstance(src, Model):
        return 0
    try:
        proto = src if isinstance(src, onnx.ModelProto) else \
            onnx.load_from_string(src) if isinstance(src, bytes) else \
            onnx.load(os.fspath(src), load_external_data=False)
    except Exception:  # cut() above read it; a second reader's trouble is not the user's
        return 0
    return sum(any(p.key.endswith("rule_name") and "BatchNorm" in p.value
                   for p in n.metadata_props) for n in proto.graph.node)


def _as_model(obj) -> Model | None:
    """kiln.save's converter for torch modules holding a KilnModule (see export.py)."""
    import sys

    if "torch" not in sys.modules:
        return None
    from kiln.train.export import module_to_model

    return module_to_model(obj)


register_converter(_as_model)
