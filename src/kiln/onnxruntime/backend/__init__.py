"""``onnxruntime.backend``: ONNX's backend API (``prepare``, ``run``) on Kiln."""

from kiln.onnxruntime.backend.backend import (  # noqa: F401
    is_compatible,
    prepare,
    run,
    run_model,
    supports_device,
)
