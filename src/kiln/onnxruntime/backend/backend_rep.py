"""ONNX's ``BackendRep`` over a ``kiln.onnxruntime`` session."""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx.backend.base import BackendRep

from kiln.onnxruntime.capi.onnxruntime_pybind11_state import RunOptions, runtime_error

_RUN_OPTIONS = frozenset({"log_severity_level", "log_verbosity_level", "logid",
                          "only_execute_path_to_fetches"})


class OnnxRuntimeBackendRep(BackendRep):
    """A prepared model: ``run(inputs)`` with a list (one per input) or one array."""

    def __init__(self, session):
        self._session = session

    def run(self, inputs: Any, **kwargs: Any) -> list:
        options = RunOptions()
        for k, v in kwargs.items():
            if k not in _RUN_OPTIONS:
                raise runtime_error(f"RunOptions attribute '{k}' is not permitted via the "
                                    f"backend API; allowed: {sorted(_RUN_OPTIONS)}")
            setattr(options, k, v)
        meta = self._session.get_inputs()
        if isinstance(inputs, list):
            feed = {m.name: _array(x) for m, x in zip(meta, inputs)}
        else:
            if len(meta) != 1:
                raise runtime_error(f"Model expect {len(meta)} inputs")
            feed = {meta[0].name: _array(inputs)}
        return self._session.run(None, feed, options)


def _array(x):
    return np.asarray(x) if isinstance(x, np.generic) else x
