"""The training examples end to end with small budgets (the documented runs are longer):
what they print is checked against onnxruntime running the model files they saved on
held-out digits the test selects itself."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")
ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from sklearn.datasets import load_digits  # noqa: E402
from sklearn.model_selection import train_test_split  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NUM = r"([01]\.\d{4})"


def _example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ort_accuracy(path: Path, x: np.ndarray, y: np.ndarray) -> float:
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return float((sess.run(None, {"image": x})[0].argmax(1) == y).mean())


def test_finetune_example_saves_the_model_it_reports(tmp_path, capsys):
    out = tmp_path / "tuned.onnx"
    _example("finetune_digits").main(["--epochs", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    rows = re.findall(rf"^\s+(\d+)\s+(?:nan|\d+\.\d{{4}})\s+{NUM}$", printed, re.M)
    assert [int(e) for e, _ in rows] == [0, 1], printed
    damaged, tuned = (float(a) for _, a in rows)
    said = float(re.search(rf"onnxruntime held-out accuracy {NUM}", printed).group(1))
    # the held-out quarter of scikit-learn's digits the shipped model was not trained on
    d = load_digits()
    x = (d.images / 16.0).astype(np.float32)[:, None]
    _, x_te, _, y_te = train_test_split(x, d.target, test_size=0.25, random_state=0,
                                        stratify=d.target)
    measured = _ort_accuracy(out, x_te, y_te)
    assert round(measured, 4) == said == tuned
    assert tuned > 0.6  # chance is 0.1; one epoch repairs most of the damage
    assert tuned > damaged


def test_transfer_example_runs_both_arms_for_every_seed(tmp_path, capsys):
    out = tmp_path / "six_to_nine.onnx"
    _example("transfer_digits").main(["--epochs", "4", "--seeds", "2",
                                      "--pretrain-epochs", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    rows = {m[0]: [float(v) for v in m[1:]]
            for m in re.findall(rf"^\s+(\d+|mean|std)\s+{NUM}\s+{NUM}\s+{NUM}$", printed, re.M)}
    assert set(rows) == {"0", "1", "mean", "std"}, printed
    per_seed = np.array([rows["0"], rows["1"]])  # columns: head only, then all, scratch
    assert np.allclose(rows["mean"], per_seed.mean(0), atol=1e-4)
    assert np.allclose(rows["std"], per_seed.std(0, ddof=1), atol=1e-4)
    assert (per_seed > 0.4).all()  # 4 classes: chance is 0.25
    # the test set: 300 images of 6-9 set aside once, the same for every seed
    d = load_digits()
    test = np.random.default_rng(12345).choice(np.flatnonzero(d.target >= 6), 300,
                                               replace=False)
    x = (d.images[test] / 16.0).astype(np.float32)[:, None]
    measured = _ort_accuracy(out, x, d.target[test] - 6)
    said = float(re.search(rf"onnxruntime accuracy {NUM} on {len(test)} test", printed).group(1))
    assert round(measured, 4) == said == rows["0"][1]
