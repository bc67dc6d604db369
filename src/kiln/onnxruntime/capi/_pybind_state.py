"""``onnxruntime.capi._pybind_state``: the bindings, as onnxruntime re-exports them."""

from kiln.onnxruntime.capi.onnxruntime_pybind11_state import *  # noqa: F403
from kiln.onnxruntime.capi.onnxruntime_pybind11_state import (  # noqa: F401
    get_default_session_options,
    is_dlpack_uint8_tensor,
)
