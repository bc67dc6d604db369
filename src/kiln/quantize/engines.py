"""The engines quantization measures on: Kiln's backends, or onnxruntime where a file is
to be deployed there.

Engines round a quantized model differently (integer kernels that requantize in float32,
float sums in another order), so an accuracy budget met on one may not hold on another
when the float model's outputs are near ties. Measuring on the deployment engine is the
only way to hold the budget there.
"""

from __future__ import annotations

from kiln.errors import OptionError
from kiln.ir import Model
from kiln.onnxio import to_proto
from kiln.runtime.backends import backend_names
from kiln.session_api import InferenceSession

BACKENDS = (*backend_names(), "onnxruntime")


def open_session(model: Model, backend: str, optimize: bool = True):
    """A session running ``model`` on ``backend`` (one of :data:`BACKENDS`); both kinds
    answer ``run(names, feed)`` and ``get_outputs()``. ``optimize=False`` runs every node
    as written (calibration reads tensors a fusion would hide)."""
    if backend != "onnxruntime":
        return InferenceSession(model, backend=backend, optimize=optimize)
    try:
        import onnxruntime as ort
    except ImportError:
        raise OptionError('measuring on onnxruntime needs it installed: pip install '
                          'onnxruntime (or pip install -e ".[test]")') from None
    options = ort.SessionOptions()
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(to_proto(model).SerializeToString(), options,
                                providers=["CPUExecutionProvider"])
