"""Default thread counts that follow the machine's load.

OpenMP (torch) and OpenBLAS (NumPy) split an op's work evenly between their threads and
wait for the slowest. When other processes keep the cores busy, one of those threads is
often not running, and the op waits for it: on a loaded 2-core machine a matmul or a
whole model on two threads took several times as long as on one. onnxruntime's pool lets
the caller take over work a descheduled worker has not started, so it loses far less
(measured in benchmarks/results/performance-history.md).

With KILN_THREADS_FOLLOW_LOAD=1, a session left at its default threads counts, when it is
made, how many threads other processes are running (the median of three samples a few
milliseconds apart), and uses the cores they leave free (at least one). It is opt-in
because it makes results depend on the machine's load: a BLAS reduction may round
differently on one thread than on two, and sessions made at different moments (Ray actors
next to a driver, say) would then disagree in the last bits. The count is taken once, so a
session's own results never change from run to run. Explicit ``threads=`` are never
changed.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SAMPLES, SPACING_S = 3, 0.002
"""The count is the median of this many samples this far apart: one process starting or
ending at that instant does not decide a session's threads."""


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


def default_threads(cores: int) -> int:
    """Threads for a session left at its defaults: ``cores``, or with
    KILN_THREADS_FOLLOW_LOAD=1 ``cores`` less the threads other processes are running now,
    at least one."""
    if os.environ.get("KILN_THREADS_FOLLOW_LOAD", "").strip().lower() not in ("1", "on"):
        return cores
    seen = []
    for i in range(SAMPLES):
        if i:
            time.sleep(SPACING_S)
        busy = running_elsewhere()
        if busy is None:
            return cores
        seen.append(busy)
    return max(1, cores - sorted(seen)[len(seen) // 2])
