"""Dynamic batching: requests for one model wait in a bounded queue; one worker takes the
first and every queued request with the same per-row shapes (up to the max batch size,
waiting at most the batching window for more), runs them as one batch along dim 0 and
hands each its rows back. Runs happen on the model's own thread so the event loop keeps
accepting requests meanwhile."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import KilnError

RunFn = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


@dataclass
class Execution:
    """One run of the model, as the statistics and metrics count it."""

    rows: int  # the batch size: rows of all its requests together
    waits: list[float]  # seconds each of its requests waited in the queue
    input_s: float  # joining the requests' inputs into one batch (0 for one request)
    infer_s: float  # the model's run
    output_s: float  # splitting the outputs back into each request's rows
    failed: int = 0  # its requests whose run failed


# (model, the run)
Observer = Callable[[str, Execution], None]


# Without a batching window, a request that finds its model idle runs in the event loop
# itself when the model's last single run took less than this: the hop to the model's
# thread and back costs more than such a run (two thread wake-ups, slow on a busy
# machine), and blocking the loop this long delays the others less than the hop would.
INLINE_S = 0.002


class Overloaded(KilnError):
    """The model's queue is full: retry after a moment (HTTP 503, gRPC UNAVAILABLE)."""


@dataclass
class _Request:
    feed: dict[str, np.ndarray]
    future: asyncio.Future
    key: tuple | None  # requests with equal keys can share a batch; None: never
    rows: int
    queued: float = field(default_factory=time.perf_counter)


def _key(feed: dict[str, np.ndarray]) -> tuple[tuple | None, int]:
    rows = {a.shape[0] if a.ndim else -1 for a in feed.values()}
    if len(rows) != 1 or -1 in rows or any(a.dtype == object for a in feed.values()):
        return None, 1
    key = tuple(sorted((n, a.dtype.str, a.shape[1:]) for n, a in feed.items()))
    return key, rows.pop()


