"""``kiln.bench``: latency percentiles and throughput, optionally side by side with
onnxruntime (alternating runs in one process, same thread count)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from time import perf_counter, sleep
from typing import Any

import numpy as np

from kiln.errors import KilnError, MissingDependencyError
from kiln.tools.common import (
    load_model,
    model_name,
    onnx_source,
    random_feeds,
    session_for,
)
from kiln.tools.progress import progress_bar

__all__ = ["BLAS_REST_S", "SWITCH_REST_S", "BenchResult", "Stats", "SwitchRest", "bench",
           "default_threads", "progress_bar", "spin_rest"]


@dataclass
class Stats:
    """Latencies (ms) of one engine's measured runs."""

    engine: str
    latencies_ms: list[float] = field(default_factory=list)
    batch: int = 1

    def pct(self, q: float) -> float:
        """The ``q``-th percentile latency in ms (0 when nothing was measured)."""
        return float(np.percentile(self.latencies_ms, q)) if self.latencies_ms else 0.0

    @property
    def p50(self) -> float:
        return self.pct(50)

    @property
    def p90(self) -> float:
        return self.pct(90)

    @property
    def p99(self) -> float:
        return self.pct(99)

    @property
    def mean(self) -> float:
        return float(np.mean(self.latencies_ms)) if self.latencies_ms else 0.0

    @property
    def throughput(self) -> float:
        """Samples per second (batch items, not runs) at the mean latency."""
        return self.batch * 1e3 / self.mean if self.mean > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        """Percentiles, mean, min and throughput as plain numbers."""
        return {"engine": self.engine, "runs": len(self.latencies_ms), "p50_ms": self.p50,
                "p90_ms": self.p90, "p99_ms": self.p99, "mean_ms": self.mean,
                "min_ms": min(self.latencies_ms, default=0.0),
                "throughput_per_s": self.throughput}


@dataclass
class BenchResult:
    """Kiln's numbers and, with ``vs``, the other engine's measured alongside."""

    model: str
    backend: str
    device: str
    batch: int
    threads: int
    warmup: int
    kiln: Stats
    other: Stats | None = None
    precision: str = "fp32"
    compile_status: str = ""
    """With ``compile``: the session's word on it ("yes: ...", or why runs were eager)."""

    @property
    def ratio(self) -> float | None:
        """Kiln's p50 / the other engine's p50 (None without ``vs``): below 1 means Kiln
        is faster. Always Kiln / other, as in docs/performance.md."""
        if self.other is None or self.other.p50 <= 0:
            return None
        return self.kiln.p50 / self.other.p50

    def comparison(self) -> str | None:
        """The ratio in words: ``Kiln takes R.RRx as long as onnxruntime at p50`` or
        ``Kiln is R.RRx faster than onnxruntime at p50`` (None without ``vs``)."""
        r = self.ratio
        if r is None or self.other is None:
            return None
        if r > 1:
            words = f"Kiln takes {r:.2f}x as long as {self.other.engine}"
        elif r < 1:
            words = f"Kiln is {1 / r:.2f}x faster than {self.other.engine}" if r > 0 else \
                f"Kiln is faster than {self.other.engine}"
        else:
            words = f"Kiln takes as long as {self.other.engine}"
        return f"{words} at p50 (Kiln / {self.other.engine} = {r:.3f})"

    def to_dict(self) -> dict[str, Any]:
        """The ``--json`` form; ``ratio`` is Kiln / other (null without ``vs``)."""
        return {"model": self.model, "backend": self.backend, "device": self.device,
                "precision": self.precision, "compile_status": self.compile_status or None,
                "batch": self.batch, "threads": self.threads, "warmup": self.warmup,
                "kiln": self.kiln.to_dict(),
                "other": None if self.other is None else self.other.to_dict(),
                "ratio": self.ratio, "comparison": self.comparison()}


SWITCH_REST_S = 0.05
"""Seconds of rest before a run when another engine ran last (docs/performance.md,
"onnxruntime's spinning threads slow whatever runs right after it")."""

BLAS_REST_S = 0.2
"""The rest after a run of Kiln's NumPy backend: OpenBLAS's workers spin longer than
onnxruntime's, and :data:`SWITCH_REST_S` after them still left a two-thread torch run
slowed (docs/performance.md, "Rests between engines and candidates")."""


def spin_rest(backend: str | None) -> float:
    """How long the thread pool of a run on ``backend`` may keep spinning after it."""
    return BLAS_REST_S if backend == "numpy" else SWITCH_REST_S


