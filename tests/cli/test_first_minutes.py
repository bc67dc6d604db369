"""What a new user tripped over (issue 47 items 4, 5, 8, 9; issue 39 items 14-16): each a
mistake or a default, with the message or result it must give."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.errors import MissingDependencyError, ModelLoadError, SaveError

ROOT = Path(__file__).resolve().parents[2]
DIGITS = str(Path(kiln.__file__).parent / "data" / "digits_cnn.onnx")
IMAGES = np.load(Path(DIGITS).parent / "digits_test.npz")["images"]


def _py(code: str, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _kiln(*args: str, cwd: Path | None = None, timeout: int = 300):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONWARNINGS="ignore")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True,
                       timeout=timeout, env=env, cwd=cwd)
    return r, time.perf_counter() - t0


def _ort_logits(path: str, x: np.ndarray) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


# -- item 4: to_torch without torch ------------------------------------------------------

def test_to_torch_without_torch_names_the_extra():
    r = _py("import sys; sys.modules['torch'] = None\nimport kiln\n"
            f"try:\n    kiln.to_torch({DIGITS!r})\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    assert r.stdout.startswith(MissingDependencyError.__name__), r.stdout + r.stderr
    assert 'pip install -e ".[torch]"' in r.stdout


# -- item 5 and issue 39 item 14: saving ---------------------------------------------------

def test_an_output_folder_that_does_not_exist_is_not_created(tmp_path):
    target = tmp_path / "no" / "such" / "o.onnx"
    r, _ = _kiln("optimize", DIGITS, "-o", str(target))
    assert r.returncode == 1 and "does not exist" in r.stderr, r.stderr
    assert not (tmp_path / "no").exists()
    with pytest.raises(SaveError, match="does not exist"):
        kiln.save(kiln.load(DIGITS), target)


def test_a_full_disk_is_a_kiln_error_and_the_old_file_stays(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    kiln.save(kiln.load(DIGITS), path)
    before = path.read_bytes()

    def full(self, data):  # what write_bytes meets on a full disk
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    with pytest.raises(SaveError, match="disk is full") as e:
        kiln.save(kiln.add_tail(DIGITS, "Softmax"), path)
    assert isinstance(e.value, OSError) and e.value.errno == errno.ENOSPC
    assert "unchanged" in str(e.value)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.onnx"]  # no temp folder left
    x = IMAGES[:4]
    np.testing.assert_allclose(_ort_logits(str(path), x), _ort_logits(DIGITS, x), atol=1e-5)


def test_temp_folders_of_killed_saves_are_removed_and_a_running_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    import socket

    left = tmp_path / ".m.onnx.ab12cd34"  # a killed save's: its process is gone
    left.mkdir()
    (left / "m.onnx").write_bytes(b"x" * 1000)
    (left / ".kiln-save-owner").write_text(f"{socket.gethostname()}:{dead}")
    running = tmp_path / ".m.onnx.zz99yy88"  # a save still writing (this process)
    running.mkdir()
    (running / ".kiln-save-owner").write_text(f"{socket.gethostname()}:{os.getpid()}")
    old = tmp_path / ".m.onnx.oldoldol"  # no owner file, untouched for two days
    old.mkdir()
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    other = tmp_path / ".other.onnx.ab12cd34"  # another file's: not this save's business
    other.mkdir()
    kiln.save(kiln.load(DIGITS), tmp_path / "m.onnx")
    assert not left.exists() and not old.exists()
    assert running.exists() and other.exists()


def test_kiln_save_takes_what_kiln_quantize_returns(tmp_path):
    q = kiln.quantize(DIGITS, "dynamic")
    kiln.save(q, tmp_path / "q.onnx")
    q.save(tmp_path / "q2.onnx")
    x = IMAGES[:8]
    np.testing.assert_array_equal(_ort_logits(str(tmp_path / "q.onnx"), x),
                                  _ort_logits(str(tmp_path / "q2.onnx"), x))


# -- item 9: a folder given as the model ------------------------------------------------

def test_a_folder_given_as_the_model_is_called_a_folder(tmp_path):
    (tmp_path / "m.onnx").write_bytes(Path(DIGITS).read_bytes())
    with pytest.raises(ModelLoadError, match="is a folder.*m.onnx"):
        kiln.load(tmp_path)
    r, _ = _kiln("inspect", str(tmp_path))
    assert r.returncode == 1 and "is a folder" in r.stderr, r.stderr


# -- a zoo name works wherever a file does: kiln serve too ---------------------------------

def test_serve_takes_a_zoo_name_and_serves_it_under_that_name(zoo_model, tmp_path):
    pytest.importorskip("starlette")
    import json
    import urllib.request

    path = zoo_model("emotion_ferplus")  # built once; the server resolves the name itself
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), KILN_ZOO_DIR=str(path.parent.parent))
    server = subprocess.Popen([sys.executable, "-m", "kiln", "serve", "emotion_ferplus",
                               "--http-port", "0", "--grpc-port", "0"], env=env,
                              stderr=subprocess.PIPE, text=True)
    try:
        assert server.stderr is not None
        line = next(x for x in server.stderr if "HTTP on" in x or "error" in x)
        assert "models: emotion_ferplus" in line, line
        url = "http://" + line.split("HTTP on ")[1].split(",")[0] + \
            "/v2/models/emotion_ferplus/infer"
        x = np.random.default_rng(0).standard_normal((1, 1, 64, 64)).astype(np.float32)
        name = kiln.InferenceSession(str(path)).get_inputs()[0].name
        body = {"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                            "data": x.ravel().tolist()}]}
        req = urllib.request.Request(url, json.dumps(body).encode())
        out = json.load(urllib.request.urlopen(req, timeout=120))["outputs"][0]
        got = np.array(out["data"], np.float32).reshape(out["shape"])
        np.testing.assert_allclose(got, _ort_logits(str(path), x), rtol=1e-4, atol=1e-4)
    finally:
        server.terminate()
        server.wait(timeout=60)


# -- item 6: training.md's freeze-by-name example freezes some, not all --------------------

def test_the_docs_freeze_by_name_example_matches_the_shipped_models_layers():
    """The doc block runs as written elsewhere (test_docs_examples); run alone it proved
    nothing when its pattern matched no parameter (everything frozen, nothing learns)."""
    pytest.importorskip("torch")
    text = (ROOT / "docs" / "training.md").read_text()
    blocks = text.split("```python\n")[1:]
    (code,) = [b.split("```")[0] for b in blocks if "requires_grad_(name." in b]
    namespace = {"model": kiln.to_torch(DIGITS)}
    exec(code, namespace)
    params = dict(namespace["model"].named_parameters())
    trained = {n for n, p in params.items() if p.requires_grad}
    assert trained and trained != set(params), (trained, list(params))


# -- item 8: the deliberate onnxruntime crash stays out of the test output -----------------

def test_the_onnxruntime_crash_test_prints_no_fatal_error():
    pytest.importorskip("onnxruntime")
    pytest.importorskip("torch")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                        str(ROOT / "tests" / "runtime" / "test_fuzz_campaign.py"),
                        "-k", "crashes_on"],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert "1 passed" in r.stdout, r.stdout + r.stderr
    assert "Fatal Python error" not in r.stdout + r.stderr


# -- item 3: the first test run says which zoo models it builds -------------------------

def test_a_test_run_building_a_zoo_model_says_so_step_by_step(tmp_path):
    """In pytest's own output, not the test's captured output (shown only on failure)."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    test = "tests/edit/test_surgery.py::test_cut_by_tensor_agrees_with_the_originals_intermediates"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
                       cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, PYTHONPATH=str(ROOT / "src"),
                                KILN_ZOO_DIR=str(tmp_path / "zoo")))
    assert "1 passed" in r.stdout, r.stdout + r.stderr
    assert "building zoo model emotion_ferplus into" in r.stdout, r.stdout
    assert "emotion_ferplus: [3/5] exporting to ONNX" in r.stdout, r.stdout
    assert "built zoo model emotion_ferplus in" in r.stdout, r.stdout


