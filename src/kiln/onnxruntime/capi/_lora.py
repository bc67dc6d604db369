"""LoRA adapters (onnxruntime's ``LoraAdapter`` and ``AdapterFormat``)."""

from __future__ import annotations

from kiln.onnxruntime.capi._errors import runtime_error


class LoraAdapter:
    """A LoRA adapter file's parameters, applied to runs whose RunOptions activate it."""

    def __init__(self):
        self._params: dict = {}

    def Load(self, path: str) -> None:  # noqa: N802 - onnxruntime's name
        raise runtime_error("Kiln cannot read onnxruntime's .onnx_adapter files yet")

    def parameters(self) -> dict:
        return dict(self._params)


class AdapterFormat:
    """onnxruntime's adapter file writer/reader."""

    def __init__(self):
        raise runtime_error("Kiln cannot write onnxruntime's .onnx_adapter files yet")
