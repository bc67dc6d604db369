"""Asynchronous runs: ``session.run_async`` queues a run and returns a handle at once.

Runs execute in submission order on one worker per session (several may be in flight).
On CUDA the worker issues the run's kernels on a stream of its own, ordered after the
caller's stream at submission, and an event marks completion, so ``done()`` polls without
blocking and outputs read back to host through pinned memory without stalling the device
(Sentis's ReadbackRequest / CompleteOperationsAndDownload).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any


class AsyncRun:
    """Handle on a queued run. ``done()`` polls, ``result()`` blocks and returns the outputs
    (NumPy arrays, or device tensors for ``output_type="torch"``), ``readback()`` starts a
    non-blocking copy of device outputs to host and returns a handle on the NumPy values."""

    def __init__(self, future: Future, event_of: Callable[[], Any] | None = None):
        self._future = future
        self._event_of = event_of  # the run's CUDA completion event, once issued

    def done(self) -> bool:
        """True once the outputs are ready (never blocks)."""
        if not self._future.done():
            return False
        if self._future.exception() is not None:
            return True
        ev = self._event(block=False)
        return ev is None or ev.query()

    def result(self, timeout: float | None = None) -> list:
        """The outputs, waiting for them (re-raises the run's error)."""
        values = self._future.result(timeout)
        ev = self._event(block=True)
        if ev is not None:
            ev.synchronize()
            _used_by_caller(values)
        return values

    def exception(self, timeout: float | None = None):
        return self._future.exception(timeout)

    def readback(self) -> AsyncRun:
        """A handle whose result is these outputs as NumPy arrays, copied device -> host
        without blocking this thread (through pinned buffers on CUDA)."""
        out: Future = Future()
        state: dict[str, Any] = {}

        def start(f: Future) -> None:
            try:
                values = f.result()
                # Outputs are torch tensors only where torch was imported to make them: a
                # NumPy session's readback must not import it (an ImportError without
                # torch, seconds with it).
                torch = sys.modules.get("torch")
                if torch is None:
                    out.set_result(list(values))
                    return
                from kiln.ops.torch.arrays import to_numpy

                ev = self._event(block=True)
                host, events = [], []
                for v in values:
                    if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                        stream = torch.cuda.Stream(device=v.device)
                        if ev is not None:
                            stream.wait_event(ev)
                        with torch.cuda.stream(stream):
                            buf = torch.empty(v.shape, dtype=v.dtype, pin_memory=True)
                            buf.copy_(v, non_blocking=True)
                            done = torch.cuda.Event()
                            done.record(stream)
                        host.append(buf)
                        events.append(done)
                    else:
                        host.append(v)
                state["events"] = events
                out.set_result([to_numpy(h) if isinstance(h, torch.Tensor) else h
                                for h in host])
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                out.set_exception(e)

        self._future.add_done_callback(start)

        class _Readback(AsyncRun):
            def _event(self, block: bool):
                evs = state.get("events") or []
                if not evs:
                    return None
                return _AllEvents(evs)

        return _Readback(out)

    def _event(self, block: bool):
        if self._event_of is None:
            return None
        return self._event_of()


def _used_by_caller(values: list) -> None:
    """Tell the CUDA caching allocator that the caller's stream now uses these outputs
    (made on the worker's stream), so their memory is not reused under it."""
    import torch

    for v in values:
        if isinstance(v, torch.Tensor) and v.is_cuda:
            v.record_stream(torch.cuda.current_stream(v.device))


class _AllEvents:
    def __init__(self, events):
        self.events = events

    def query(self) -> bool:
        return all(e.query() for e in self.events)

    def synchronize(self) -> None:
        for e in self.events:
            e.synchronize()


class AsyncRunner:
    """One worker thread per session: runs queued jobs in order."""

    def __init__(self, backend):
        self.backend = backend
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._stream = None

    def submit(self, job: Callable[[], list]) -> AsyncRun:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-async")
        be = self.backend
        if getattr(be, "is_cuda", False):
            return self._submit_cuda(job)
        return AsyncRun(self._pool.submit(job))

    def _submit_cuda(self, job: Callable[[], list]) -> AsyncRun:
        import torch


        dev = self.backend.tdevice
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=dev)
        stream = self._stream
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(dev))  # feeds made on the caller's stream
        box: dict[str, Any] = {}

        def run() -> list:
            stream.wait_event(ready)
            with torch.cuda.device(dev), torch.cuda.stream(stream):
                values = job()
                ev = torch.cuda.Event()
                ev.record(stream)
            box["event"] = ev
            return values

        return AsyncRun(self._pool.submit(run), lambda: box.get("event"))

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
