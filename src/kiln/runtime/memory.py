"""Keep freed memory in the process for the next run, as onnxruntime's CPU arena does.

glibc's malloc hands every block over 32 MB (and, until its threshold adapts, over 128 KB)
to the kernel with mmap and returns it with munmap on free. An activation of that size
then costs fresh pages on every run: page faults and the kernel zeroing them, a large
share of a big model's run at batch 8 (docs/performance.md). torch and NumPy
allocate with malloc, so the fix is malloc's: no mmap for big blocks (M_MMAP_MAX 0) and no
returning the top of the heap to the kernel (M_TRIM_THRESHOLD). Freed blocks then serve
the next run. The process keeps its high-water mark of memory, as with onnxruntime's arena.

Runs made from other threads than the main one allocate from glibc's per-thread arenas,
which still map blocks of 64 MB or more afresh (measured: 16,384 faults a run for a 64 MB
activation on torch, 577 on NumPy, which gets huge pages); ``MALLOC_ARENA_MAX=1`` in the
environment sends them to the main arena too, at the cost of one malloc lock for all
threads, so it is left to the user.

It is process-wide and stays on: other code in the process gets it too. A process whose
environment sets malloc's own tunables (MALLOC_MMAP_MAX_, MALLOC_TRIM_THRESHOLD_,
MALLOC_MMAP_THRESHOLD_, GLIBC_TUNABLES) keeps them. ``ctypes.CDLL(None).malloc_trim(0)``
hands the freed memory back.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4  # mallopt's parameter numbers (malloc.h)
_USER_TUNABLES = ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                  "GLIBC_TUNABLES")


@functools.cache
def keep_freed_memory() -> bool:
    """Switch glibc's malloc to keep freed memory for reuse (once per process). Returns
    whether it is on: False off glibc or where the environment tunes malloc itself."""
    if not sys.platform.startswith("linux") or any(k in os.environ for k in _USER_TUNABLES):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 -- glibc only; musl's mallopt does nothing
    except (OSError, AttributeError):
        return False
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and \
        bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
