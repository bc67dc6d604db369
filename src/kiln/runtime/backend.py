"""What the plan needs from a backend: its arrays, its device, moving arrays in and out,
which kernels it prefers for an op, and how to run a plan (eagerly, or specialized per
input shape when it can compile). The NumPy backend below is the reference; the torch
backend (``kiln.runtime.torch_backend``) subclasses it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from kiln.errors import InputError
from kiln.ir import DType
from kiln.ops.registry import Kernel, OpDef, Target
from kiln.runtime.placement import LayerPlacement, RunStats


def host_feed(x: Any, dtype: DType) -> np.ndarray:
    """A caller's feed as a NumPy array in native byte order, or InputError saying why not:
    lists take the declared dtype; big-endian arrays are converted (onnxruntime accepts
    them); ragged lists, dicts, None, text for a numeric input and record dtypes are refused
    rather than turned into something the caller did not mean."""
    if isinstance(x, np.ndarray):
        arr = x
    elif hasattr(x, "__array__") and not isinstance(x, (list, tuple)):
        arr = np.asarray(x)
    else:
        text = dtype == DType.STRING
        if x is None or isinstance(x, (dict, set)) or (isinstance(x, (str, bytes)) and not text):
            raise InputError(f"a feed of type {type(x).__name__} cannot be a tensor of "
                             f"{dtype.onnx_name}; pass a NumPy array")
        try:
            arr = np.asarray(x, dtype=object if text else dtype.numpy)
        except (ValueError, TypeError) as e:
            raise InputError(f"the feed cannot be made a tensor of {dtype.onnx_name} ({e}); "
                             "pass a NumPy array of that dtype (nested lists must not be "
                             "ragged)") from None
    if arr.dtype.fields is not None:  # plain "V" kinds are ml_dtypes (bfloat16...) or refused below
        raise InputError(f"a feed of record dtype {arr.dtype} cannot be a tensor; pass a "
                         "plain NumPy array")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    try:
        DType.from_numpy(arr.dtype)
    except KeyError:
        raise InputError(f"a feed of dtype {arr.dtype} has no ONNX element type; convert "
                         f"it with .astype({dtype.numpy.name!r})") from None
    return arr


class Candidate(NamedTuple):
    """A kernel prepared for one node: how it runs (placement label), the callable,
    whether it takes a KernelContext first, and why it was chosen."""

    how: str
    fn: Callable
    wants_ctx: bool
    why: str


class Link(NamedTuple):
    """What the plan's step for one node calls, decided once when the session is made."""

    fn: Callable
    wants_ctx: bool
    """Whether ``fn`` and ``rest`` take a KernelContext first."""
    layer: LayerPlacement
    rest: Callable | None = None
    """Called on the same arguments when ``fn`` returns NotImplemented (a call it does not
    take, a dtype say); None: ``fn`` takes every call."""
    params: bool = False
    """Whether the node's host-parameter constants (shapes, axes) reach ``fn`` and ``rest``
    as tuples of Python numbers rather than arrays."""


