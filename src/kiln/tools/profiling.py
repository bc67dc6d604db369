"""``kiln.profile``: time every layer of a model over several runs, and write the timeline
as a Chrome trace (chrome://tracing, https://ui.perfetto.dev)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from time import perf_counter
from typing import Any

from kiln.tools.common import model_name, random_feeds, session_for


@dataclass
class LayerTime:
    """One main-graph layer: its times over the measured runs (ms)."""

    index: int
    name: str
    op_type: str
    shape: list[int] | None  # shape of its first output, as run
    placement: str
    times_ms: list[float] = field(default_factory=list)
    once: bool = False
    """Runs once per input shape, not in every run (kiln.runtime.shape_memo)."""

    @property
    def mean_ms(self) -> float:
        return sum(self.times_ms) / len(self.times_ms) if self.times_ms else 0.0


@dataclass
class OpTotal:
    """All layers of one op type: how many, their summed mean time, share of the total."""

    op_type: str
    count: int
    ms: float
    share: float


@dataclass
class Profile:
    """Per-layer times of ``runs`` runs (after ``warmup`` unmeasured ones).

    ``wall_ms`` is each run's time around the whole plan, so ``sum(layer means) <=
    mean(wall_ms)``; the difference is the plan's own bookkeeping and the timer.
    """

    model: str
    backend: str
    device: str
    runs: int
    warmup: int
    layers: list[LayerTime]
    wall_ms: list[float]
    run_starts: list[float] = field(default_factory=list)  # perf_counter seconds
    events: list[tuple[int, int, float, float]] = field(default_factory=list)
    """(run, layer index, start, end): perf_counter seconds of every measured step."""

    @cached_property
    def layer_total_ms(self) -> float:
        """Sum of the layers' mean times: one run's time spent inside kernels."""
        return sum(x.mean_ms for x in self.layers)

    @property
    def wall_mean_ms(self) -> float:
        return sum(self.wall_ms) / len(self.wall_ms) if self.wall_ms else 0.0

    def share(self, layer: LayerTime) -> float:
        total = self.layer_total_ms
        return layer.mean_ms / total if total > 0 else 0.0

    def by_op(self) -> list[OpTotal]:
        """Totals per op type, slowest first."""
        acc: dict[str, list] = {}
        for x in self.layers:
            a = acc.setdefault(x.op_type, [0, 0.0])
            a[0] += 1
            a[1] += x.mean_ms
        total = self.layer_total_ms or 1.0
        rows = [OpTotal(op, c, ms, ms / total) for op, (c, ms) in acc.items()]
        return sorted(rows, key=lambda r: -r.ms)

    def slowest(self, n: int) -> list[LayerTime]:
        return sorted(self.layers, key=lambda x: -x.mean_ms)[:n]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "backend": self.backend, "device": self.device,
            "runs": self.runs, "warmup": self.warmup, "wall_mean_ms": self.wall_mean_ms,
            "layer_total_ms": self.layer_total_ms, "wall_ms": self.wall_ms,
            "layers": [{"index": x.index, "name": x.name, "op_type": x.op_type,
                        "shape": x.shape, "placement": x.placement, "mean_ms": x.mean_ms,
                        "share": self.share(x), "once": x.once} for x in self.layers],
            "by_op": [vars(r) for r in self.by_op()],
        }

    def to_chrome_trace(self) -> dict[str, Any]:
        """The measured runs in Chrome's trace-event format: one complete ("X") event per
        run and per layer call, times in microseconds from the first run's start."""
        pid, tid = os.getpid(), 1
        t0 = self.run_starts[0] if self.run_starts else 0.0

        def us(t: float) -> float:
            return round((t - t0) * 1e6, 3)

        ev: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": pid, "tid": tid,
             "args": {"name": f"kiln {self.model}"}},
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
             "args": {"name": f"{self.backend} on {self.device}"}},
        ]
        for r, (start, wall) in enumerate(zip(self.run_starts, self.wall_ms)):
            ev.append({"name": f"run {r}", "cat": "run", "ph": "X", "pid": pid, "tid": tid,
                       "ts": us(start), "dur": round(wall * 1e3, 3), "args": {"run": r}})
        for r, i, a, b in self.events:
            x = self.layers[i]
            ev.append({"name": x.name, "cat": x.op_type, "ph": "X", "pid": pid, "tid": tid,
                       "ts": us(a), "dur": round((b - a) * 1e6, 3),
                       "args": {"op": x.op_type, "layer": x.index, "run": r,
                                "shape": str(x.shape), "placement": x.placement}})
        return {"traceEvents": ev, "displayTimeUnit": "ms",
                "otherData": {"model": self.model, "backend": self.backend,
                              "device": self.device, "runs": self.runs}}

    def save_trace(self, path: str | os.PathLike) -> Path:
        p = Path(path)
        p.write_text(json.dumps(self.to_chrome_trace()))
        return p


