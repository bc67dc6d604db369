"""Differential test of the optimizer: every model available to the test suite runs
optimized and unoptimized on Kiln's NumPy backend, and the outputs must agree within
float tolerance. Models: ONNX's light models (random float32 inputs of the declared
shape), ONNX's ``simple`` and ``pytorch-converted`` model tests (their stored inputs), and
the Kiln zoo models (their reference inputs), built on demand by conftest's ``zoo_model``
fixture, so the counts do not depend on what the cache held before the run.

A model Kiln cannot run unoptimized (an op still missing) is skipped with the reason. Each
case prints the optimizer's report (node counts before/after, what each pass did); run
with ``-s`` to see them, or ``python tests/passes/test_optimizer_differential.py [names]``.
"""

from __future__ import annotations

import glob
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import kiln
from kiln.optimize import optimize_with_report

ONNX_DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
_ZOO_SLOW = {"vgg16", "resnet50", "arcface", "arcface_dynamo", "emotion_ferplus",
             "emotion_ferplus_dynamo", "roberta", "roberta_dynamo", "tinyyolov2",
             "tinyyolov2_dynamo"}


def _light_cases():
    for path in sorted(glob.glob(os.path.join(ONNX_DATA, "light", "*.onnx"))):
        name = os.path.basename(path)[:-5]
        yield pytest.param(("light", name, path), id=f"light:{name}", marks=pytest.mark.slow)


def _dir_cases(kind: str):
    for d in sorted(glob.glob(os.path.join(ONNX_DATA, kind, "*"))):
        if os.path.exists(os.path.join(d, "model.onnx")):
            name = os.path.basename(d)
            yield pytest.param((kind, name, d), id=f"{kind}:{name}")


def _zoo_cases():
    try:
        from kiln import zoo
    except ImportError:
        return
    for e in zoo.list_models():
        marks = [pytest.mark.slow] if e.name in _ZOO_SLOW else []
        yield pytest.param(("zoo", e.name, None), id=f"zoo:{e.name}", marks=marks)


CASES = [*_light_cases(), *_dir_cases("simple"), *_dir_cases("pytorch-converted"),
         *_zoo_cases()]


def _random_feed(vi: onnx.ValueInfoProto, rng) -> np.ndarray:
    t = vi.type.tensor_type
    shape = [d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim]
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
    if dtype.kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    if dtype.kind == "b":
        return rng.random(shape) > 0.5
    return rng.integers(0, 3, shape).astype(dtype)


def _read(path: str, tp: onnx.TypeProto):
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


def load_case(kind: str, name: str, where: str | None,
              zoo_model: Callable[[str], Path] | None = None):
    """(model path or proto, feeds dict, rtol, atol) for one case; skips when unavailable.
    ``zoo_model`` builds a zoo model on demand (the conftest fixture; default
    ``kiln.zoo.path``, which builds a missing one too)."""
    if kind == "zoo":
        from kiln import zoo

        path = (zoo_model or zoo.path)(name)
        inputs, _, meta = zoo.load_reference(name)
        tol = meta.get("tolerance", {})
        return str(path), dict(inputs), tol.get("rtol", 1e-3), tol.get("atol", 1e-4)
    if kind == "light":
        model = onnx.load(where)
        inits = {i.name for i in model.graph.initializer}
        rng = np.random.default_rng(0)
        feeds = {vi.name: _random_feed(vi, rng) for vi in model.graph.input
                 if vi.name not in inits}
        return where, feeds, 1e-3, 1e-4
    path = os.path.join(where, "model.onnx")
    model = onnx.load(path)
    inits = {i.name for i in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in inits]
    ds = os.path.join(where, "test_data_set_0")
    feeds = {}
    for i, vi in enumerate(inputs):
        f = os.path.join(ds, f"input_{i}.pb")
        if os.path.exists(f):
            feeds[vi.name] = _read(f, vi.type)
    return path, feeds, 1e-4, 1e-5


def _compare(a, b, rtol, atol, what):
    if isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), what
        for x, y in zip(a, b):
            _compare(x, y, rtol, atol, what)
        return
    if a is None:
        assert b is None, what
        return
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape and a.dtype == b.dtype, f"{what}: {a.shape}/{a.dtype} vs " \
                                                      f"{b.shape}/{b.dtype}"
    if a.dtype.kind in "fc":
        np.testing.assert_allclose(b, a, rtol=rtol, atol=atol, err_msg=what)
    else:
        np.testing.assert_array_equal(b, a, err_msg=what)


