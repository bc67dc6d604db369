"""With KILN_THREADS_FOLLOW_LOAD=1, default threads follow the machine's load: a session
made while other processes keep every core busy runs on one thread (OpenMP and OpenBLAS
threads waiting for a descheduled partner made runs several times slower than one thread)
and keeps that count from run to run; explicit threads are never changed; without the
opt-in, the load is ignored."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

import kiln
from kiln.runtime.backend import usable_cores
from kiln.runtime.threads import running_elsewhere

pytestmark = pytest.mark.skipif(running_elsewhere() is None or usable_cores() < 2,
                                reason="needs /proc and two usable cores")


def _burn() -> None:
    while True:
        pass


def _runs_for(sess, seconds: float, feed: dict) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sess.run(None, feed)


@pytest.fixture
def busy_machine(monkeypatch):
    monkeypatch.setenv("KILN_THREADS_FOLLOW_LOAD", "1")  # opt-in
    burners = [mp.get_context("fork").Process(target=_burn, daemon=True)
               for _ in range(usable_cores())]
    for b in burners:
        b.start()
    time.sleep(1.0)  # every burner scheduled and spinning
    yield
    for b in burners:
        b.terminate()
        b.join()


def test_default_threads_drop_to_one_on_a_busy_machine(mlp_model, busy_machine):
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        x = {"x": np.ones((2, 4), np.float32)}
        sess = kiln.InferenceSession(mlp_model, backend="torch")
        assert torch.get_num_threads() == 1
        _runs_for(sess, 0.5, x)
        assert torch.get_num_threads() == 1
        kiln.InferenceSession(mlp_model, backend="torch", threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_numpy_blas_threads_drop_to_one_on_a_busy_machine(mlp_model, busy_machine):
    from threadpoolctl import threadpool_info, threadpool_limits

    def numpy_blas() -> list[dict]:
        # NumPy's own BLAS only: SciPy loads a second OpenBLAS (once any test imports
        # scipy) that Kiln's kernels never call.
        return [p for p in threadpool_info() if p["user_api"] == "blas"
                and "numpy" in p["filepath"].replace("\\", "/").split("/site-packages/")[-1]]

    if not numpy_blas():
        pytest.skip("no NumPy BLAS library that threadpoolctl can control")
    with threadpool_limits(limits=usable_cores(), user_api="blas"):
        kiln.InferenceSession(mlp_model, backend="numpy")
        assert {p["num_threads"] for p in numpy_blas()} == {1}


def test_without_the_opt_in_default_threads_ignore_the_load(mlp_model, busy_machine,
                                                            monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.delenv("KILN_THREADS_FOLLOW_LOAD")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(usable_cores())
        kiln.InferenceSession(mlp_model, backend="torch")
        assert torch.get_num_threads() == usable_cores()
    finally:
        torch.set_num_threads(before)
