"""The seeded fuzz campaign CI runs (issue 14): 1,000 mutated models through load -> session
-> run on both backends, in forked workers under memory and time limits; any outcome but a
result equal to onnxruntime's or a KilnError fails (docs/reliability.md)."""

import subprocess
import sys
from pathlib import Path

import pytest

FUZZER = Path(__file__).resolve().parents[2] / "fuzz" / "fuzz_kiln.py"


def _fuzzer():
    """The fuzzer module (fuzz/ is no package)."""
    sys.path.insert(0, str(FUZZER.parent))
    try:
        import fuzz_kiln
    finally:
        sys.path.remove(str(FUZZER.parent))
    return fuzz_kiln


def test_seeded_fuzz_campaign_finds_no_failure():
    pytest.importorskip("onnxruntime")  # the campaign's oracle
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, str(FUZZER), "--seed", "0", "--cases", "1000"],
                       capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, (r.stdout[-4000:] + r.stderr[-4000:])


def test_a_worker_running_many_cases_classes_each_as_a_fresh_process_does():
    """Workers serve up to 200 cases each (forking per case cost most of a case's time):
    no case's outcome may depend on the cases run before it in the same worker."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    fuzz_kiln = _fuzzer()
    seeds = range(1000, 1030)
    shared = [(cls, detail) for _, cls, detail in fuzz_kiln.outcomes(seeds)]
    assert len(shared) == len(seeds)
    assert shared == [fuzz_kiln.run_isolated(s) for s in seeds]


def test_a_case_onnxruntime_crashes_on_is_not_put_down_to_kiln():
    """Seed 2123998 (a Split with an empty output name) segfaults onnxruntime 1.32; the
    fuzzer's worker dies while the oracle runs, and Kiln's own run of it is fine."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    fuzz_kiln = _fuzzer()
    cls, _ = fuzz_kiln.run_isolated(2123998)
    assert cls in fuzz_kiln.OK_CLASSES, cls


@pytest.mark.parametrize("case", [3134839, 4386775])
def test_nan_propagated_is_only_a_nan_that_pytorch_computes_too(case):
    """Cases of the long campaigns: a flipped byte put a NaN (3134839) or an infinity
    (4386775) in a 3x3 convolution's weight. Kiln's NumPy backend, like PyTorch's
    F.conv2d, carries it through the zero padding (NaN * 0 and inf * 0 are NaN) into
    outputs onnxruntime computes without the padded taps. The torch backend's oneDNN
    convolution with packed weights (on x86) skips the padded taps as onnxruntime does.
    The fuzzer classes this ``nan_propagated``, and only where the differing values are
    NaNs PyTorch gives."""
    pytest.importorskip("onnxruntime")
    torch = pytest.importorskip("torch")
    import numpy as np
    import onnx
    from onnx import numpy_helper

    import kiln

    fuzz_kiln = _fuzzer()
    data, feeds = fuzz_kiln.make_case(case)
    (w,) = [numpy_helper.to_array(t) for t in onnx.load_from_string(data).graph.initializer]
    assert not np.isfinite(w).all()
    x = feeds["x4"]
    from conftest import ort_run
    from kiln.ops.torch import conv

    want = {"numpy": torch.nn.functional.conv2d(torch.from_numpy(x), torch.from_numpy(w),
                                                padding=1).numpy()}
    want["torch"] = ort_run(onnx.load_from_string(data), feeds)[0] if conv.PREPACK \
        else want["numpy"]
    for backend in ("numpy", "torch"):
        got = kiln.InferenceSession(data, backend=backend).run(None, feeds)[0]
        np.testing.assert_allclose(got, want[backend], rtol=1e-5, atol=1e-6, equal_nan=True)
    assert fuzz_kiln._run_case(case) == ("nan_propagated", "")


def test_the_oracle_asks_the_reference_and_explains_each_refusal():
    """Issue 39: a case onnxruntime refuses and Kiln runs is ``reference_checked`` where
    onnx.reference gives Kiln's result, ``unchecked`` only with a documented reason, and
    otherwise ``unexplained``, a failure."""
    pytest.importorskip("onnxruntime")
    import numpy as np
    from onnx import TensorProto, helper

    fuzz_kiln = _fuzzer()
    # no outputs: onnxruntime refuses, the reference cannot run it either; documented
    empty = helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], []),
        opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"x": np.ones(2, np.float32)}
    cls, why = fuzz_kiln.classify(empty.SerializeToString(), feeds)
    assert cls in ("unchecked", "reference_checked"), (cls, why)
    # ...whatever onnxruntime's words: a Reshape-1 without its (optional) shape attribute
    # fails in onnxruntime's kernel constructor, and no output needs it (case 10501377)
    legacy = helper.make_model(helper.make_graph(
        [helper.make_node("Reshape", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])], []),
        opset_imports=[helper.make_opsetid("", 1)])
    cls, why = fuzz_kiln.classify(legacy.SerializeToString(), feeds)
    assert cls == "unchecked" and why == fuzz_kiln.UNUSED_NODE, (cls, why)
    # a type-constraint refusal ("of Optype (Greater)") of a node no output reads (12633015)
    unused = helper.make_model(helper.make_graph(
        [helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
         helper.make_node("Greater", ["m", "zero"], ["c"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2])],
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [2])],
        [helper.make_tensor("zero", TensorProto.FLOAT, [], [0.0])]),
        opset_imports=[helper.make_opsetid("", 17)])
    cls, why = fuzz_kiln.classify(unused.SerializeToString(), {"x": np.ones(2)})
    assert cls == "unchecked" and why == fuzz_kiln.UNUSED_NODE, (cls, why)
    assert fuzz_kiln.explained("[ONNXRuntimeError] something new") is None
    assert "unexplained" not in fuzz_kiln.OK_CLASSES and "wrong" not in fuzz_kiln.OK_CLASSES


def test_fuzz_cases_fail_through_kiln_onnxruntime_with_onnxruntimes_exception_classes():
    """Issue 39: through the drop-in ``kiln.onnxruntime`` every refusal is one of
    onnxruntime's classes (``Fail``, ``InvalidGraph``..., or the bindings' RuntimeError), so
    code written for onnxruntime catches it; 2,000 seeds were checked so on 2026-11-29."""
    import warnings

    fuzz_kiln = _fuzzer()
    import kiln.onnxruntime as kort
    from kiln.onnxruntime.capi import _errors

    expected = (*_errors.STATUS, RuntimeError)
    refused = 0
    for seed in range(300):
        try:
            data, feeds = fuzz_kiln.make_case(seed)
        except Exception:  # noqa: BLE001 - a mutation protobuf refuses: no case
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                kort.InferenceSession(data).run(None, feeds)
            except expected:
                refused += 1
            except Exception as e:  # noqa: BLE001 - the failure this test is for
                pytest.fail(f"seed {seed}: {type(e).__mro__[:3]} {e}")
    assert refused > 100  # the seeds do reach the refusals