def usable_cores() -> int:
    """CPU cores this process may really use: its affinity mask, capped by a cgroup CPU
    quota (containers), so default thread counts never oversubscribe them."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def limit_blas_threads(threads: int | None) -> None:
    """Set NumPy's BLAS thread pool to ``threads`` (process-wide, as torch's
    set_num_threads); None only lowers it to the usable cores."""
    blas = _blas_pools()
    cap = usable_cores()
    if threads is None:
        if all(lib.num_threads <= cap for lib in blas):
            return
        threads = cap
    for lib in blas:
        lib.set_num_threads(int(threads))


class ThreadTrial:
    """Whether a plan runs faster on one thread than on ``threads`` at some input shapes,
    measured on its own runs: a small model (a voice detector's step, a wake-word head, a
    recurrent layer's 50 steps) runs many tiny layers or products, and each one split
    over threads wakes the pool's second thread, which then spins for the core the next
    layer needs; on a shared 2-core machine such runs took several times (NumPy's GRU:
    tens of times) longer on two threads than on one.

    Runs alternate between the two counts, ``threads`` first, and each one-thread run is
    compared with the run on ``threads`` just before it: load that comes and goes hits
    both runs of such a pair alike, where it would skew two separate medians. After
    :attr:`RUNS` pairs one thread wins only if its median ratio is under :attr:`MARGIN`
    (clearly faster); otherwise the configured count stays, so two processes serving one
    model do not split over a difference within noise. Two pairs that both favour one side
    by :attr:`CLEAR` or more decide at once, and so do two one-thread runs slower than
    :attr:`BIG_S` and than the fastest on ``threads``: a model that large has work to
    split, and its one-thread trial runs would cost more than they could save (one slow
    run is not enough: on a loaded machine a small model's run can take many times its
    usual time).

    A choice is not kept forever: after :attr:`RECHECK` runs the trial runs again (no
    build runs then), so a start under passing load is corrected. A re-check that confirms
    the choice doubles the wait for the next one, up to :attr:`RECHECK_MAX` runs, which
    bounds what re-checks cost a model whose losing count is many times slower."""

    RUNS = 5
    BIG_S = 0.05
    MARGIN = 0.9
    CLEAR = 0.5
    RECHECK = 500
    RECHECK_MAX = 16000

    def __init__(self, threads: int):
        self.threads = threads
        self.chosen: int | None = None
        self.seen = 0
        self.times: dict[int, list[float]] = {threads: [], 1: []}
        self.pools: tuple[OneThread, ...] | None = None
        """The thread pools its one-thread runs hold at one (the backend sets them)."""
        self.every = self.RECHECK
        self.left = 0
        """Runs on the chosen count before the next re-check."""
        self.last: int | None = None
        """The previous trial's choice (a re-check that repeats it waits longer next)."""

    def settled(self, threads: int) -> bool:
        """Whether a run on ``threads`` needs neither setting nor timing: the trial chose
        them and no re-check is due yet. Counts the run (a plain attribute count: runs from
        several threads may lose a few, which only moves the re-check)."""
        if self.chosen != threads:
            return False
        self.left -= 1
        if self.left > 0:
            return True
        self._reopen()
        return False

    def next_threads(self) -> int:
        """The thread count of the next run."""
        if self.chosen is not None:
            return self.chosen
        many, one = self.times[self.threads], self.times[1]
        return 1 if len(one) < len(many) else self.threads

    def record(self, threads: int, seconds: float) -> None:
        """A run on ``threads`` took ``seconds``."""
        if self.chosen is not None:
            self.left -= 1
            if self.left <= 0:
                self._reopen()
            return
        self.seen += 1
        if self.seen <= 2:  # the first runs build, not measure
            return
        self.times[threads].append(seconds)
        many, one = self.times[self.threads], self.times[1]
        if len(one) >= 2 and min(one) > self.BIG_S and many and min(one) > min(many):
            self._settle(self.threads)  # a big model: stop paying for one-thread runs
            return
        if threads != 1 or len(one) > len(many):
            return  # a pair is complete once its one-thread run is in
        ratios = [o / m if m > 0 else 1.0 for m, o in zip(many, one)]
        if len(ratios) == 2 and max(ratios) <= self.CLEAR:
            self._settle(1)
        elif len(ratios) == 2 and min(ratios) >= 1 / self.CLEAR:
            self._settle(self.threads)
        elif len(ratios) >= self.RUNS:
            self._settle(1 if statistics.median(ratios) < self.MARGIN else self.threads)

    def _settle(self, threads: int) -> None:
        self.every = min(2 * self.every, self.RECHECK_MAX) if threads == self.last \
            else self.RECHECK
        self.last, self.left = threads, self.every
        self.chosen = threads

    def _reopen(self) -> None:
        self.times = {self.threads: [], 1: []}
        self.seen = max(self.seen, 2)  # the shapes ran already: every run now measures
        self.chosen = None


class OneThread:
    """A process-wide thread pool held at one thread while any run asks for it; the last
    such run to end restores the count it had (concurrent runs share the setting)."""

    def __init__(self, get: Callable[[], int], set: Callable[[int], Any]):
        self.get, self.set = get, set
        self.lock = threading.Lock()
        self.runs = 0
        self.saved = 1

    def enter(self) -> None:
        with self.lock:
            if self.runs == 0:
                self.saved = self.get()
                self.set(1)
            self.runs += 1

    def exit(self) -> None:
        with self.lock:
            self.runs -= 1
            if self.runs == 0:
                self.set(self.saved)


class measured_threads:
    """Run the body inside ``inner`` on the thread count ``trial`` picks (every pool of
    ``pools`` at one thread, or as they are), timed for it. A class rather than a
    generator context: a tiny model's whole run takes tens of microseconds, and
    contextlib's generator machinery cost several of them per run."""

    __slots__ = ("trial", "pools", "inner", "n", "t0")

    def __init__(self, trial: ThreadTrial, pools: tuple[OneThread, ...], inner):
        self.trial, self.pools, self.inner = trial, pools, inner

    def __enter__(self) -> None:
        self.n = n = self.trial.next_threads()
        if n == 1:
            for pool in self.pools:
                pool.enter()
        try:
            self.inner.__enter__()
        except BaseException:
            self._release()
            raise
        self.t0 = time.perf_counter()

    def __exit__(self, *exc) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self.trial.record(self.n, time.perf_counter() - self.t0)
            self._release()

    def _release(self) -> None:
        if self.n == 1:
            for pool in self.pools:
                pool.exit()


@functools.cache
def _blas_pools() -> tuple:
    """NumPy's BLAS libraries' thread controllers (the scan is cached: see _thread_pools)."""
    return tuple(lib for lib in _thread_pools().lib_controllers if lib.user_api == "blas")


def _blas_threads() -> int:
    return max((lib.num_threads for lib in _blas_pools()), default=1)


def _set_blas_threads(n: int) -> None:
    for lib in _blas_pools():
        lib.set_num_threads(int(n))


BLAS_THREADS = OneThread(_blas_threads, _set_blas_threads)
"""NumPy's BLAS threads, process-wide."""

_NO_CONTEXT = contextlib.nullcontext()
"""A reusable, reentrant empty context (runs from several threads share it)."""


@functools.cache
def _thread_pools():
    # Scanning the process's libraries costs milliseconds once torch and onnxruntime are loaded,
    # more than a small model's whole session; NumPy's BLAS is loaded with NumPy, before
    # any session, so one scan per process sees it.
    # threadpoolctl sets KMP_DUPLICATE_LIB_OK in the environment when imported; Kiln
    # leaves the environment as the user gave it (it only reads libraries already loaded).
    had = os.environ.get("KMP_DUPLICATE_LIB_OK")
    from threadpoolctl import ThreadpoolController

    if had is None:
        os.environ.pop("KMP_DUPLICATE_LIB_OK", None)
    return ThreadpoolController()


class Backend:
    """The NumPy backend: runs every op's reference kernel on the CPU."""

    name = "numpy"
    device = "cpu"
    array_type: type = np.ndarray
    """The class of this backend's arrays (results of another class are normalized)."""

    def target(self) -> Target:
        """What the plan tells each kernel's ``prepare`` about where it runs."""
        return Target(self.name, self.device)

    def candidates(self, opdef: OpDef) -> list[tuple[str, Kernel, str]]:
        """The kernels to try for ``opdef``, best first: (placement label, kernel, why)."""
        return [(self.name, opdef.reference, "reference kernel")]

    def chain(self, chain: list[Candidate], node, host_inputs: frozenset[int] = frozenset()
              ) -> Link:
        """What the node's step calls, from the prepared candidates (the first, here);
        ``host_inputs``: the inputs its op reads on the host."""
        c = chain[0]
        return Link(c.fn, c.wants_ctx, LayerPlacement.of(node, self.device, c.how, c.why))

    def transfers(self, chain: list[Candidate], node) -> tuple[Callable, Callable] | None:
        """Where the plan itself moves a node's values: (applied to each input before its
        kernel, applied to the kernel's result) — explicit transfer steps around a kernel
        of another device. None (here: every kernel runs on this backend's arrays)."""
        return None

    def finish(self, plan) -> None:
        """Called once a plan's kernels are all prepared (torch: constants' placement)."""

    def specialize(self, plan, opsets: dict, functions: dict) -> None:
        """Set up shape-specialized compiled programs for the main plan, if asked for."""

    def run_context(self, plan: Any = None, inputs: list | None = None):
        """The context ``plan`` runs in on ``inputs``: BLAS's thread count measured
        fastest for these input shapes (:class:`ThreadTrial`; torch: also inference mode)."""
        n = BLAS_THREADS.get() if plan is not None and inputs is not None else 1
        if n <= 1:
            return _NO_CONTEXT
        trial = self.thread_trial(plan, inputs, n)
        if trial.settled(n):  # on the threads as they are: nothing to set or time
            return _NO_CONTEXT
        return measured_threads(trial, (BLAS_THREADS,), _NO_CONTEXT)

    def compiled_context(self, programs: Any, inputs: list):
        """The context a main plan's compiled ``programs`` (its specializer) run in on
        ``inputs`` (torch: the thread count measured fastest for them)."""
        return contextlib.nullcontext()

    def thread_trial(self, plan: Any, inputs: list, threads: int) -> ThreadTrial:
        """The thread-count trial of ``plan`` at the shapes of ``inputs``."""
        trials = self.__dict__.get("_thread_trials")
        if trials is None:
            trials = self.__dict__.setdefault("_thread_trials", weakref.WeakKeyDictionary())
        per_plan = trials.get(plan)
        if per_plan is None:
            per_plan = trials.setdefault(plan, {})
        key = tuple(getattr(x, "shape", None) for x in inputs)
        trial = per_plan.get(key)
        return per_plan.setdefault(key, ThreadTrial(threads)) if trial is None else trial

    def start_run(self) -> Any:
        """Called as a main run starts; what it returns goes to :meth:`end_run` (torch:
        the run's record of transfers and fallback calls)."""
        return None

    def end_run(self, token: Any) -> None:
        """Called as a main run ends, however it ends."""

    def stats(self) -> RunStats:
        """This thread's current run's record (a throwaway one, on NumPy)."""
        return RunStats()

    def last_run_stats(self) -> RunStats | None:
        """What the last run moved between devices (nothing, on NumPy)."""
        return None

    # -- arrays ------------------------------------------------------------------------

    def constant(self, v):
        """The backend array holding initializer ``v`` (``v.meta`` may carry placement hints)."""
        return self.from_numpy(v.const)

    def from_numpy(self, x):
        return x

    def to_numpy(self, x):
        return x

    def normalize(self, x):
        """Make a kernel's result a proper array of this backend (NumPy scalars -> arrays)."""
        if x is None or isinstance(x, (np.ndarray, list)):
            return x
        return np.asarray(x)

    def accept_feed(self, x: Any, dtype: DType):
        """Turn a caller's feed into this backend's array (lists take the declared dtype)."""
        return host_feed(x, dtype)

    def dtype_of(self, x) -> DType:
        """The element type of an array of this backend."""
        return DType.from_numpy(x.dtype)
