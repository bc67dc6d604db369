"""A third backend, in well under 150 lines: NumPy arrays "on a simulated device" (an
ndarray subclass standing for device memory). It is an adapter (array type, device,
transfers), a kernel table of its own (one kernel: Relu) and, for every other op, the
shared array-API kernel on its arrays or, where an op has none, NumPy's reference kernel on
the host with the plan's explicit transfers around it. Registered once, by name, it runs
ONNX's own backend tests (their expected outputs are the oracle) through
``kiln.InferenceSession`` like the built-in backends, with the same known failures as the
NumPy backend, and is reached from the CLI, ``python -m kiln.conformance``, the
onnxruntime API's options and quantization without their code naming it (checked against
onnxruntime). It is registered for this module's tests only: left in the registry it would
join every later test's backend lists (``kiln tune``'s candidates)."""

from __future__ import annotations

import numpy as np
import pytest
from test_conformance import _KNOWN

import kiln
from kiln.conformance.runner import collect, run_case
from kiln.errors import OptionError
from kiln.ir import DType
from kiln.ops import registry
from kiln.runtime import backend_names, register_backend
from kiln.runtime.backend import Backend, Link, host_feed
from kiln.runtime.backends import unregister_backend
from kiln.runtime.placement import LayerPlacement

NAME = "sim"


class DeviceArray(np.ndarray):
    """An array in the simulated device's memory."""


def to_device(x):
    if x is None or isinstance(x, DeviceArray):
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(to_device(e) for e in x)
    return np.asarray(x).view(DeviceArray)


def to_host(x):
    if isinstance(x, list):
        return [to_host(e) for e in x]
    return x.view(np.ndarray) if isinstance(x, DeviceArray) else x


class SimBackend(Backend):
    """Own kernels first, then the shared array-API kernel on device arrays, else the
    NumPy kernel on the host behind the plan's transfers."""

    name = NAME
    device = "sim"
    array_type = DeviceArray

    def candidates(self, opdef):
        out = []
        if NAME in opdef.kernels:
            out.append((NAME, opdef.kernels[NAME], "sim kernel"))
        if opdef.generic:
            out.append((f"{NAME}-generic", opdef.reference, "array-API kernel on sim arrays"))
        out.append(("cpu-fallback", opdef.reference, "NumPy kernel on the host"))
        return out

    def chain(self, chain, node, host_inputs=frozenset()):
        c = chain[0]
        where = "cpu" if c.how == "cpu-fallback" else self.device
        return Link(c.fn, c.wants_ctx, LayerPlacement.of(node, where, c.how, c.why))

    def transfers(self, chain, node):
        first = chain[0]
        return (to_host, to_device) if first.how == "cpu-fallback" and \
            not first.wants_ctx else None

    def from_numpy(self, x):
        return to_device(x)

    def to_numpy(self, x):
        return to_host(x)

    def normalize(self, x):
        return x if isinstance(x, list) else to_device(x)

    def accept_feed(self, x, dtype: DType):
        return to_device(host_feed(x, dtype))


@pytest.fixture(autouse=True, scope="module")
def _registered():
    register_backend(NAME, lambda **_: SimBackend(), ("device",), ("sim",),
                     about="NumPy arrays on a simulated device (tests)")
    yield
    unregister_backend(NAME)


@registry.backend_kernel(NAME, "Relu", 6)
def sim_relu(x):
    assert isinstance(x, DeviceArray), "a sim kernel gets the device's arrays"
    return np.maximum(x, 0).view(DeviceArray)


def _model():
    """Relu (the sim kernel), Exp (array-API on sim arrays), EyeLike (NumPy on the host)
    and Add of both paths."""
    from onnx import TensorProto, helper

    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Exp", ["a"], ["b"]),
             helper.make_node("EyeLike", ["b"], ["e"]), helper.make_node("Add", ["b", "e"],
                                                                         ["y"])]
    info = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3, 3]) for n in "xy"]
    return helper.make_model(helper.make_graph(nodes, "g", info[:1], info[1:]),
                             opset_imports=[helper.make_opsetid("", 17)])


X = np.arange(-4, 5, dtype=np.float32).reshape(3, 3) / 2


def _onnxruntime(model):
    import onnxruntime

    sess = onnxruntime.InferenceSession(model.SerializeToString(),
                                        providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": X})[0]


def test_the_registry_lists_it_and_the_plan_places_each_layer():
    assert backend_names()[:2] == ["numpy", "torch"] and NAME in backend_names()
    model = _model()
    sess = kiln.InferenceSession(model, backend=NAME, optimize=False)
    (y,) = sess.run(None, {"x": X})
    assert type(y) is np.ndarray
    np.testing.assert_allclose(y, _onnxruntime(model), rtol=1e-6)
    assert [(lp.how, lp.where) for lp in sess.placement().layers] == [
        (NAME, "sim"), (f"{NAME}-generic", "sim"), ("cpu-fallback", "cpu"),
        (f"{NAME}-generic", "sim")]
    steps = sess.plan.steps
    assert [s.transfers is not None for s in steps] == [False, False, True, False]


def test_the_cli_runs_it(tmp_path, capsys):
    """``kiln run --backend sim``: the CLI's choices come from the registry."""
    import onnx

    from kiln.cli.main import main

    model = _model()
    onnx.save(model, tmp_path / "m.onnx")
    np.save(tmp_path / "x.npy", X)
    out = tmp_path / "y.npz"
    assert main(["run", str(tmp_path / "m.onnx"), "--backend", NAME, "--no-optimize",
                 "--input", f"x={tmp_path / 'x.npy'}", "--output", str(out), "--json"]) == 0
    assert f'"backend": "{NAME}"' in capsys.readouterr().out
    np.testing.assert_allclose(np.load(out)["y"], _onnxruntime(model), rtol=1e-6)


def test_conformance_runs_it(tmp_path):
    """``python -m kiln.conformance --backend sim`` (ONNX's expected outputs the oracle)."""
    import json

    from kiln.conformance.__main__ import main

    report = tmp_path / "out.json"
    assert main(["--backend", NAME, "--kind", "node", "-k", "test_relu", "-j", "1",
                 "--strict", "--json", str(report)]) == 0
    outcomes = json.loads(report.read_text())
    assert outcomes and all(o["passed"] for o in outcomes)


def test_the_onnxruntime_api_and_quantization_take_it(tmp_path):
    """onnxruntime's options map onto it (deterministic compute is refused: it is not the
    exact backend), and quantization measures on it."""
    so = kiln.SessionOptions()
    model = _model()
    sess = kiln.InferenceSession(model.SerializeToString(), so, backend=NAME,
                                 providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": X})[0], _onnxruntime(model), rtol=1e-6)
    so.use_deterministic_compute = True
    with pytest.raises(OptionError, match="only the numpy backend"):
        kiln.InferenceSession(model.SerializeToString(), so, backend=NAME)
    q = kiln.quantize(model, "dynamic", backend=NAME, validation=[{"x": X}])
    assert q.report.backend == NAME


_CASES = collect(("node", "light"))


@pytest.mark.parametrize("case", _CASES, ids=[f"{c.kind}:{c.name}" for c in _CASES])
def test_onnx_backend_case(case):
    outcome = run_case(case, NAME, timeout=300)
    if case.name in _KNOWN:
        pytest.xfail(outcome.reason)
    assert outcome.passed, outcome.reason
