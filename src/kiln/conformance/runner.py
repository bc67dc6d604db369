"""Run ONNX's backend test data (node tests and model tests) against Kiln."""

from __future__ import annotations

import glob
import os
import signal
import traceback
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import numpy_helper
from onnx.backend.test.loader import load_model_tests
from onnx.backend.test.runner import Runner

from kiln.conformance.backend import backend_for
from kiln.onnxio.tensors import to_array
from kiln.runtime.backends import reference_backend_name

KINDS = ("node", "simple", "pytorch-converted", "pytorch-operator", "light")
_ONNX_ROOT = os.path.dirname(onnx.__file__)


@dataclass
class Case:
    """One conformance test: a model and its data sets."""

    name: str
    kind: str
    model_path: str | None
    rtol: float
    atol: float
    model: onnx.ModelProto | None = None
    data: list | None = None


@dataclass
class Outcome:
    name: str
    kind: str
    passed: bool
    reason: str = ""


def collect(kinds=KINDS, pattern: str | None = None) -> list[Case]:
    """The test cases of the given kinds whose name contains ``pattern``."""
    cases = []
    for kind in kinds:
        tests = load_model_tests(kind="real" if kind == "light" else kind)
        for t in tests:
            if pattern and pattern not in t.name:
                continue
            if kind == "node":  # generated in memory by onnx, not stored as files
                cases.append(Case(t.name, kind, None, t.rtol, t.atol, t.model, t.data_sets))
                continue
            if kind == "light":
                path = os.path.join(os.path.dirname(_ONNX_ROOT), t.url)
            else:
                path = os.path.join(t.model_dir, "model.onnx")
            cases.append(Case(t.name, kind, path, t.rtol, t.atol))
    return cases


def _load_value(path: str, tp: onnx.TypeProto):
    data = open(path, "rb").read()
    if tp.HasField("sequence_type"):
        p = onnx.SequenceProto()
        p.ParseFromString(data)
        return numpy_helper.to_list(p)
    if tp.HasField("optional_type"):
        p = onnx.OptionalProto()
        p.ParseFromString(data)
        return numpy_helper.to_optional(p)
    p = onnx.TensorProto()
    p.ParseFromString(data)
    return numpy_helper.to_array(p)


def _data_sets(case: Case, model: onnx.ModelProto):
    if case.data is not None:
        # Some generated cases (Cast to float8/int4...) hold TensorProtos, not arrays.
        def arr(x):
            return to_array(x) if isinstance(x, onnx.TensorProto) else x

        yield from (([arr(x) for x in i], [arr(x) for x in o]) for i, o in case.data)
        return
    inits = {i.name for i in model.graph.initializer}
    inputs = [i for i in model.graph.input if i.name not in inits]
    if case.kind == "light":
        feeds = [Runner.generate_dummy_data(x, seed=0, name=case.name, random=False)
                 for x in inputs]
        prefix = os.path.splitext(case.model_path)[0]
        refs = [numpy_helper.to_array(onnx.load_tensor(f"{prefix}_output_{i}.pb"))
                for i in range(len(model.graph.output))]
        yield feeds, refs
        return
    d = os.path.dirname(case.model_path)
    for ds in sorted(glob.glob(os.path.join(d, "test_data_set_*"))):
        feeds = [_load_value(os.path.join(ds, f"input_{i}.pb"), x.type)
                 for i, x in enumerate(inputs) if os.path.exists(os.path.join(ds, f"input_{i}.pb"))]
        refs = [_load_value(os.path.join(ds, f"output_{i}.pb"), o.type)
                for i, o in enumerate(model.graph.output)]
        yield feeds, refs


class _Timeout(Exception):
    pass


def run_case(case: Case, backend: str | None = None, timeout: int = 120,
             device: str = "cpu") -> Outcome:
    """Run one case on ``backend`` (None: the reference backend) and ``device`` ("cpu", or
    "cuda" for a backend that runs there); failures carry a one-line reason."""
    def on_alarm(*_):
        raise _Timeout(f"took longer than {timeout}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(timeout)
    try:
        model = case.model if case.model is not None else onnx.load(case.model_path)
        rep = backend_for(backend or reference_backend_name()).prepare(model, device.upper())
        for feeds, refs in _data_sets(case, model):
            outs = rep.run(feeds)
            outs = [_plain(o) for o in outs]
            Runner.assert_similar_outputs(_seq_items(refs), _seq_items(outs), rtol=case.rtol,
                                          atol=case.atol)
        return Outcome(case.name, case.kind, True)
    except BaseException as e:  # noqa: BLE001 - every failure becomes a reported reason
        if isinstance(e, KeyboardInterrupt):
            raise
        msg = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
        if not str(e):
            msg += " at " + traceback.extract_tb(e.__traceback__)[-1].name
        return Outcome(case.name, case.kind, False, " ".join(msg.split())[:300])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _seq_items(values: list) -> list:
    """Each sequence item wrapped in a one-item list: ONNX's comparison treats a sequence's
    items as lists of outputs themselves, which breaks on 0-d tensors."""
    return [[[e] for e in v] if isinstance(v, list) else v for v in values]


def _plain(x):
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)
