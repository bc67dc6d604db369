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
from kiln.runtime.backends import backend_names, backends_where, reference_backend_name
from kiln.session_api import InferenceSession

ONNXRUNTIME = "onnxruntime"
"""The engine name that measures on onnxruntime itself."""


def engines() -> list[str]:
    """The engines to measure on: every registered backend (read when asked, so one
    registered after import is among them), then onnxruntime."""
    return [*backend_names(), ONNXRUNTIME]


def integer_engines() -> list[str]:
    """The engines that run quantized layers on integer kernels (speed-aware there by
    default): the backends the registry says do, and onnxruntime."""
    return [*backends_where(lambda e: e.integer_kernels), ONNXRUNTIME]


def open_session(model: Model, backend: str | None, optimize: bool = True):
    """A session running ``model`` on ``backend`` (one of :func:`engines`; None: the
    reference backend); both kinds answer ``run(names, feed)`` and ``get_outputs()``.
    ``optimize=False`` runs every node as written (calibration reads tensors a fusion
    would hide)."""
    if backend != ONNXRUNTIME:
        return InferenceSession(model, backend=backend or reference_backend_name(),
                                optimize=optimize)
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
