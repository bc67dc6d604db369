"""The old name of :mod:`kiln.session_api`, kept so ``import kiln.ort`` and
``from kiln.ort import InferenceSession`` still work. The package was renamed because
``ort`` is the alias everyone gives onnxruntime itself (``import onnxruntime as ort``), so
``kiln.ort`` read as onnxruntime; onnxruntime's own package layout on Kiln is
:mod:`kiln.onnxruntime`."""

from kiln.session_api import (  # noqa: F401 - re-exported under the old name
    ExecutionMode,
    GraphOptimizationLevel,
    InferenceSession,
    IOBinding,
    ModelMetadata,
    OrtValue,
    RunOptions,
    SessionOptions,
    __all__,
    get_available_providers,
    get_device,
    set_default_logger_severity,
)
