"""Rows per second of Kiln batch inference on Ray Data (1 and 2 actors) against a plain
single-process loop over the same rows, and the per-batch overhead Ray adds.

    python benchmarks/ray_batch.py [--rows 10000] [--repeats 2]

Model: the shipped digits CNN (src/kiln/data/digits_cnn.onnx), input (N, 1, 8, 8) float32,
NumPy backend, one thread per actor and one BLAS thread in the plain loop. Every Ray job
starts its actors afresh (seconds), so besides the whole job's rate the steady rate is
taken from the first actor being ready (stamped by the actor) to the end of the job, and
Ray's per-batch overhead is the actors' time in that window not spent inside
``KilnPredictor.__call__``, per batch. The plain loop's own per-batch cost (Kiln's
per-run overhead) is the difference in time per row between batches of 64 and 1024 rows
divided by the difference in batches per row. Best of ``repeats`` per figure (a shared
machine).
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

import numpy as np
import pyarrow as pa
import ray
from ray.data.extensions import ArrowTensorArray
from threadpoolctl import threadpool_limits

import kiln
from kiln.integrations import ray as kr

MODEL = str(resources.files("kiln") / "data" / "digits_cnn.onnx")


def plain_seconds(images: np.ndarray, batch: int) -> float:
    """One session in this process, run over ``images`` ``batch`` rows at a time."""
    sess = kiln.InferenceSession(MODEL)
    sess.run(None, {"image": images[:batch]})
    with threadpool_limits(1):
        t0 = time.perf_counter()
        for i in range(0, len(images), batch):
            sess.run(None, {"image": images[i:i + batch]})
        return time.perf_counter() - t0


class TimedPredictor(kr.KilnPredictor):
    """KilnPredictor that stamps each batch with when its actor was ready and how long
    the batch took inside ``__call__`` (monotonic clock: the same across processes of
    one machine)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ready = time.monotonic()

    def __call__(self, batch):
        t0 = time.monotonic()
        out = super().__call__(batch)
        n = len(out["logits"])
        out["ready"] = np.full(n, self.ready)
        out["call_s"] = np.full(n, (time.monotonic() - t0) / n)  # per row: sums per batch
        return out


def ray_rates(ref, images: np.ndarray, batch: int, actors: int) -> tuple[float, float, float]:
    """A Ray Data job scoring ``images`` with ``actors`` actors: (whole-job rows/s, steady
    rows/s from the first actor being ready to the end, Ray's time per batch outside
    ``__call__`` in ms). The job includes starting the actors (seconds, very noisy on a
    loaded machine). Blocks of 4 batches so every actor gets work."""
    block = 4 * batch
    ds = ray.data.from_arrow([pa.table({"image": ArrowTensorArray.from_numpy(images[i:i + block])})
                              for i in range(0, len(images), block)]).materialize()
    t0 = time.monotonic()
    out = ds.map_batches(TimedPredictor, fn_constructor_kwargs={"model": ref},
                         batch_format="numpy", batch_size=batch, num_cpus=1,
                         compute=ray.data.ActorPoolStrategy(size=actors)).to_pandas()
    t_end = time.monotonic()
    assert len(out) == len(images)
    window = t_end - out["ready"].min()
    batches = len(images) / batch
    outside = (window * actors - out["call_s"].sum()) / batches
    return len(images) / (t_end - t0), len(images) / window, 1e3 * outside


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=40_000)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="write the figures here too")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    n = args.rows
    images = rng.random((n, 1, 8, 8), dtype=np.float32)
    ray.init(num_cpus=2, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ref = kr.share_model(MODEL)
    small, large = 64, 1024

    def best(fn, *a) -> float:
        return min(fn(*a) for _ in range(args.repeats))

    fig: dict[str, float] = {}
    for b in (small, large):
        fig[f"plain_b{b}_rows_per_s"] = n / best(plain_seconds, images, b)
    for actors, batches in ((1, (small, large)), (2, (large,))):
        for b in batches:
            runs = [ray_rates(ref, images, b, actors) for _ in range(args.repeats)]
            fig[f"ray{actors}_b{b}_job_rows_per_s"] = max(r[0] for r in runs)
            fig[f"ray{actors}_b{b}_steady_rows_per_s"] = max(r[1] for r in runs)
            fig[f"ray{actors}_b{b}_outside_call_ms_per_batch"] = min(r[2] for r in runs)
    # the plain loop's own cost per batch (Kiln's per-run overhead) and per row
    per_row = {b: 1 / fig[f"plain_b{b}_rows_per_s"] for b in (small, large)}
    fig["plain_per_batch_ms"] = 1e3 * (per_row[small] - per_row[large]) / (1 / small - 1 / large)
    fig["plain_compute_per_row_us"] = 1e6 * (per_row[large] - fig["plain_per_batch_ms"] / 1e3
                                             / large)
    for k, v in fig.items():
        print(f"{k:32s} {v:12.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(fig, f, indent=2)
    ray.shutdown()


if __name__ == "__main__":
    main()
