"""Triton's statistics extension: per model version, the count and cumulative time of
successful and failed requests, queueing, and the three phases of a run (joining the
inputs, the model's run, splitting the outputs), overall and per batch size. Updated and
read in the server's event loop only, so it needs no lock."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kiln.serving.batching import Execution

PHASES = ("compute_input", "compute_infer", "compute_output")


@dataclass
class Duration:
    """A count and the nanoseconds they took together (Triton's StatisticDuration)."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, count: int = 1) -> None:
        """``count`` more, that took ``seconds`` each."""
        self.count += count
        self.ns += int(seconds * 1e9) * count

    def as_json(self) -> dict:
        """``{"count": ..., "ns": ...}``."""
        return {"count": self.count, "ns": self.ns}


@dataclass
class Statistics:
    """What one loaded model version has served since it was loaded."""

    inference_count: int = 0  # rows of successful requests (a batch-4 request counts 4)
    execution_count: int = 0  # runs of the model (a merged batch is one)
    last_inference_ms: int = 0  # when the last request finished, ms since the epoch
    success: Duration = field(default_factory=Duration)  # arrival to outputs
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    phases: dict[str, Duration] = field(
        default_factory=lambda: {p: Duration() for p in PHASES}
    )  # per request: a request counts its batch's whole time, as Triton's do
    batches: dict[int, dict[str, Duration]] = field(default_factory=dict)  # per run

    def executed(self, model: str, run: Execution) -> None:
        """One run of ``run.rows`` rows for ``len(run.waits)`` requests (a batcher
        observer)."""
        self.execution_count += 1
        times = dict(zip(PHASES, (run.input_s, run.infer_s, run.output_s)))
        per_size = self.batches.setdefault(run.rows, {p: Duration() for p in PHASES})
        served = len(run.waits) - run.failed
        for phase, seconds in times.items():
            per_size[phase].add(seconds)
            self.phases[phase].add(seconds, served)
        for w in run.waits:
            self.queue.add(w)

    def answered(self, rows: int, seconds: float, ok: bool) -> None:
        """One request of ``rows`` rows answered after ``seconds`` (``ok``: with
        outputs)."""
        if ok:
            self.success.add(seconds)
            self.inference_count += rows
        else:
            self.fail.add(seconds)
        self.last_inference_ms = int(time.time() * 1000)

    def as_json(self, name: str, version: str) -> dict:
        """The ``$model_stat`` object of Triton's statistics extension."""
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                "success": self.success.as_json(),
                "fail": self.fail.as_json(),
                "queue": self.queue.as_json(),
                **{p: d.as_json() for p, d in self.phases.items()},
                # Kiln has no response cache: nothing hits or misses one
                "cache_hit": Duration().as_json(),
                "cache_miss": Duration().as_json(),
            },
            "batch_stats": [
                {"batch_size": size, **{p: d.as_json() for p, d in phases.items()}}
                for size, phases in sorted(self.batches.items())
            ],
            "memory_usage": [],
        }
