"""Tests for kiln.zoo: offline ONNX export, cache layout, symbolic dims and numerical agreement."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

import torch  # noqa: E402

from kiln import zoo  # noqa: E402
from kiln.zoo.__main__ import main  # noqa: E402

FAST = ["emotion_ferplus", "bert"]


@pytest.fixture(scope="module")
def zoo_dir(tmp_path_factory: pytest.TempPathFactory):
    """A private KILN_ZOO_DIR with the fast models built once for the whole module."""
    d = tmp_path_factory.mktemp("zoo")
    mp = pytest.MonkeyPatch()
    mp.setenv("KILN_ZOO_DIR", str(d))
    zoo.build(FAST, progress=False)
    yield d
    mp.undo()


def _torch_outputs(entry: zoo.ZooEntry, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    model = entry.make_model()
    with torch.no_grad():
        out = model(*(torch.from_numpy(v) for v in inputs.values()))
    return [t.numpy() for t in (out if isinstance(out, tuple) else (out,))]


def _check_model(name: str, root) -> None:
    entry = {e.name: e for e in zoo.list_models()}[name]
    d = root / name
    for f in ("model.onnx", "inputs.npz", "outputs.npz", "meta.json"):
        assert (d / f).is_file(), f
    assert zoo.path(name) == d / "model.onnx"
    inputs, outputs, meta = zoo.load_reference(name)

    # meta is complete and consistent with the graph
    assert meta["name"] == name and meta["exporter"] == entry.exporter
    assert meta["opset"] >= 17
    assert [i["name"] for i in meta["inputs"]] == list(inputs)
    assert [o["name"] for o in meta["outputs"]] == list(outputs)
    assert set(meta["tolerance"]) == {"atol", "rtol"}
    assert {"torch", "onnx", "onnxruntime"} <= set(meta["versions"])
    assert meta["node_count"] == sum(meta["op_histogram"].values()) > 0
    assert meta["file_size_bytes"] == (d / "model.onnx").stat().st_size
    proto = onnx.load(str(d / "model.onnx"))
    onnx.checker.check_model(proto)
    for v in (*proto.graph.input, *proto.graph.output):
        assert v.type.tensor_type.shape.dim[0].dim_param == "batch", v.name
    if entry.is_text:
        assert all(i["shape"][:2] == ["batch", "seq"] for i in meta["inputs"])
        assert inputs["attention_mask"].shape == (2, 16)
        assert inputs["attention_mask"].all(axis=1).tolist() == [True, False]  # one padded row
    else:
        assert next(iter(inputs.values())).shape[0] == 2

    # the stored reference is ORT's output on the stored inputs, and torch agrees with it
    sess = ort.InferenceSession(str(d / "model.onnx"), providers=["CPUExecutionProvider"])
    for got, (k, ref) in zip(sess.run(None, inputs), outputs.items()):
        np.testing.assert_array_equal(got, ref, err_msg=k)
    tol = meta["tolerance"]
    for ref, (k, got) in zip(_torch_outputs(entry, inputs), outputs.items()):
        np.testing.assert_allclose(got, ref, **tol, err_msg=f"torch vs ORT, {k}")

    # symbolic batch (and seq) dims: a different batch size runs and still matches torch
    other = zoo.make_inputs(name, batch=3, seq=24, seed=7)
    got = sess.run(None, other)
    for g, ref, o in zip(got, _torch_outputs(entry, other), meta["outputs"]):
        want = [3 if s == "batch" else 24 if s == "seq" else s for s in o["shape"]]
        assert list(g.shape) == want
        np.testing.assert_allclose(g, ref, **tol, err_msg=f"batch 3, {o['name']}")


@pytest.mark.parametrize("name", FAST)
def test_fast_models(zoo_dir, name: str) -> None:
    _check_model(name, zoo_dir)


def test_cache_reuse_and_cli(zoo_dir, capsys: pytest.CaptureFixture[str]) -> None:
    meta_file = zoo_dir / "emotion_ferplus" / "meta.json"
    before = meta_file.stat().st_mtime_ns
    assert main(["build", "-q", "emotion_ferplus"]) == 0  # cached: not rebuilt
    assert meta_file.stat().st_mtime_ns == before
    assert capsys.readouterr().out.strip() == str(zoo_dir / "emotion_ferplus" / "model.onnx")
    assert main(["list", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["bert"]["built"] and len(rows) == len(zoo.list_models())
    assert main(["build", "no_such_model"]) == 2


def test_stale_reason(zoo_dir) -> None:
    """A cached entry is current only when built by the installed torch/onnx/onnxruntime/...
    for the registry's exporter and opset: what the tests' ``zoo_model`` fixture rebuilds."""
    assert zoo.stale_reason("emotion_ferplus") is None
    assert zoo.stale_reason("gpt2") == "not built"
    meta_file = zoo_dir / "emotion_ferplus" / "meta.json"
    original = meta_file.read_text()
    try:
        meta = json.loads(original)
        meta["versions"]["onnxruntime"] = "0.0.1"
        meta_file.write_text(json.dumps(meta))
        assert zoo.stale_reason("emotion_ferplus") == (
            f"built with onnxruntime 0.0.1, installed is {ort.__version__}")
        meta = json.loads(original)
        meta["versions"]["transformers"] = "0.0.1"  # not used to build a vision model
        meta_file.write_text(json.dumps(meta))
        assert zoo.stale_reason("emotion_ferplus") is None
        meta["opset"] = 9
        meta_file.write_text(json.dumps(meta))
        assert "opset 9" in zoo.stale_reason("emotion_ferplus")
    finally:
        meta_file.write_text(original)
    assert zoo.stale_reason("emotion_ferplus") is None


def test_registry() -> None:
    entries = zoo.list_models()
    names = [e.name for e in entries]
    assert len(set(names)) == len(names)
    for required in ["resnet18", "resnet50", "mobilenetv2", "shufflenetv2", "vgg16",
                     "tinyyolov2", "arcface", "emotion_ferplus", "bert", "roberta", "gpt2",
                     "resnet18_dynamo", "bert_dynamo", "gpt2_dynamo"]:
        assert required in names
    assert {e.exporter for e in entries} == {"torchscript", "dynamo"}
    with pytest.raises(KeyError, match="unknown zoo model"):
        zoo.build(["nope"], progress=False)
    assert zoo.close_names("resnet") == ["resnet18", "resnet50"]
    assert zoo.close_names("gpt2dynamo")[0] == "gpt2_dynamo"
    assert zoo.close_names("qqqqqq") == []
    a, b = zoo.make_inputs("gpt2", 2, 16, seed=1), zoo.make_inputs("gpt2", 2, 16, seed=1)
    assert all(np.array_equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [e.name for e in zoo.list_models() if e.name not in FAST]
)
def test_other_models(zoo_dir, name: str) -> None:
    zoo.build([name], progress=False)
    _check_model(name, zoo_dir)
