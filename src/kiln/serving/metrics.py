"""Prometheus metrics of one server, in its own registry (two servers in one process,
as in the tests, do not mix counts)."""

from __future__ import annotations

from kiln.errors import MissingDependencyError
from kiln.serving.batching import Execution

SERVE_INSTALL = 'pip install -e ".[serve]"'


def _prometheus():
    try:
        import prometheus_client
    except ImportError:
        raise MissingDependencyError(
            "prometheus-client", SERVE_INSTALL, "kiln serve's /metrics"
        ) from None
    return prometheus_client


class Metrics:
    """Requests, failures, latency, queue time, compute time and batch sizes per model."""

    def __init__(self) -> None:
        p = _prometheus()
        self._p = p
        self._children: dict[tuple, object] = {}
        self.registry = p.CollectorRegistry()
        r = self.registry
        self.requests = p.Counter(
            "kiln_requests",
            "Inference requests answered",
            ["model", "protocol", "code"],
            registry=r,
        )
        self.latency = p.Histogram(
            "kiln_request_seconds", "Successful requests, arrival to outputs", ["model"], registry=r
        )
        self.queue = p.Histogram(
            "kiln_queue_seconds", "Time a request waited for its run", ["model"], registry=r
        )
        self.compute = p.Histogram(
            "kiln_compute_seconds", "Time of one (batched) run", ["model"], registry=r
        )
        self.batch = p.Histogram(
            "kiln_batch_size",
            "Rows per run",
            ["model"],
            registry=r,
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
        )

    def _child(self, metric, *labels: str):
        # prometheus_client's labels() validates and hashes its arguments on every call;
        # a request would pay that five times, so each labelled child is looked up once
        key = (metric, labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def count(self, model: str, protocol: str, code: int, seconds: float | None = None) -> None:
        """One request answered with ``code`` (and its latency when it succeeded)."""
        self._child(self.requests, model, protocol, str(code)).inc()
        if seconds is not None:
            self._child(self.latency, model).observe(seconds)

    def observe_batch(self, model: str, run: Execution) -> None:
        """One run of the model, after its requests waited in the queue."""
        self._child(self.batch, model).observe(run.rows)
        self._child(self.compute, model).observe(run.input_s + run.infer_s + run.output_s)
        queue = self._child(self.queue, model)
        for w in run.waits:
            queue.observe(w)

    def exposition(self) -> tuple[bytes, str]:
        """The text format and its content type."""
        return self._p.generate_latest(self.registry), self._p.CONTENT_TYPE_LATEST