def run_case(kind: str, name: str, where: str | None, verbose: bool = True,
             fixed: bool = False, zoo_model: Callable[[str], Path] | None = None):
    """Run one model both ways and compare; returns the optimizer's report. ``fixed``:
    optimize with the inputs' shapes fixed to those of the feeds."""
    source, feeds, rtol, atol = load_case(kind, name, where, zoo_model)
    shapes = {k: list(np.shape(v)) for k, v in feeds.items()} if fixed else None
    model = kiln.load(source)
    try:
        plain = kiln.InferenceSession(model, optimize=False)
    except kiln.UnsupportedOpError as e:
        pytest.skip(f"Kiln cannot run it unoptimized yet: {e.ops}")
    optimized, report = optimize_with_report(model, input_shapes=shapes)
    if verbose:
        print(f"\n[{kind}:{name}] {report.summary()}")
    fast = kiln.InferenceSession(optimized, optimize=False)
    try:
        want = plain.run(None, feeds)
    except kiln.KilnError as e:
        pytest.skip(f"the unoptimized model fails on Kiln: {str(e)[:200]}")
    got = fast.run(None, feeds)
    names = [o.name for o in plain.get_outputs()]
    for n, w, g in zip(names, want, got):
        _compare(w, g, rtol, atol, f"{kind}:{name} output {n}")
    return report


def ort_level1_case(kind: str, name: str, where: str | None, tmp_path,
                    zoo_model: Callable[[str], Path] | None = None) -> None:
    """The level-1 optimized model (standard ONNX only) saved and run by onnxruntime
    agrees with onnxruntime on the original: an oracle independent of Kiln's kernels."""
    ort = pytest.importorskip("onnxruntime")
    source, feeds, rtol, atol = load_case(kind, name, where, zoo_model)
    try:
        ref = ort.InferenceSession(source if isinstance(source, str) else
                                   source.SerializeToString(),
                                   providers=["CPUExecutionProvider"])
        want = ref.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - models onnxruntime itself rejects
        pytest.skip(f"onnxruntime cannot run the original: {str(e)[:120]}")
    basic = kiln.optimize(kiln.load(source), level=1)
    path = kiln.save(basic, tmp_path / "basic.onnx", external_data=True)
    onnx.checker.check_model(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)
    for o, w, g in zip(ref.get_outputs(), want, got):
        _compare(w, g, rtol, atol, f"{kind}:{name} output {o.name} (onnxruntime, level 1)")


@pytest.mark.parametrize("case", CASES)
def test_optimized_matches_unoptimized(case, zoo_model):
    run_case(*case, zoo_model=zoo_model)


@pytest.mark.parametrize("case", [c for c in CASES if c.id.startswith(("zoo:", "light:"))])
def test_fixed_input_shapes_match_unoptimized(case, zoo_model):
    run_case(*case, fixed=True, zoo_model=zoo_model)


@pytest.mark.parametrize("case", CASES)
def test_basic_level_output_runs_on_onnxruntime(case, tmp_path, zoo_model):
    ort_level1_case(*case, tmp_path, zoo_model=zoo_model)


def test_every_zoo_and_light_model_is_covered():
    ids = {c.id for c in CASES}
    assert any(i.startswith("light:") for i in ids)
    assert any(i.startswith("simple:") for i in ids)
    assert any(i.startswith("pytorch-converted:") for i in ids)


def bench(names: list[str], rounds: int = 20) -> None:
    """Markdown table of node counts and NumPy-backend latency, unoptimized vs optimized
    (vs optimized with the inputs' shapes fixed), for zoo models; runs interleaved, best
    and median of ``rounds``."""
    import time

    from kiln import zoo
    from kiln.passes.base import count_nodes

    print("| model | nodes before | nodes after | fixed-shape nodes | latency before (ms) "
          "| after (ms) | speed-up | fixed shapes (ms) | speed-up |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in names:
        inputs, _, _ = zoo.load_reference(name)
        path = str(zoo.path(name))
        shapes = {k: list(v.shape) for k, v in inputs.items()}
        sessions = [kiln.InferenceSession(path, optimize=False), kiln.InferenceSession(path),
                    kiln.InferenceSession(path, input_shapes=shapes)]
        times: list[list[float]] = [[] for _ in sessions]
        for s in sessions:
            s.run(None, inputs)
        for _ in range(rounds):
            for s, t in zip(sessions, times):
                t0 = time.perf_counter()
                s.run(None, inputs)
                t.append(time.perf_counter() - t0)
        best = [min(t) * 1e3 for t in times]
        med = [float(np.median(t)) * 1e3 for t in times]
        nodes = [count_nodes(s.model.graph) for s in sessions]
        print(f"| {name} | {nodes[0]} | {nodes[1]} | {nodes[2]} | {best[0]:.1f} "
              f"(median {med[0]:.1f}) | {best[1]:.1f} ({med[1]:.1f}) | "
              f"{best[0] / best[1]:.2f}x | {best[2]:.1f} ({med[2]:.1f}) | "
              f"{best[0] / best[2]:.2f}x |", flush=True)


if __name__ == "__main__":  # python tests/passes/test_optimizer_differential.py [--bench] [name...]
    args = sys.argv[1:]
    if args and args[0] == "--bench":
        bench(args[1:] or ["resnet18", "resnet50", "mobilenetv2", "bert", "gpt2"])
        sys.exit()
    wanted = set(args)
    for p in CASES:
        kind, name, where = p.values[0]
        if wanted and name not in wanted:
            continue
        try:
            run_case(kind, name, where)
            print("  ok")
        except pytest.skip.Exception as e:
            print(f"[{kind}:{name}] skipped: {e}")
        except AssertionError as e:
            print(f"[{kind}:{name}] MISMATCH: {str(e)[:300]}")
