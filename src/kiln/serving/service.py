"""What the HTTP and gRPC front ends share: the models, the metrics, the token, the size
limit, and how a decoded request becomes outputs and an error becomes a status."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field

import numpy as np

from kiln.errors import InputError, KilnError, ModelLoadError, ShapeError, UnsupportedOpError
from kiln.serving.batching import Overloaded
from kiln.serving.metrics import Metrics
from kiln.serving.models import ModelNotFound, Repository, ServedModel
from kiln.serving.shm import RegionError, SharedMemory

log = logging.getLogger("kiln.serving")

VERSION = "0.1.0"
EXTENSIONS = [
    "binary_tensor_data",
    "model_repository",
    "model_configuration",
    "statistics",
    "system_shared_memory",
]


class Unauthorized(KilnError):
    """The request lacks the server's bearer token."""


class TooLarge(KilnError):
    """The request is larger than the server's limit (``--max-request-size``)."""


class BadRequest(KilnError):
    """The request is not a well-formed Open Inference Protocol message."""


# exception type -> (HTTP status, gRPC status code name); the first match wins
STATUS: list[tuple[type, int, str]] = [
    (ModelNotFound, 404, "NOT_FOUND"),
    (Overloaded, 503, "UNAVAILABLE"),
    (Unauthorized, 401, "UNAUTHENTICATED"),
    (TooLarge, 413, "RESOURCE_EXHAUSTED"),
    (BadRequest, 400, "INVALID_ARGUMENT"),
    (InputError, 400, "INVALID_ARGUMENT"),
    (ShapeError, 400, "INVALID_ARGUMENT"),
    (ModelLoadError, 400, "INVALID_ARGUMENT"),
    (RegionError, 400, "INVALID_ARGUMENT"),
    (UnsupportedOpError, 400, "INVALID_ARGUMENT"),
    (KilnError, 500, "INTERNAL"),
]


def status_of(error: BaseException) -> tuple[int, str]:
    """The HTTP status and gRPC code for ``error`` (500/INTERNAL when unexpected)."""
    for kind, http, grpc in STATUS:
        if isinstance(error, kind):
            return http, grpc
    return 500, "INTERNAL"


def message_of(error: BaseException) -> str:
    """What the client is told: Kiln's own message, or the failure's type and text."""
    if isinstance(error, KilnError):
        return str(error)
    return f"the model's run failed: {type(error).__name__}: {error}"


@dataclass
class Service:
    """The state both front ends serve from."""

    repository: Repository
    token: str | None = None
    max_request_bytes: int = 64 << 20
    metrics: Metrics = field(default_factory=Metrics)
    ports: dict[str, int | None] = field(default_factory=dict)  # set once listening
    shm: SharedMemory = field(default_factory=SharedMemory)  # registered regions

    def __post_init__(self) -> None:
        for m in self.repository.loaded():
            m.batcher.observers.append(self.metrics.observe_batch)

    def authorize(self, header: str | None) -> None:
        """Refuse unless ``header`` is ``Bearer <token>`` (when a token is set)."""
        if self.token is None:
            return
        want = f"Bearer {self.token}".encode()
        if header is None or not hmac.compare_digest(header.encode(), want):
            raise Unauthorized(
                "this server needs 'Authorization: Bearer <token>' with the "
                "token it was started with"
            )

    def load(self, name: str) -> ServedModel:
        """(Re)load ``name`` from the repository and start counting its batches."""
        served = self.repository.load(name)
        served.batcher.observers.append(self.metrics.observe_batch)
        log.info(json.dumps({"event": "load", "model": name, "version": served.version}))
        return served

    def statistics(self, name: str = "", version: str = "") -> list[dict]:
        """Triton's ``model_stats`` list: of ``name`` (at ``version``), or of every loaded
        model when ``name`` is empty."""
        models = [self.repository.get(name, version)] if name else self.repository.loaded()
        return [m.stats.as_json(m.name, m.version) for m in sorted(models, key=lambda m: m.name)]

    def unload(self, name: str) -> None:
        """Unload ``name``; its queued requests still finish."""
        self.repository.unload(name)
        log.info(json.dumps({"event": "unload", "model": name}))

    def _answered(self, served: ServedModel, protocol: str, feed: dict, took: float) -> None:
        self.metrics.count(served.name, protocol, 200, took)
        served.stats.answered(served.rows_of(feed), took, ok=True)

    async def infer(
        self,
        served: ServedModel,
        feed: dict[str, np.ndarray],
        wanted: list[str] | None,
        protocol: str,
    ) -> dict[str, np.ndarray]:
        """Run ``feed`` through ``served``'s queue; the outputs named in ``wanted`` (all
        when None) by name. Counts the request and logs a failure."""
        start = time.perf_counter()
        try:
            names = [s.name for s in served.outputs]
            for w in wanted or []:
                if w not in names:
                    raise InputError(
                        f"model {served.name!r} has no output {w!r}; its "
                        f"outputs are {', '.join(names)}"
                    )
            served.check_feed(feed)
            outs = await served.batcher.submit(feed)
        except Exception as e:
            self.metrics.count(served.name, protocol, status_of(e)[0])
            served.stats.answered(0, time.perf_counter() - start, ok=False)
            log.warning(
                json.dumps(
                    {
                        "event": "infer_failed",
                        "model": served.name,
                        "protocol": protocol,
                        "error": message_of(e),
                    }
                )
            )
            raise
        # counted once the response has left (see Batcher._run_inline)
        asyncio.get_running_loop().call_soon(
            self._answered, served, protocol, feed, time.perf_counter() - start
        )
        result = dict(zip(names, outs))
        return {n: result[n] for n in (wanted or names)}
