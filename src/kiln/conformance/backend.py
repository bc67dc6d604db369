"""Kiln as an ``onnx.backend.base.Backend``, so ONNX's own test tooling can drive it."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from kiln.runtime.backends import backend_entry, reference_backend_name
from kiln.session_api import InferenceSession


class KilnRep(BackendRep):
    """A prepared model: runs positional inputs, returns outputs as a tuple."""

    def __init__(self, session: InferenceSession):
        self.session = session
        self.input_names = [i.name for i in session.get_inputs()]

    def run(self, inputs: Any, **kwargs: Any) -> tuple:
        if isinstance(inputs, dict):
            feed = inputs
        else:
            if isinstance(inputs, np.ndarray) or not isinstance(inputs, (list, tuple)):
                inputs = [inputs]
            feed = dict(zip(self.input_names, inputs))
        return tuple(self.session.run(None, feed))


class KilnBackend(Backend):
    """Adapter between ONNX's backend API and :class:`kiln.InferenceSession`."""

    backend_name = reference_backend_name()

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: Any) -> KilnRep:
        options = {}
        if "device" in backend_entry(cls.backend_name).options:
            options["device"] = "cuda" if device.upper().startswith("CUDA") else "cpu"
        return KilnRep(InferenceSession(model, backend=cls.backend_name, **options))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        if device.upper().startswith("CUDA"):
            if "cuda" not in backend_entry(cls.backend_name).devices:
                return False
            try:
                import torch
                return torch.cuda.is_available()
            except ImportError:
                return False
        return device.upper() == "CPU"

    @classmethod
    def run_node(cls, node: onnx.NodeProto, inputs: Any, device: str = "CPU",
                 outputs_info=None, **kwargs: Any) -> tuple:
        opset = kwargs.get("opset_version", onnx.defs.onnx_opset_version())
        ins = [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(
            np.asarray(x).dtype), np.asarray(x).shape) for n, x in zip(node.input, inputs)]
        outs = [onnx.helper.make_value_info(n, onnx.TypeProto()) for n in node.output]
        graph = onnx.helper.make_graph([node], "run_node", ins, outs)
        model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
        return cls.prepare(model, device).run(list(inputs))


def backend_for(name: str) -> type[KilnBackend]:
    """A KilnBackend subclass bound to Kiln backend ``name``."""
    return type(f"Kiln{name.title()}Backend", (KilnBackend,), {"backend_name": name})
