"""Default thread counts that follow the machine's load.

OpenMP (torch) and OpenBLAS (NumPy) split an op's work evenly between their threads and
wait for the slowest. When other processes keep the cores busy, one of those threads is
often not running, and the op waits for it: on a 2-core machine at load 10, a 128x1024 @
1024x256 matmul took 77 ms with 2 OpenBLAS threads and 4.5 ms with one, and GPT-2 on the
torch backend 564 ms against 127 ms. onnxruntime's pool lets the caller take over work a
descheduled worker has not started, so it loses far less (1.1-1.5x).

So a session left at its default threads asks, before a run and at most every
``PERIOD`` seconds, how many threads other processes are running right now, smooths that
over a few samples, and uses the cores they leave free (at least one). Explicit
``threads=`` are never changed.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

PERIOD = 1.0
"""Seconds between samples of the machine's load (a sample reads /proc: 0.1-1 ms)."""


def running_elsewhere() -> int | None:
    """Threads running or runnable on the machine now, besides this process's own
    (None where /proc does not say)."""
    try:
        total = int(Path("/proc/loadavg").read_text().split()[3].partition("/")[0])
        own = 0
        for task in Path("/proc/self/task").iterdir():
            stat = (task / "stat").read_text()
            own += stat[stat.rindex(")") + 2] == "R"
    except (OSError, ValueError, IndexError):
        return None
    return max(0, total - own)


class LoadGovernor:
    """Sets ``apply(n)`` threads, n = ``cores`` less those other processes keep busy; call
    it before each run."""

    def __init__(self, cores: int, apply: Callable[[int], None]):
        self.cores, self.apply = cores, apply
        self.threads = cores
        self.busy = 0.0
        self.next_sample = 0.0

    def __call__(self) -> None:
        now = time.monotonic()
        if now < self.next_sample:
            return
        self.next_sample = now + PERIOD
        seen = running_elsewhere()
        if seen is None:
            return
        self.busy = 0.5 * self.busy + 0.5 * seen  # one busy instant is not a busy machine
        want = max(1, self.cores - int(self.busy + 0.5))
        if want != self.threads:
            self.threads = want
            self.apply(want)


def governor(cores: int, apply: Callable[[int], None]) -> LoadGovernor | None:
    """A governor for default threads (None when turned off with KILN_THREADS_FOLLOW_LOAD=0
    or on a single core, where there is nothing to give up)."""
    if cores < 2 or os.environ.get("KILN_THREADS_FOLLOW_LOAD", "1").strip() in ("0", "off"):
        return None
    return LoadGovernor(cores, apply)
