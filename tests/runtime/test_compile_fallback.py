"""compile=True falling back to eager runs says so in one CompileWarning line; what the
compiler printed (a whole FX graph when a guard on a data-dependent value fails) stays
off stderr, at debug level on the ``kiln.compile`` logger (issue 47 item 9, issue 44
item 3). Run in a child process with its stderr captured, as a user sees it; outputs
are checked against onnxruntime."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from conftest import ort_run

pytest.importorskip("torch")

RUN = textwrap.dedent("""
    import sys, numpy as np, kiln
    x = np.load(sys.argv[2])
    out = kiln.InferenceSession(sys.argv[1], backend="torch", compile=True).run(None, {NAME: x})
    np.save(sys.argv[3], out[0])
""")


def _run_compiled(path, x, tmp_path, name: str, debug: bool = False):
    np.save(tmp_path / "x.npy", x)
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    code = RUN.replace("NAME", repr(name))
    if debug:
        code = "import logging; logging.basicConfig(level=logging.DEBUG)\n" + code
    r = subprocess.run([sys.executable, "-c", code, str(path), str(tmp_path / "x.npy"),
                        str(tmp_path / "y.npy")], capture_output=True, text=True,
                       env={**os.environ, "KILN_COMPILE_CACHE": str(cache)})
    assert r.returncode == 0, r.stderr
    return np.load(tmp_path / "y.npy"), r.stderr


def _data_dependent_tile(path) -> None:
    """Tile repeated by ceil(max(relu(x))): the repeat count is read from the data, which
    torch.export cannot guard on (GuardOnDataDependentSymNode), so compiling fails."""
    nodes = [helper.make_node("Relu", ["x"], ["r"]),
             helper.make_node("ReduceMax", ["r"], ["m"], keepdims=0),
             helper.make_node("Ceil", ["m"], ["c"]),
             helper.make_node("Cast", ["c"], ["k"], name="cast", to=TensorProto.INT64),
             helper.make_node("Unsqueeze", ["k", "ax"], ["k1"], name="unsqueeze"),
             helper.make_node("Concat", ["k1", "one"], ["reps"], name="concat", axis=0),
             helper.make_node("Tile", ["r", "reps"], ["t"], name="tile"),
             helper.make_node("ReduceSum", ["t"], ["y"], keepdims=0)]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])],
        [helper.make_tensor("one", TensorProto.INT64, [1], [1]),
         helper.make_tensor("ax", TensorProto.INT64, [1], [0])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    onnx.save(m, str(path))


def test_a_failed_compile_is_one_warning_line_not_an_fx_graph(tmp_path):
    path = tmp_path / "tile.onnx"
    _data_dependent_tile(path)
    x = np.random.default_rng(1).standard_normal((2, 5)).astype(np.float32)
    y, err = _run_compiled(path, x, tmp_path, "x")
    np.testing.assert_allclose(y, ort_run(str(path), {"x": x})[0], rtol=1e-5)
    assert "def forward" not in err and "torch.ops.aten" not in err, err
    warned = [line for line in err.splitlines() if "CompileWarning" in line]
    assert len(warned) == 1 and "running eagerly" in warned[0], err
    # It names the layer that reads the repeat count on the host (the optimizer keeps the
    # count's arithmetic there, so the read may be in any layer from the cast on), and why.
    assert re.search(r"layer '(cast|unsqueeze|concat|tile)' \((Cast|Unsqueeze|Concat|Tile)\) "
                     "reads a value computed from the data on the host", warned[0]), err
    # Only that layer runs eagerly: the layers before it (Relu, ReduceMax, Ceil) are a
    # compiled program.
    assert "running eagerly between compiled programs" in warned[0], err
    # Asked for, the compiler's own output is there, on the kiln.compile logger.
    again = tmp_path / "debug"
    again.mkdir()
    _, debug = _run_compiled(path, x, again, "x", debug=True)
    assert "kiln.compile" in debug and "def forward" in debug


@pytest.mark.slow
def test_mobilenetv2_with_relu6_as_clip_compiles_quietly(zoo_model, tmp_path):
    """The zoo's MobileNetV2 is torchvision's architecture, exported with ReLU6 as Clip
    whose bounds are scalar Constant inputs (the case of issue 44 that printed an FX graph);
    it now compiles, and nothing but Kiln's own lines reach stderr."""
    path = zoo_model("mobilenetv2")
    clips = [n for n in onnx.load(str(path)).graph.node if n.op_type == "Clip"]
    assert clips and all(len(n.input) == 3 for n in clips)
    x = np.random.default_rng(0).standard_normal((1, 3, 224, 224)).astype(np.float32)
    y, err = _run_compiled(path, x, tmp_path, "input")
    want = ort_run(str(path), {"input": x})[0]
    assert np.abs(y - want).max() <= 1e-3 * np.abs(want).max()
    assert "def forward" not in err and "torch.ops.aten" not in err, err