class SwitchRest:
    """Rests before a run whenever what runs now is not what ran last: an engine's worker
    threads keep spinning on the cores for tens of ms after its run, and a run started in
    that window measures the contention, not the engine. One alternation rule, shared by
    ``kiln bench --vs``, ``kiln tune`` and benchmarks/tune.py."""

    def __init__(self) -> None:
        self.last: Any = None
        self.after = 0.0
        self.rests = 0
        """How many times it rested (what a test of the rule reads)."""

    def __call__(self, now: Any, spins: float = SWITCH_REST_S) -> None:
        """Before running ``now`` (a key naming the engine or thread pool), whose threads
        may spin ``spins`` seconds after its run."""
        if self.last is not None and self.last != now:
            sleep(self.after)
            self.rests += 1
        self.last, self.after = now, spins


def default_threads() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _ort_session(model: Any, threads: int, device: str):
    try:
        import onnxruntime as ort
    except ImportError:
        # Just the one package: the zoo extra would also pull in PyTorch.
        raise MissingDependencyError("onnxruntime", "pip install onnxruntime",
                                     "--vs onnxruntime") from None
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise KilnError("onnxruntime here has no CUDA provider; compare on the CPU")
        providers.insert(0, "CUDAExecutionProvider")
    try:
        return ort.InferenceSession(onnx_source(model), so, providers=providers)
    except Exception as e:  # ORT's own exception types
        raise KilnError(f"onnxruntime cannot load the model: {e}") from None


def _thread_limit(threads: int):
    """Caps NumPy's BLAS threads (threadpoolctl when installed)."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        import contextlib
        return contextlib.nullcontext()
    return threadpool_limits(limits=threads)


def bench(model: Any, backend: str | None = None, device: str | None = None,
          feeds: dict | None = None, runs: int = 50, warmup: int = 5, batch: int | None = None,
          threads: int | None = None, vs: str | None = None,
          dims: dict[str, int] | None = None, optimize: bool = True,
          progress: bool | None = None, precision: str | None = None,
          compile: bool = False,
          on_run: Callable[[int, int], None] | None = None) -> BenchResult:
    """Time ``runs`` runs of ``model`` (after ``warmup``) on ``backend`` (None: the one
    the file stores from ``kiln tune``, else the default backend, as a session given none).

    ``precision`` and ``compile`` are the torch backend's session options; a compiled
    session builds its program in the first warm-up run, so keep ``warmup`` at 1 or more.

    ``feeds`` default to random inputs of the declared shapes, the first dim set to
    ``batch`` when symbolic, other symbolic dims from ``dims`` (default 1). ``threads``
    (default: all cores) caps Kiln's threads and, with ``vs="onnxruntime"``, ORT's intra-op
    threads; then both run alternately (order swapped every iteration) on the same feeds,
    with a rest whenever the engine changes (:class:`SwitchRest`).
    ``progress``: a bar on stderr; None (default) draws it only when stderr is a terminal,
    so logs and pipes stay clean. ``on_run(done, total)`` is called after each round
    (warm-up included), for progress output of the caller's own.
    """
    if vs not in (None, "onnxruntime", "ort"):
        raise KilnError(f"--vs {vs!r}: only 'onnxruntime' can be compared against")
    threads = threads or default_threads()
    m = load_model(model)
    sess = session_for(m, backend, device, threads=threads, optimize=optimize,
                       precision=precision, compile=compile)
    if feeds is None:
        feeds = random_feeds(m, dims, batch=batch)
    first = next(iter(feeds.values()), None)
    n_batch = batch or (int(first.shape[0]) if getattr(first, "ndim", 0) else 1)
    dev = getattr(sess.backend, "device", "cpu")
    ort_sess = _ort_session(model, threads, dev) if vs else None
    ours, theirs = Stats("kiln", batch=n_batch), Stats("onnxruntime", batch=n_batch)
    engines = [(ours, lambda: sess.run(None, feeds))]
    if ort_sess is not None:
        engines.append((theirs, lambda: ort_sess.run(None, feeds)))
    bar = progress_bar(warmup + runs, f"bench {model_name(model)}", progress)
    rest = SwitchRest()
    spins = {"kiln": spin_rest(sess.backend.name)}
    with _thread_limit(threads):
        for i in range(warmup + runs):
            order = engines if i % 2 == 0 else engines[::-1]
            for st, fn in order:
                rest(st.engine, spins.get(st.engine, SWITCH_REST_S))
                t0 = perf_counter()
                fn()
                dt = (perf_counter() - t0) * 1e3
                if i >= warmup:
                    st.latencies_ms.append(dt)
            if bar is not None:
                bar.update(1)
            if on_run is not None:
                on_run(i + 1, warmup + runs)
    if bar is not None:
        bar.close()
    status = ""
    if compile:
        rep = sess.placement()
        status = rep.compiled if rep.last_run is not None and rep.last_run.compiled else \
            f"no: the measured runs ran eagerly ({rep.compiled})"
    return BenchResult(model_name(model), sess.backend.name, dev, n_batch, threads, warmup, ours,
                       theirs if ort_sess is not None else None, precision or "fp32", status)