# -- item 9: an example's progress bar in a pipe -------------------------------------------

def test_finetune_example_draws_no_bar_into_a_pipe(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("sklearn")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_digits.py"),
                        "--epochs", "1", "--out", str(tmp_path / "t.onnx")],
                       capture_output=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr.decode()[-2000:]
    assert b"\r" not in r.stderr and b"\r" not in r.stdout


# -- issue 39 item 15: readback on the NumPy backend ---------------------------------------

def test_readback_on_numpy_needs_no_torch():
    pytest.importorskip("onnxruntime")
    r = _py("import sys; sys.modules['torch'] = None\nimport numpy as np, kiln\n"
            f"s = kiln.InferenceSession({DIGITS!r}, backend='numpy')\n"
            f"x = np.load({str(Path(DIGITS).parent / 'digits_test.npz')!r})['images'][:5]\n"
            "(y,) = s.run_async(None, {'image': x}).readback().result()\n"
            "print(type(y).__name__, repr(y.tolist()))\n")
    assert r.returncode == 0, r.stderr[-2000:]
    kind, values = r.stdout.split(" ", 1)
    assert kind == "ndarray"
    np.testing.assert_allclose(np.array(eval(values), np.float32),
                               _ort_logits(DIGITS, IMAGES[:5]), rtol=1e-4, atol=1e-4)