def _shape_of(result) -> list[int] | None:
    r = result[0] if isinstance(result, tuple) and result else result
    if isinstance(r, list):
        return [len(r)]
    s = getattr(r, "shape", None)
    return None if s is None else [int(d) for d in s]


def _sync_fn(backend):
    if getattr(backend, "is_cuda", False):
        import torch
        dev = backend.tdevice
        return lambda: torch.cuda.synchronize(dev)
    return None


def profile(model_or_session: Any, feeds: dict | None = None, runs: int = 10,
            warmup: int = 1, backend: str | None = None, device: str | None = None,
            dims: dict[str, int] | None = None, seed: int = 0, optimize: bool = True
            ) -> Profile:
    """Run a model ``warmup + runs`` times and time every layer of the measured runs.

    ``model_or_session``: an InferenceSession, or anything ``kiln.load`` takes (a session
    is then made on ``backend``/``device``; None: as a session given no backend).
    ``feeds`` default to random inputs of the declared shapes (symbolic dims sized by
    ``dims``, default 1). The session made here
    is optimized, as sessions are by default, unless ``optimize`` is False. On CUDA each layer is
    synchronized, so its time is its own, not its launch.
    """
    from kiln.session_api import InferenceSession

    sess = model_or_session if isinstance(model_or_session, InferenceSession) \
        else session_for(model_or_session, backend, device, optimize=optimize)
    name = model_name(model_or_session) if not isinstance(model_or_session, InferenceSession) \
        else (sess.model.graph.name or "model")
    if feeds is None:
        feeds = random_feeds(sess.model, dims, seed)
    be = sess.backend
    inputs = sess.check_feed(feeds)
    plan = sess.plan
    index = {s: i for i, s in enumerate(plan.steps)}
    layers = [LayerTime(i, s.node.name or f"{s.node.op_type}_{i}", s.node.op_type, None,
                        s.placement) for i, s in enumerate(plan.steps)]
    sync = _sync_fn(be)
    events: list[tuple[int, int, float, float]] = []
    run_no = [-1]
    first = [True]

    def observe(step, t0, t1, result):
        if sync is not None:
            sync()
            t1 = perf_counter()
        i = index[step]
        if first[0]:
            layers[i].shape = _shape_of(result)
        if run_no[0] >= 0:
            events.append((run_no[0], i, t0, t1))

    walls, starts = [], []
    with be.run_context():
        # Layers that depend only on the inputs' shapes run once per shape in a session's
        # runs: one plain run first, so the measured runs skip them as real runs do.
        program = plan.program
        if program is not None and program.memo is not None:
            run_no[0] = -warmup - 1
            plan.run(inputs, None, None, observer=observe)  # every layer: their shapes
            plan.run(inputs)  # the program keeps the shape-only values
            for i in program.once:
                layers[i].once = True
        for r in range(-warmup, runs):
            run_no[0] = r
            first[0] = r == -warmup
            t0 = perf_counter()
            plan.run(inputs, None, None, observer=observe)
            if sync is not None:
                sync()
            t1 = perf_counter()
            if r >= 0:
                starts.append(t0)
                walls.append((t1 - t0) * 1e3)
    for _, i, a, b in events:
        layers[i].times_ms.append((b - a) * 1e3)
    return Profile(name, be.name, getattr(be, "device", "cpu"), runs, warmup, layers, walls,
                   starts, events)


__all__ = ["LayerTime", "OpTotal", "Profile", "profile"]
