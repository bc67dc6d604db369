"""Batch inference on Ray Data (kiln.integrations.ray) on a real two-node local cluster:
every row scored exactly once and exactly as a single-process Kiln session scores it,
work on both nodes, a killed actor process recovered from, and ``kiln batch`` end to end.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from importlib import resources

import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="ray is not installed: pip install -e '.[ray]'")
pytest.importorskip("ray.data", reason="ray[data] is not installed: pip install -e '.[ray]'")

import pyarrow as pa  # noqa: E402  (installed with ray[data])
from ray.cluster_utils import Cluster  # noqa: E402
from ray.data.extensions import ArrowTensorArray  # noqa: E402

import kiln  # noqa: E402
from kiln.cli.main import main  # noqa: E402
from kiln.errors import MissingDependencyError, OptionError  # noqa: E402
from kiln.integrations import ray as kr  # noqa: E402

pytestmark = pytest.mark.ray

MODEL = str(resources.files("kiln") / "data" / "digits_cnn.onnx")
ROWS = 20_000


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each on this machine, the test process their driver."""
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    # workers cannot import this test module: send its classes and functions by value
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.data.DataContext.get_current().enable_progress_bars = False
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def digits() -> np.ndarray:
    """20,000 8x8 digits in the model's layout (N, 1, 8, 8), scaled to [0, 1]: sklearn's
    1,797 repeated with a little noise so no two rows are equal."""
    from sklearn.datasets import load_digits

    x = load_digits().images.astype(np.float32) / 16
    rng = np.random.default_rng(0)
    rows = x[np.arange(ROWS) % len(x)] + rng.normal(0, 0.05, (ROWS, 8, 8)).astype(np.float32)
    return np.clip(rows, 0, 1)[:, None]


BATCH = 500


@pytest.fixture(scope="module")
def reference(digits) -> np.ndarray:
    """Logits of one plain Kiln session in this process, run BATCH rows at a time as Ray
    does (BLAS blocking makes results depend on the batch's row count at the 1e-6 level,
    so equal batches give bit-identical rows), one BLAS thread like each actor; checked
    against onnxruntime on the first thousand rows."""
    from threadpoolctl import threadpool_limits

    sess = kiln.InferenceSession(MODEL)
    with threadpool_limits(1):
        ref = np.concatenate([sess.run(None, {"image": digits[i:i + BATCH]})[0]
                              for i in range(0, len(digits), BATCH)])
    ort = pytest.importorskip("onnxruntime")
    ort_logits = ort.InferenceSession(MODEL).run(None, {"image": digits[:1000]})[0]
    np.testing.assert_allclose(ref[:1000], ort_logits, rtol=1e-4, atol=1e-4)
    return ref


def dataset(images: np.ndarray, block: int):
    """A dataset of ``id`` and ``image`` columns in blocks of ``block`` rows (several
    blocks, so several actors get work)."""
    ids = np.arange(len(images))
    return ray.data.from_arrow([
        pa.table({"id": ids[i:i + block],
                  "image": ArrowTensorArray.from_numpy(images[i:i + block])})
        for i in range(0, len(images), block)])