# -- issue 39 item 16: the CLI checks what it is given -------------------------------------

@pytest.mark.parametrize("args, says", [
    (["--batch", "-3"], "at least 1 or a name"),
    (["--tail", "topk", "--k", "1000000"], "k <= 10"),
    (["--append", DIGITS, "--io-map", "logits=image"], "which takes (batch, 1, 8, 8)"),
])
def test_edit_refuses_what_would_make_a_broken_model(tmp_path, args, says):
    r, _ = _kiln("edit", DIGITS, "-o", "e.onnx", *args, cwd=tmp_path)
    assert r.returncode == 1 and says in r.stderr, r.stderr
    assert not (tmp_path / "e.onnx").exists()


def test_topk_within_the_output_size_runs_as_onnxruntime_does(tmp_path):
    r, _ = _kiln("edit", DIGITS, "-o", "e.onnx", "--tail", "topk", "--k", "10",
                 cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(str(tmp_path / "e.onnx"), providers=["CPUExecutionProvider"])
    values, _ = sess.run(None, {"image": IMAGES[:3]})
    np.testing.assert_allclose(values, -np.sort(-_ort_logits(DIGITS, IMAGES[:3]), 1),
                               atol=1e-5)


@pytest.mark.parametrize("cmd", [["convert", "--fp16", "--block"],
                                 ["quantize", "--mode", "dynamic", "--exclude"]])
def test_unknown_block_or_exclude_names_are_refused(tmp_path, cmd):
    r, _ = _kiln(cmd[0], DIGITS, "-o", "o.onnx", *cmd[1:], "Gem", cwd=tmp_path)
    assert r.returncode == 1 and "did you mean Gemm" in r.stderr, r.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_run_output_writes_the_file_it_names(tmp_path):
    r, _ = _kiln("run", DIGITS, "--random", "--output", "X", cwd=tmp_path)
    assert r.returncode == 0 and "saved 1 output(s) to X" in r.stdout, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["X"]
    with np.load(tmp_path / "X") as z:
        assert z["logits"].shape == (1, 10)


@pytest.mark.parametrize("args, says", [
    (["--input", "nothing/*.parquet"], "no file matches"),
    (["--input", "x.npy", "--address", "not-an-address:xx"], "HOST:PORT"),
    (["--input", "x.npy", "--output", "no/such/out"], "does not exist"),
])
def test_batch_checks_before_starting_ray(tmp_path, args, says):
    pytest.importorskip("ray")
    np.save(tmp_path / "x.npy", IMAGES[:4])
    out = [] if "--output" in args else ["--output", "out"]
    r, seconds = _kiln("batch", DIGITS, *args, *out, cwd=tmp_path)
    assert r.returncode == 1 and says in r.stderr, r.stderr
    assert "internal error" not in r.stderr
    assert seconds < 20, seconds  # a Ray start alone is 30+ s here


def test_static_quantize_without_data_says_which_flag_in_one_line(tmp_path):
    r, _ = _kiln("quantize", DIGITS, "-o", "q.onnx", cwd=tmp_path)
    assert r.returncode == 1 and "--calibration DATA.npz" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr  # checked before any stage
    assert not (tmp_path / "q.onnx").exists()


def test_quantize_flags_for_smoothquant_and_bias_correction(tmp_path):
    """``--smooth-alpha`` and ``--no-bias-correction`` reach kiln.quantize: the report
    lists the smoothed layers, and says bias correction ran only when it was on; a strength
    outside 0..1 is refused by the parser with the choices."""
    np.savez(tmp_path / "calib.npz", image=IMAGES[:32])
    base = ("quantize", DIGITS, "--calibration", "calib.npz", "--backend", "numpy")
    r, _ = _kiln(*base, "-o", "a.onnx", "--smooth-alpha", "0.5", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "SmoothQuant migration:" in r.stdout and "bias correction:" in r.stdout, r.stdout
    r, _ = _kiln(*base, "-o", "b.onnx", "--no-bias-correction", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "bias correction" not in r.stdout and "SmoothQuant" not in r.stdout, r.stdout
    r, _ = _kiln(*base, "-o", "c.onnx", "--smooth-alpha", "2", cwd=tmp_path)
    assert r.returncode == 2 and "auto, off or a strength in 0..1" in r.stderr, r.stderr