class Batcher:
    """The queue and worker of one model. ``max_batch`` <= 1 runs every request alone."""

    def __init__(self, name: str, run: RunFn, max_batch: int, window_s: float, max_queue: int):
        self.name, self._run = name, run
        self.max_batch, self.window, self.max_queue = max_batch, window_s, max_queue
        self._waiting: collections.deque[_Request] = collections.deque()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kiln-serve-{name}")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._closed = False
        self._worker_idle = True
        self._recent_s = float("inf")  # a recent single run's seconds (for INLINE_S)
        self.observers: list[Observer] = []  # told of every run, in the event loop

    @property
    def queued(self) -> int:
        """Requests waiting for a run."""
        return len(self._waiting)

    async def submit(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Queue ``feed`` and return its outputs once its batch has run."""
        if self._closed:
            raise Overloaded(f"model {self.name!r} is being unloaded; retry")
        if len(self._waiting) >= self.max_queue:
            raise Overloaded(
                f"model {self.name!r} has {len(self._waiting)} requests queued "
                "(its limit); retry after a moment"
            )
        if self._worker is None:
            self._loop = asyncio.get_running_loop()
            self._wake = asyncio.Event()
            self._worker = self._loop.create_task(self._work())
        if (
            self._worker_idle
            and not self._waiting
            and self._recent_s < INLINE_S
            and self.window == 0
        ):
            return self._run_inline(feed)
        key, rows = _key(feed)
        req = _Request(feed, self._loop.create_future(), key, rows)
        self._waiting.append(req)
        self._wake.set()
        return await req.future

    def close(self) -> None:
        """Take no new requests; the worker finishes those queued, then stops. Safe to
        call from any thread."""
        self._closed = True
        if self._loop is None:
            self._pool.shutdown(wait=False)
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _work(self) -> None:
        while True:
            while not self._waiting:
                if self._closed:
                    self._pool.shutdown(wait=False)
                    return
                self._wake.clear()
                await self._wake.wait()
            first = self._waiting[0]
            if self.max_batch > 1 and self.window > 0 and first.key is not None:
                deadline = first.queued + self.window
                while self._rows_like(first) < self.max_batch:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self._wake.clear()
                    try:
                        await asyncio.wait_for(self._wake.wait(), left)
                    except asyncio.TimeoutError:
                        break
            await self._execute(self._take(first))

    def _rows_like(self, first: _Request) -> int:
        return sum(r.rows for r in self._waiting if r.key == first.key)

    def _take(self, first: _Request) -> list[_Request]:
        batch, rows, keep = [], 0, collections.deque()
        for r in self._waiting:
            fits = r is first or (
                self.max_batch > 1
                and first.key is not None
                and r.key == first.key
                and rows + r.rows <= self.max_batch
            )
            if fits:
                batch.append(r)
                rows += r.rows
            else:
                keep.append(r)
        self._waiting = keep
        return batch

    def _observe(self, run: Execution) -> None:
        for observe in self.observers:
            observe(self.name, run)

    def _run_inline(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        start = time.perf_counter()
        failed = 1
        try:
            outs = self._run(feed)
            failed = 0
            return outs
        finally:
            took = time.perf_counter() - start
            self._recent_s = took
            # counted once the response has left: call_soon runs before the loop reads the
            # next request, so a client asking for the statistics next still sees this run
            self._loop.call_soon(self._observe_inline, feed, took, failed)

    def _observe_inline(self, feed: dict[str, np.ndarray], took: float, failed: int) -> None:
        self._observe(Execution(_key(feed)[1], [0.0], 0.0, took, 0.0, failed))

    async def _execute(self, batch: list[_Request]) -> None:
        self._worker_idle = False
        start = time.perf_counter()
        waits = [start - r.queued for r in batch]
        loop = asyncio.get_running_loop()
        try:
            results, run = await loop.run_in_executor(self._pool, self._run_batch, batch)
        except Exception as e:  # noqa: BLE001 - every request of the batch hears of it
            results = [e] * len(batch)
            run = Execution(sum(r.rows for r in batch), [], 0.0, 0.0, 0.0, len(batch))
        run.waits = waits
        self._worker_idle = True
        if len(batch) == 1:
            # the run alone, timed on the model's thread: timing the hops as well would
            # keep a fast model off the inline path once one busy moment made them slow
            self._recent_s = run.input_s + run.infer_s + run.output_s
        self._observe(run)
        for r, res in zip(batch, results):
            if r.future.done():  # the client went away
                continue
            if isinstance(res, BaseException):
                r.future.set_exception(res)
            else:
                r.future.set_result(res)

    def _run_batch(self, batch: list[_Request]) -> tuple[list, Execution]:
        """Each request's outputs (or its exception) and the run's timings; on the
        model's thread."""
        total = sum(r.rows for r in batch)
        t0 = time.perf_counter()
        if len(batch) == 1:
            results = [self._run_alone(batch[0].feed)]
            t1 = time.perf_counter()
            failed = int(isinstance(results[0], Exception))
            return results, Execution(total, [], 0.0, t1 - t0, 0.0, failed)
        names = list(batch[0].feed)
        merged = {n: np.concatenate([r.feed[n] for r in batch]) for n in names}
        t1 = time.perf_counter()
        try:
            outs = self._run(merged)
        except Exception:  # noqa: BLE001 - one bad request must not fail the others
            outs = None
        t2 = time.perf_counter()
        if outs is None or any(o.ndim == 0 or o.shape[0] != total for o in outs):
            # the run failed, or an output is not per-row: run each request alone
            results = [self._run_alone(r.feed) for r in batch]
            failed = sum(isinstance(x, Exception) for x in results)
            took = time.perf_counter() - t0
            return results, Execution(total, [], 0.0, took, 0.0, failed)
        bounds = np.cumsum([0] + [r.rows for r in batch])
        results = [[o[bounds[i] : bounds[i + 1]] for o in outs] for i in range(len(batch))]
        t3 = time.perf_counter()
        return results, Execution(total, [], t1 - t0, t2 - t1, t3 - t2)

    def _run_alone(self, feed: dict[str, np.ndarray]) -> list[np.ndarray] | Exception:
        try:
            return self._run(feed)
        except Exception as e:  # noqa: BLE001 - handed to its request
            return e
