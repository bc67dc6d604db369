"""Helpers (no tests) for the optimizer tests: run a model optimized and check it against
onnxruntime running the original."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from conftest import make_model, ort_run
from kiln.optimize import optimize_with_report

F = TensorProto.FLOAT
I64 = TensorProto.INT64


def vi(name, shape, dtype=F):
    return helper.make_tensor_value_info(name, dtype, shape)


def init(name, array):
    return onnx.numpy_helper.from_array(np.asarray(array), name)


def rand(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def ops(model: kiln.Model) -> Counter:
    """Op histogram of the main graph and its subgraphs (``domain.op`` for non-ONNX)."""
    return Counter((f"{n.domain}." if n.domain else "") + n.op_type
                   for _, n in model.graph.walk())


def optimized(proto: onnx.ModelProto, feeds: dict, *, level=2, disable=(), input_shapes=None,
              rtol=1e-5, atol=1e-5, ort_too: bool | None = None):
    """Optimize ``proto``; check Kiln on the optimized model against onnxruntime on the
    original (and, when the result has only standard ops, onnxruntime on the optimized
    model too). Returns (optimized Model, report)."""
    want = ort_run(proto, feeds)
    om, report = optimize_with_report(kiln.load(proto), level=level, disable=disable,
                                      input_shapes=input_shapes)
    assert om.check_uses() == [], "use-lists out of step with the graph"
    try:
        sess = kiln.InferenceSession(om, optimize=False)
    except kiln.UnsupportedOpError as e:
        pytest.skip(f"an op Kiln lacks for now: {e.ops}")
    got = sess.run(None, feeds)
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    standard = not any(n.domain == kiln.ops.KILN_DOMAIN for _, n in om.graph.walk())
    if ort_too if ort_too is not None else standard:
        again = ort_run(kiln.onnxio.to_proto(om), feeds)
        for w, g in zip(want, again):
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)
    return om, report


__all__ = ["F", "I64", "helper", "init", "make_model", "optimized", "ops", "ort_run", "rand",
           "vi"]
