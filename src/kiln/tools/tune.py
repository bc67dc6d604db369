"""``kiln.tune``: the fastest way to run a model on this machine within an accuracy
budget, measured. Candidates (backend, eager or compiled, fp32/bf16, INT8 dynamic/static,
threads) run side by side in one process, in alternating rounds; each one's accuracy is
checked on the given data against the fp32 model. The winner is written as a standard
ONNX file whose metadata stores its run settings (:mod:`kiln.runtime.run_settings`), so
``kiln.InferenceSession(path)`` runs it as it was measured."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import InputError, KilnError, OptionError
from kiln.ir import Model
from kiln.onnxio import save
from kiln.quantize import quantize
from kiln.quantize.api import Budget
from kiln.quantize.calibrate import load_feeds
from kiln.quantize.report import OutputError, model_bytes, output_errors
from kiln.runtime.backend import usable_cores
from kiln.runtime.backends import backend_entry, backend_names, reference_backend_name
from kiln.runtime.run_settings import KEY, encode
from kiln.session_api import InferenceSession
from kiln.tools.benchmark import SwitchRest, spin_rest
from kiln.tools.common import load_model, random_feeds

__all__ = ["Candidate", "TuneResult", "tune"]

# Feeds the accuracy check runs at most (each a batch of the data).
CHECK_FEEDS = 8
NO_LAYER = "no layer quantized"
# Share of the time budget spent building candidates before measuring starts.
BUILD_SHARE = 0.6
# Build time a candidate needs left to be tried at all, by kind: an INT8 candidate
# calibrates and times its layers before its budget search starts, a compiled one needs a
# first compile (the child is stopped when the time runs out, but starting it costs).
MIN_BUILD_SECONDS = {"eager": 0.0, "int8": 10.0, "compile": 10.0}


@dataclass
class Candidate:
    """One way to run the model: backend, its options, threads, and the file it runs."""

    name: str
    backend: str
    options: dict[str, Any]
    threads: int | None = None
    exact: bool = True
    """Computes what the fp32 model computes (backend, compile, threads): no budget."""
    int8: str | None = None
    """"dynamic" or "static": the file is the model quantized that way (kiln.quantize,
    layers kept in float as the budget needs)."""
    model: Model | None = None
    session: Any = None
    latencies_ms: list[float] = field(default_factory=list)
    errors: dict[str, OutputError] | None = None
    size: int = 0
    status: str = "ok"
    """"ok", or why it cannot win (over the budget, failed to build or run, skipped)."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Where its tuning time went: "calibrate" (kiln.quantize: calibration, the budget's
    search, speed-aware timing), "compile" (the compile and the first, compiling run),
    "build" (the session and its first run), "check" (outputs on the data), "measure"
    (its turns in the measuring rounds: the untimed run and the timed block)."""
    measure_s: float = 0.0
    """Wall seconds of its turns in the measuring rounds so far."""

    @property
    def ms(self) -> float:
        """Median latency (inf when never measured)."""
        return statistics.median(self.latencies_ms) if self.latencies_ms else float("inf")

    def settings(self) -> dict[str, Any]:
        """The backend options a session needs to run as measured."""
        return {**self.options, **({"threads": self.threads} if self.threads else {})}

    def accuracy(self) -> str:
        """Worst relative error and top-1 agreement against the fp32 model, in words."""
        if not self.errors:
            return "-"
        rel = max(e.rel for e in self.errors.values())
        tops = [e.top1 for e in self.errors.values() if e.top1 is not None]
        return f"rel {rel:.2g}" + (f", top-1 {min(tops):.2%}" if tops else "")


@dataclass
class TuneResult:
    """Every candidate measured, the winner and why, and where it was written."""

    candidates: list[Candidate]
    winner: Candidate
    baseline: Candidate
    """fp32 eager on the default backend settings: what the speed-up is against."""
    budget: Budget | None
    batch: int
    rounds: int
    seconds: float
    output: str | None = None
    stages: dict[str, float] = field(default_factory=dict)
    """Seconds of the whole search by stage: "load" (the model and the fp32 reference),
    "build" (every candidate's calibrate, compile, build and check), "measure"."""

    def why(self) -> str:
        """Why the winner won, in one sentence."""
        w, b = self.winner, self.baseline
        over = [c.name for c in self.candidates if c.status.startswith("over")]
        text = f"{w.name} is the fastest candidate " + (
            f"within the budget ({self.budget})" if self.budget else
            "(exact transformations only: no data)")
        text += f": {w.ms:.2f} ms vs {b.ms:.2f} ms for {b.name} ({b.ms / w.ms:.2f}x)"
        if over:
            text += f"; over the budget: {', '.join(over)}"
        skipped = [c.name for c in self.candidates if c.status.startswith("skipped")
                   and NO_LAYER not in c.status]
        if skipped:
            text += f"; not tried in the time budget: {', '.join(skipped)}"
        same = [c.name for c in self.candidates if NO_LAYER in c.status]
        if same:
            text += f"; {NO_LAYER}, not measured: {', '.join(same)}"
        return text

    def time_spent(self) -> str:
        """Where the tuning time went, in one line per stage and candidate."""
        st = self.stages
        head = (f"time: {self.seconds:.0f} s = load {st.get('load', 0):.0f} s + build "
                f"{st.get('build', 0):.0f} s + measure {st.get('measure', 0):.0f} s")
        rows = [f"  {c.name}: " + ", ".join(f"{k} {v:.1f} s" for k, v in c.seconds.items())
                for c in self.candidates if c.seconds and c.threads is None]
        return "\n".join([head, *rows])

    def __str__(self) -> str:
        rows = [f"{'candidate':<34} {'median ms':>10} {'size MB':>8}  accuracy / status"]
        for c in sorted(self.candidates, key=lambda c: c.ms):
            ms = f"{c.ms:.2f}" if c.latencies_ms else "-"
            mark = "*" if c is self.winner else " "
            size = f"{c.size / 1e6:.2f}" if c.size else "-"
            rows.append(f"{mark}{c.name:<33} {ms:>10} {size:>8}  {c.accuracy()}"
                        + ("" if c.status == "ok" else f" ({c.status})"))
        head = f"batch {self.batch}, {self.rounds} alternating round(s), {self.seconds:.0f} s"
        tail = [self.why(), self.time_spent()] + (
            [f"wrote {self.output}"] if self.output else [])
        return "\n".join([head, *rows, *tail])

    def to_dict(self) -> dict[str, Any]:
        """The result as plain data (``kiln tune --json``)."""
        return {"batch": self.batch, "rounds": self.rounds, "seconds": self.seconds,
                "budget": str(self.budget) if self.budget else None,
                "winner": self.winner.name, "output": self.output, "why": self.why(),
                "stages": self.stages,
                "candidates": [{"name": c.name, "backend": c.backend,
                                "settings": c.settings(), "median_ms": c.ms
                                if c.latencies_ms else None, "size": c.size,
                                "accuracy": c.accuracy(), "status": c.status,
                                "seconds": c.seconds}
                               for c in self.candidates]}


def tune(model: Any, data: Any = None, *, budget: Budget | str | None = None,
         batch: int = 1, time_budget: float = 600.0, output: str | os.PathLike | None = None,
         on_stage: Callable[[str], None] | None = None) -> TuneResult:
    """Measure the ways ``model`` can run here and keep the fastest within ``budget``.

    ``data``: an ``.npz`` (keys = input names, rows along the first axis), a folder of
    them, a feed dict or a list of feeds; without it only exact transformations are tried
    (backend, compile, threads). ``budget``: ``"top1=0.99"``, ``"rel=0.01"`` or a
    :class:`~kiln.quantize.api.Budget` (default: top-1 agreement >= 99% for a model with
    score outputs, else relative error <= 1%). ``batch``: rows per timed run.
    ``time_budget``: seconds for the whole search: candidates are built until 60% of it
    (each given what is left of that: a compile is stopped, a quantization's search cut
    short, and a candidate with too little left is skipped and listed as such), measuring
    stops at the budget (after three rounds at least). The report says where the time
    went, per stage and per candidate.
    ``output``: where to write the winner (standard ONNX with its run settings in the
    metadata). ``on_stage(text)`` is called as each stage starts."""
    stage = on_stage or (lambda text: None)
    t0 = time.perf_counter()
    if batch < 1:
        raise OptionError(f"batch must be at least 1, got {batch}")
    if output is not None and not Path(output).resolve().parent.is_dir():
        raise InputError(f"cannot write {output}: the folder "
                         f"{Path(output).resolve().parent} does not exist")
    stage("loading the model")
    base = load_model(model)
    inputs = [v.name for v in base.graph.inputs]
    feeds = _feeds(data, inputs) if data is not None else []
    check = feeds[:CHECK_FEEDS]
    timed = _rows(feeds[0], batch) if feeds else random_feeds(base, batch=batch)
    stage("running the fp32 reference")
    ref = reference_backend_name()
    ref_sess = InferenceSession(base, backend=ref)
    names = [o.name for o in ref_sess.get_outputs()]
    refs = _outputs(ref_sess, names, check)
    budget = _budget(budget, refs) if check else None
    cands = _plan(base, check, budget)
    t_built = time.perf_counter()
    stages = {"load": t_built - t0}
    build_end = t0 + BUILD_SHARE * time_budget
    for i, c in enumerate(cands):
        left = build_end - time.perf_counter()
        # The first two (the reference and the next backend's fp32) are always built: the
        # baseline.
        if i >= 2 and left <= MIN_BUILD_SECONDS[_kind(c)]:
            c.status = f"skipped: out of time to build it ({max(left, 0):.0f} s left)"
            continue
        if c.backend == ref and not c.options:
            # the fp32 reference is this candidate: its session and outputs serve again
            # (on a big model NumPy's check alone took minutes)
            c.session, c.size, c.seconds = ref_sess, model_bytes(base), {"build": 0.0}
            c.errors = output_errors(refs, refs) if check else None
            continue
        stage(f"building {c.name}")
        try:
            _build(c, base, feeds, check, budget, timed, left)
            t = time.perf_counter()
            c.session.run(None, timed)  # warm-up (the first run of compile=True compiles)
            c.seconds["compile" if c.options.get("compile") else "build"] += \
                time.perf_counter() - t
            if check:
                t = time.perf_counter()
                c.errors = output_errors(refs, _outputs(c.session, names, check))
                c.seconds["check"] = time.perf_counter() - t
                if not c.exact and budget is not None and budget.shortfall(c.errors) > 0:
                    c.status = f"over the budget ({budget})"
        except KilnError as e:
            text = str(e).splitlines()[0][:120]
            c.status = text if text.startswith("skipped") else f"failed: {text}"
            c.session = None
    cands += [replace(c, name=f"{c.name}, 1 thread", threads=1, latencies_ms=[])
              for c in cands if c.session is not None and c.threads is None
              and backend_entry(c.backend).threads_per_run
              and usable_cores() > 1]  # the same session: threads are set per run
    runs = [c for c in cands if c.session is not None]
    if not runs:
        raise KilnError("no candidate could be built to run this model")
    t_measure = time.perf_counter()
    stages["build"] = t_measure - t_built
    rounds = _measure(runs, timed, t0 + time_budget, stage)
    stages["measure"] = time.perf_counter() - t_measure
    for c in runs:  # the one-thread variants share their session's build
        c.seconds = {**(c.seconds if c.threads is None else {}), "measure": c.measure_s}
    ok = [c for c in runs if c.status == "ok"]
    baseline = next((c for c in runs if c.name.startswith("torch fp32 eager") and
                     c.threads is None), runs[0])
    winner = min(ok, key=lambda c: c.ms) if ok else baseline
    result = TuneResult(cands, winner, baseline, budget, batch, rounds,
                        time.perf_counter() - t0, stages=stages)
    if output is not None:
        out = winner.model if winner.model is not None else base
        out.metadata[KEY] = encode(winner.backend, winner.settings())
        save(out, output)
        result.output = str(output)
    for c in cands:  # the sessions hold compiled programs and memory: free them now
        c.session = None
    return result


def _feeds(data: Any, inputs: list[str]) -> list[dict]:
    if isinstance(data, (str, os.PathLike)) and Path(data).is_dir():
        files = sorted(Path(data).glob("*.npz"))
        if not files:
            raise InputError(f"{data} is a folder with no .npz file: give an .npz whose "
                             "keys are the model's inputs, or a folder of them")
        return [f for p in files for f in load_feeds(str(p), inputs)]
    if isinstance(data, (str, os.PathLike)) and not Path(data).is_file():
        raise InputError(f"no data file at {data}: give an .npz whose keys are the "
                         f"model's inputs ({', '.join(inputs)}), or a folder of them")
    return load_feeds(data, inputs)


def _rows(feed: dict, batch: int) -> dict:
    """``feed`` with exactly ``batch`` rows (repeated when it has fewer)."""
    out = {}
    for k, v in feed.items():
        a = np.asarray(v)
        if a.ndim == 0:
            out[k] = a
            continue
        reps = -(-batch // max(len(a), 1))
        out[k] = np.concatenate([a] * reps)[:batch] if reps > 1 else a[:batch]
    return out


def _outputs(sess: Any, names: list[str], feeds: list[dict]) -> dict[str, list[np.ndarray]]:
    got: dict[str, list[np.ndarray]] = {n: [] for n in names}
    for feed in feeds:
        for n, o in zip(names, sess.run(None, feed)):
            got[n].append(np.asarray(o))
    return got


def _budget(budget: Budget | str | None, refs: dict) -> Budget:
    scores = any(e.top1 is not None for e in output_errors(refs, refs).values())
    if budget is None:
        return Budget(min_top1=0.99) if scores else Budget(max_rel=0.01)
    budget = Budget.parse(budget) if isinstance(budget, str) else budget
    if budget.min_top1 is not None and budget.max_rel is None and not scores:
        raise OptionError("a top-1 budget needs an output of scores (rows of classes); "
                          "this model has none: give rel=R instead")
    return budget


def _plan(base: Model, check: list, budget: Budget | None) -> list[Candidate]:
    """The candidates that apply on this machine, cheapest to build first: the reference
    backend, then each other usable backend eagerly in fp32, in the reduced precisions it
    computes natively, int8 where it has integer kernels, and compiled where it has a
    compiler (the registry says which)."""
    ref = reference_backend_name()
    cands = [Candidate(f"{ref} fp32", ref, {})]
    others = [backend_entry(n) for n in backend_names(usable_only=True) if n != ref]
    for e in others:
        cands.append(Candidate(f"{e.name} fp32 eager", e.name, {}))
    for e in others:
        if check:
            cands += [Candidate(f"{e.name} {p} eager", e.name, {"precision": p}, exact=False)
                      for p in e.precisions()]
            if e.integer_kernels:
                cands += [Candidate(f"{e.name} int8 {mode}", e.name, {}, exact=False,
                                    int8=mode) for mode in ("dynamic", "static")]
        if e.takes("compile"):
            cands.append(Candidate(f"{e.name} fp32 compiled", e.name, {"compile": True}))
    return cands


def _kind(c: Candidate) -> str:
    return "int8" if c.int8 else "compile" if c.options.get("compile") else "eager"


def _build(c: Candidate, base: Model, feeds: list, check: list, budget: Budget | None,
           feed: dict, left: float) -> None:
    c.seconds = {"calibrate": 0.0} if c.int8 else {}
    c.seconds.update({"compile": 0.0} if c.options.get("compile") else {}, build=0.0)
    if c.int8:
        mode = c.int8
        t = time.perf_counter()
        try:
            # the search for the layers that meet the budget gets part of what is left
            # (calibrating and timing layers take the rest)
            q = quantize(base, mode, calibration=feeds if mode == "static" else None,
                         validation=check, budget=budget, budget_seconds=left * 0.3,
                         backend=c.backend, measure_latency=False)
        finally:
            c.seconds["calibrate"] = time.perf_counter() - t
        if not q.report.quantized:
            # the fp32 model under another name: measured, its noise could make it "win"
            # (PaddleOCR's classifier, batch 8: 1.15x fp32 eager's time when timed again)
            why = sorted(set(q.report.kept.values()))
            raise KilnError(f"skipped: {NO_LAYER} (the fp32 model)" +
                            (f"; kept in float: {', '.join(why)[:80]}" if why else ""))
        c.model = q.model
    if c.options.get("compile"):
        # Loading the program it made takes this process tens of seconds more on a busy
        # machine (torch's inductor imports): the child gets part of what is left.
        t = time.perf_counter()
        try:
            _precompile(base, c.backend, feed, 0.7 * left)
        finally:  # a stopped compile's time is counted too
            c.seconds["compile"] = time.perf_counter() - t
    t = time.perf_counter()
    c.size = model_bytes(c.model if c.model is not None else base)
    opts = {**c.options, **({"warn": False} if backend_entry(c.backend).takes("warn") else {})}
    c.session = InferenceSession(c.model if c.model is not None else base,
                                 backend=c.backend, **opts)
    c.seconds["build"] = time.perf_counter() - t


_PRECOMPILE = """import sys, numpy as np, kiln
feed = dict(np.load(sys.argv[2]))
kiln.InferenceSession(sys.argv[1], backend=sys.argv[3], compile=True).run(None, feed)
"""


def _precompile(base: Model, backend: str, feed: dict, seconds: float) -> None:
    """Compile ``base`` on ``backend`` for ``feed``'s shapes in a child process that is
    stopped after ``seconds``: a first compile can take minutes on a busy machine, and
    only a process can be stopped. What it compiled lands in the disk cache
    (kiln.runtime.compile_cache), where this process's session finds it; a refusal says
    so."""
    from kiln.runtime import compile_cache

    if compile_cache.folder() is None:  # no disk cache: nothing a child could hand over
        raise KilnError("compiling needs the compile cache (KILN_COMPILE_CACHE is off)")
    if seconds < 5:
        raise KilnError("skipped: out of time to compile")
    with tempfile.TemporaryDirectory() as d:
        save(base, f"{d}/m.onnx")
        np.savez(f"{d}/feed.npz", **feed)
        proc = subprocess.Popen([sys.executable, "-c", _PRECOMPILE, f"{d}/m.onnx",
                                 f"{d}/feed.npz", backend], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the compiler's own children too
            proc.wait()
            raise KilnError(f"skipped: compiling took over the {seconds:.0f} s left of "
                            "the time budget (a longer --time-budget tries it)") from None


BLOCK = 3
"""Timed runs of a candidate per measuring round (after one untimed run)."""


def _measure(runs: list[Candidate], feed: dict, deadline: float,
             stage: Callable[[str], None], most: int = 200, enough: float = 30.0) -> int:
    """Time each candidate once per round, the order reversed every other round, until
    ``most`` rounds, the deadline, or ``enough`` seconds after 20 rounds (at least three
    rounds). A candidate's time in a round is the median of :data:`BLOCK` runs after one
    untimed run: its first run after another candidate's (the thread count set again, the
    other's threads asleep or still spinning) is not its steady time, and timing only that
    run once chose a one-thread compiled program that a repeat measurement found slower
    than two-thread eager. A rest before a candidate whose backend is not the last one's:
    NumPy's OpenBLAS workers spin after its run and slowed the two-thread torch run after
    it."""
    set_threads = _thread_setter()
    rest = SwitchRest()
    stage(f"measuring {len(runs)} candidates in alternating rounds")
    k = 0
    start = time.perf_counter()
    while k < most and (k < 3 or time.perf_counter() < deadline) and \
            (k < 20 or time.perf_counter() - start < enough):
        for c in runs if k % 2 == 0 else runs[::-1]:
            rest(c.backend, spin_rest(c.backend))
            turn = time.perf_counter()
            set_threads(c)
            c.session.run(None, feed)
            block = []
            for _ in range(BLOCK):
                t = time.perf_counter()
                c.session.run(None, feed)
                block.append((time.perf_counter() - t) * 1e3)
            c.latencies_ms.append(statistics.median(block))
            c.measure_s += time.perf_counter() - turn
        k += 1
    set_threads(None)
    return k


def _thread_setter() -> Callable[[Candidate | None], None]:
    """Sets torch's (process-wide) thread count for each candidate before its run."""
    try:
        import torch
    except ImportError:
        return lambda c: None
    default = torch.get_num_threads()

    def set_threads(c: Candidate | None) -> None:
        want = c.threads if c is not None and c.threads else default
        if torch.get_num_threads() != want:
            torch.set_num_threads(want)
    return set_threads