class WherePredictor(kr.KilnPredictor):
    """KilnPredictor that also says which node and process scored each row (and, with
    ``pause``, takes its time per batch so a kill lands mid-job)."""

    def __init__(self, *args, pause: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.pause = pause

    def __call__(self, batch):
        out = super().__call__(batch)
        n = len(out["id"])
        out["node"] = np.array([ray.get_runtime_context().get_node_id()] * n)
        out["pid"] = np.full(n, os.getpid())
        time.sleep(self.pause)
        return out


def test_twenty_thousand_digits_on_two_nodes_match_one_process(cluster, digits, reference):
    model = kr.share_model(MODEL)
    ds = dataset(digits, 2 * BATCH).map_batches(
        WherePredictor, fn_constructor_kwargs={"model": model}, batch_format="numpy",
        batch_size=BATCH, concurrency=2, num_cpus=1)
    out = ds.to_pandas()

    ids = out["id"].to_numpy()
    assert np.array_equal(np.sort(ids), np.arange(ROWS))  # none lost, none twice
    logits = np.stack(out["logits"].to_numpy())[np.argsort(ids)]
    assert logits.shape == (ROWS, 10)
    assert np.array_equal(logits, reference)  # bit for bit, row by row
    nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    assert set(out["node"]) == nodes and len(nodes) == 2
    assert "image" not in out.columns  # inputs are consumed, other columns pass through


def test_killed_actor_is_restarted_and_every_row_scored_once(cluster, digits, reference):
    images = digits[:12 * BATCH]
    ds = dataset(images, BATCH).map_batches(
        WherePredictor, fn_constructor_kwargs={"model": kr.share_model(MODEL), "pause": 0.2},
        batch_format="numpy", batch_size=BATCH, concurrency=2, num_cpus=1)
    seen, killed, rows_at_kill = [], None, 0
    for b in ds.iter_batches(batch_size=None, batch_format="numpy"):
        seen.append(b)
        if killed is None:
            killed, rows_at_kill = int(b["pid"][0]), len(b["id"])
            os.kill(killed, signal.SIGKILL)
    assert rows_at_kill < len(images)  # the kill came while rows were still unscored
    with pytest.raises(ProcessLookupError):
        os.kill(killed, 0)
    ids = np.concatenate([b["id"] for b in seen])
    assert np.array_equal(np.sort(ids), np.arange(len(images)))
    logits = np.concatenate([b["logits"] for b in seen])[np.argsort(ids)]
    assert np.array_equal(logits, reference[:len(images)])
    pids = np.concatenate([b["pid"] for b in seen])
    # the batch in flight in the killed process was run again by its restarted actor
    assert len(set(pids.tolist()) - {killed}) >= 2


def test_threads_follow_the_cpus_ray_reserved(cluster):
    ref = kr.share_model(MODEL)

    @ray.remote(num_cpus=1)
    def torch_actor_threads():
        import torch

        p = kr.KilnPredictor(ref, backend="torch")
        return p.threads, torch.get_num_threads()

    assert ray.get(torch_actor_threads.remote()) == (1, 1)

    @ray.remote(num_cpus=1)
    def too_many():
        return kr.actor_threads(2)

    with pytest.raises(OptionError, match="num_cpus=2"):
        ray.get(too_many.remote())


def test_kiln_batch_cli_on_parquet_files(cluster, digits, tmp_path, capsys):
    import pandas as pd

    data, images = tmp_path / "data", digits[:3000]
    data.mkdir()
    for k in range(3):  # plain parquet: each image a list of 64 floats, as pandas writes it
        part = images[k * 1000:(k + 1) * 1000]
        pd.DataFrame({"id": np.arange(k * 1000, (k + 1) * 1000),
                      "image": list(part.reshape(len(part), 64))}).to_parquet(
            data / f"part{k}.parquet")
    out = tmp_path / "out"
    # in this process, which already drives the cluster: a second driver would need its
    # own worker processes, the slowest part of a run on this small machine
    code = main(["batch", MODEL, "--input", str(data / "*.parquet"), "--output", str(out),
                 "--address", cluster.address, "--concurrency", "2", "--batch-size", "250"])
    assert code == 0
    printed = capsys.readouterr()
    assert "scored 3000 rows from 3 file(s)" in printed.out
    # its stages on stderr, a line each (Ray already runs in this process: no start line)
    assert "kiln batch: [1] scoring 3 file(s) on 2 actor(s)" in printed.err, printed.err
    assert "kiln batch: done in" in printed.err, printed.err
    got = ray.data.read_parquet(str(out)).to_pandas()
    ids = got["id"].to_numpy()
    assert np.array_equal(np.sort(ids), np.arange(3000))
    logits = np.stack(got["logits"].to_numpy())[np.argsort(ids)]
    expected = kiln.InferenceSession(MODEL).run(None, {"image": images})[0]
    # batches here span files as Ray reads them: equal to BLAS rounding, same classes
    np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)
    assert np.array_equal(logits.argmax(1), expected.argmax(1))


def test_without_ray_the_error_names_the_extra():
    code = ("import sys; sys.modules['ray'] = None\n"
            "from kiln.integrations import ray as kr\n"
            "try:\n    kr.share_model('m.onnx')\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.stdout.startswith(MissingDependencyError.__name__), r.stdout + r.stderr
    assert 'pip install -e ".[ray]"' in r.stdout


def test_npz_and_npy_files_read_as_columns(cluster, digits, tmp_path):
    for k in range(2):
        np.savez(tmp_path / f"part{k}.npz", id=np.arange(k * 100, (k + 1) * 100),
                 image=digits[k * 100:(k + 1) * 100])
    got = kr.read_files([str(tmp_path / "*.npz")])[0].to_pandas().sort_values("id")
    assert np.array_equal(got["id"].to_numpy(), np.arange(200))
    assert np.array_equal(np.stack(got["image"].to_numpy()), digits[:200])

    np.save(tmp_path / "images.npy", digits[:50])
    ds, files = kr.read_files([str(tmp_path / "*.npy")], "image")
    assert files == 1
    assert np.array_equal(np.stack(ds.to_pandas()["image"].to_numpy()), digits[:50])
