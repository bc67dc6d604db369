"""``kiln cut``, ``kiln edit`` and ``kiln optimize``'s preprocessing flags, run as a user
runs them (a subprocess); the written models are checked against onnxruntime on the
original model, as in test_surgery.py."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_surgery import (
    DIGITS,
    MEAN,
    SCALE,
    _conv_first,
    _numpy_steps,
    digits_images,
    ort_outputs,
)

from kiln.cli.main import main

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def kiln_subprocess(*args) -> subprocess.CompletedProcess:
    """``kiln ARGS`` exactly as a user runs it."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "kiln.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture
def kiln_cli(capsys):
    """``kiln ARGS`` through the same entry point in this process (a subprocess costs
    seconds of imports each): returns (exit code, stdout, stderr)."""
    def run(*args):
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


def ok(r) -> str:
    code, out, err = (r.returncode, r.stdout, r.stderr) if \
        isinstance(r, subprocess.CompletedProcess) else r
    assert code == 0, f"exit {code}\nstdout:\n{out}\nstderr:\n{err}"
    return out


def test_cut_command(tmp_path, kiln_cli):
    out = tmp_path / "part.onnx"
    text = ok(kiln_subprocess("cut", DIGITS, "-o", out, "--input", "/2/Relu_output_0:4x16x8x8",
                       "--output", "/10/Relu"))
    assert "inputs: /2/Relu_output_0 (4, 16, 8, 8)" in text
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    x = np.random.default_rng(0).random((4, 1, 8, 8), dtype=np.float32)
    ref = ort_outputs(DIGITS, {"image": x}, ["/2/Relu_output_0", "/10/Relu_output_0"])
    got = ort_outputs(str(out), {"/2/Relu_output_0": ref["/2/Relu_output_0"]})
    np.testing.assert_allclose(got["/10/Relu_output_0"], ref["/10/Relu_output_0"],
                               rtol=1e-5, atol=1e-5)
    text = ok(kiln_cli("cut", DIGITS, "-o", out, "--last-layers", "-1"))
    assert "outputs: /10/Relu_output_0" in text
    code, _, err = kiln_cli("cut", DIGITS, "-o", out, "--output", "/10/Relo")
    assert code == 1 and "did you mean '/10/Relu'" in err


def test_optimize_embeds_preprocessing(tmp_path, kiln_cli):
    images, labels = digits_images(32)
    out = tmp_path / "u8.onnx"
    text = ok(kiln_cli("optimize", DIGITS, "-o", out, "--input-type", "image=uint8",
                       "--scale-values", "image=[16]", "--level", "1"))
    assert "preprocessing embedded for image" in text
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    got = ort_outputs(str(out), {"image": images})["logits"]
    ref = ort_outputs(DIGITS, {"image": (images / 16).astype(np.float32)})["logits"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    # the Model Optimizer flags on a 3-channel Conv-first net, names left out
    src = tmp_path / "net.onnx"
    onnx.save(_conv_first(pads=0), str(src))
    out = tmp_path / "bgr.onnx"
    ok(kiln_cli("optimize", src, "-o", out, "--level", "1",
                "--mean-values", "[123.7,116.3,103.5]", "--scale-values", "x=[58.4,57.1,57.4]",
                "--reverse-input-channels", "--layout", "x=NHWC", "--input-type", "uint8"))
    u = np.random.default_rng(1).integers(0, 256, (2, 10, 12, 3), dtype=np.uint8)
    got = ort_outputs(str(out), {"x": u})["y"]
    ref = ort_outputs(_conv_first(pads=0), {"x": _numpy_steps(u, "NHWC", True, MEAN,
                                                               SCALE)})["y"]
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
    code, _, err = kiln_cli("optimize", src, "-o", out, "--mean-values", "x=[1,2]")
    assert code == 1 and "3 channels" in err


def test_edit_command(tmp_path, kiln_cli):
    out = tmp_path / "labels.onnx"
    text = ok(kiln_cli("edit", DIGITS, "-o", out, "--tail", "argmax", "--batch", "4",
                       "--rename", "logits_argmax=label"))
    assert "outputs: label (4)" in text
    onnx.checker.check_model(onnx.load(str(out)), full_check=True)
    x = np.random.default_rng(2).random((4, 1, 8, 8), dtype=np.float32)
    logits = ort_outputs(DIGITS, {"image": x})["logits"]
    np.testing.assert_array_equal(ort_outputs(str(out), {"image": x})["label"],
                                  logits.argmax(1))
    second = tmp_path / "double.onnx"
    f = TensorProto.FLOAT
    onnx.save(helper.make_model(helper.make_graph(
        [helper.make_node("Add", ["z", "z"], ["twice"])], "g",
        [helper.make_tensor_value_info("z", f, ["b", 10])],
        [helper.make_tensor_value_info("twice", f, ["b", 10])]),
        opset_imports=[helper.make_opsetid("", 17)]), str(second))
    ok(kiln_cli("edit", DIGITS, "-o", out, "--append", second, "--io-map", "logits=z"))
    np.testing.assert_allclose(ort_outputs(str(out), {"image": x})["twice"], 2 * logits,
                               rtol=1e-5)
    code, _, err = kiln_cli("edit", DIGITS, "-o", out, "--append", second)
    assert code == 2 and "--io-map" in err

