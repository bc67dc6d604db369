"""Shared test helpers: small models built with onnx.helper, onnxruntime as oracle, and
zoo models built on demand (the ``zoo_model`` fixture)."""

from __future__ import annotations

import importlib.util
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

ONNX_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
_HAVE_TORCH = importlib.util.find_spec("torch") is not None


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """Every test leaves torch's thread count as it found it. The fuzzer and the Ray test
    drop this process to one thread, and a check run after them depends on the count:
    test_train_zoo's ResNet-18 gradients through Kiln and through PyTorch differ by 1.8e-4
    (relative) on one thread, over its 1e-4."""
    if not _HAVE_TORCH:
        yield
        return
    import torch

    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)
LIGHT_DIR = os.path.join(ONNX_DATA, "light")


def make_model(nodes, inputs, outputs, initializers=(), opset: int = 17, **kw) -> onnx.ModelProto:
    """A ModelProto from node/value-info lists (opset 17 unless said)."""
    graph = helper.make_graph(nodes, "test", inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **kw)
    model.ir_version = 8
    return model


def ort_run(model: onnx.ModelProto | str, feeds: dict) -> list[np.ndarray]:
    """Outputs of onnxruntime (CPU) for ``feeds``: the oracle Kiln is checked against."""
    ort = pytest.importorskip("onnxruntime")
    src = model if isinstance(model, str) else model.SerializeToString()
    sess = ort.InferenceSession(src, providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


@pytest.fixture
def mlp_model() -> onnx.ModelProto:
    """x[batch,4] -> MatMul -> Add -> Relu -> MatMul -> Softmax, with seeded weights."""
    rng = np.random.default_rng(0)
    w1 = helper.make_tensor("w1", TensorProto.FLOAT, [4, 8], rng.standard_normal(32).tolist())
    b1 = helper.make_tensor("b1", TensorProto.FLOAT, [8], rng.standard_normal(8).tolist())
    w2 = helper.make_tensor("w2", TensorProto.FLOAT, [8, 3], rng.standard_normal(24).tolist())
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"]),
             helper.make_node("Add", ["h", "b1"], ["hb"]),
             helper.make_node("Relu", ["hb"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["y"], axis=-1)]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
                      [w1, b1, w2])


# (zoo cache folder, model name) -> model.onnx, for the models this run has made sure of.
_ZOO_READY: dict[tuple[str, str], Path] = {}
_PYTEST_CONFIG: list[pytest.Config] = []


def pytest_configure(config: pytest.Config) -> None:
    _PYTEST_CONFIG.append(config)


def _say(line: str) -> None:
    """A line in pytest's own output (not captured): a first run building zoo models for
    minutes says what it is doing instead of staying silent between the dots."""
    if not _PYTEST_CONFIG:
        return
    plugins = _PYTEST_CONFIG[0].pluginmanager
    tr, capman = plugins.get_plugin("terminalreporter"), plugins.get_plugin("capturemanager")
    if tr is None:
        return
    # A fixture runs under output capture: unsuspended, the line went to the captured
    # output of the test (shown only if it failed), and the build was silent after all.
    with capman.global_and_fixture_disabled() if capman is not None else nullcontext():
        tr.write_line(line)


def zoo_model_path(name: str) -> Path:
    """``model.onnx`` of zoo model ``name``, built now if the cache lacks it or holds a
    stale build (another torch/onnxruntime/... version, another exporter or opset).

    The cache is the zoo's own (``$KILN_ZOO_DIR`` or ``~/.cache/kiln/zoo``): building is
    deterministic (seeded weights and inputs; two builds give the same reference outputs),
    so a current cached entry is what a fresh build would give, and a test's result does not
    depend on what an earlier run left there or on which test asked first. Skips, saying
    what to install, only when a package the build needs is missing.
    """
    zoo = pytest.importorskip("kiln.zoo")
    from kiln.errors import MissingDependencyError
    from kiln.zoo.build import BUILD_STEPS, build_entry, require_builder, stale_reason
    from kiln.zoo.registry import get_entry

    key = (str(zoo.cache_dir()), name)
    if key not in _ZOO_READY:
        if stale_reason(name) is not None:
            try:
                require_builder(get_entry(name))
            except MissingDependencyError as e:
                pytest.skip(str(e))
            _say(f"building zoo model {name} into {zoo.cache_dir()} "
                 f"({stale_reason(name)}; once, then cached)")
            t0 = time.perf_counter()
            step = iter(range(1, BUILD_STEPS + 1))  # a line per step: an export can take a minute
            build_entry(get_entry(name), force=True, on_step=lambda text: _say(
                f"  {name}: [{next(step)}/{BUILD_STEPS}] {text}"))
            _say(f"built zoo model {name} in {time.perf_counter() - t0:.0f} s")
            assert stale_reason(name) is None, f"{name}: {stale_reason(name)} after a build"
        _ZOO_READY[key] = zoo.path(name, progress=False)
    return _ZOO_READY[key]


@pytest.fixture(scope="session")
def zoo_model() -> Callable[[str], Path]:
    """``zoo_model(name) -> Path``: the zoo model, built on demand once per run (see
    :func:`zoo_model_path`). Every test that needs a zoo model goes through this."""
    return zoo_model_path
