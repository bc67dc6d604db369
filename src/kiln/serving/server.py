"""One process serving HTTP (uvicorn) and gRPC (grpc.aio) in one event loop; SIGTERM or
SIGINT stops taking connections and lets the requests in flight finish."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kiln.errors import MissingDependencyError
from kiln.serving.metrics import SERVE_INSTALL
from kiln.serving.models import ModelConfig, Repository
from kiln.serving.service import Service

log = logging.getLogger("kiln.serving")


def _uvicorn():
    try:
        import uvicorn
    except ImportError:
        raise MissingDependencyError("uvicorn", SERVE_INSTALL, "kiln serve") from None
    return uvicorn


async def serve_async(
    service: Service,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int | None = 8001,
    grace_s: float = 30.0,
    started: asyncio.Event | None = None,
) -> None:
    """Serve ``service`` until SIGTERM/SIGINT (or the task is cancelled), then finish the
    requests in flight for up to ``grace_s`` seconds. ``grpc_port`` None: HTTP only."""
    uvicorn = _uvicorn()
    # here, not at the top: ``import kiln`` names this function without the serve extra
    from kiln.serving.http import serving_app
    from kiln.serving.rpc import build_server

    class _Server(uvicorn.Server):
        # uvicorn re-raises a caught signal once it stops, which would end the process
        # before gRPC drained; this server's owner handles the signals instead.
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    try:  # built on uvicorn's httptools protocol, whose module may move in a later uvicorn
        from kiln.serving.connection import connection_class

        protocol: Any = connection_class(service.max_request_bytes)
    except ImportError:  # then uvicorn's own protocol: slower for large bodies, as correct
        protocol = "auto"
    config = uvicorn.Config(
        serving_app(service),
        host=host,
        port=http_port,
        log_level="warning",
        timeout_graceful_shutdown=int(grace_s),
        lifespan="off",
        http=protocol,
    )
    http = _Server(config)
    rpc = build_server(service, f"{host}:{grpc_port}") if grpc_port is not None else None
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    if rpc is not None:
        await rpc.start()
    task = asyncio.create_task(http.serve())
    while not http.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():
        await task  # binding failed: let its error out
        raise OSError(f"could not serve HTTP on {host}:{http_port}")
    ports = {
        "http": http.servers[0].sockets[0].getsockname()[1],
        "grpc": rpc.kiln_port if rpc is not None else None,
    }
    service.ports = ports
    log.info(
        json.dumps(
            {
                "event": "serving",
                "host": host,
                **ports,
                "models": [m.name for m in service.repository.loaded()],
            }
        )
    )
    print(
        f"kiln serve: HTTP on {host}:{ports['http']}"
        + (f", gRPC on {host}:{ports['grpc']}" if rpc is not None else "")
        + f"; models: {', '.join(m.name for m in service.repository.loaded()) or 'none'}",
        file=sys.stderr,
        flush=True,
    )
    if started is not None:
        started.set()
    try:
        await stop.wait()
    finally:
        http.should_exit = True
        if rpc is not None:
            await rpc.stop(grace_s)
        await task
        for m in service.repository.loaded():
            m.batcher.close()


def serve(
    models: Sequence[str | os.PathLike] = (),
    model_repository: str | None = None,
    *,
    host: str = "127.0.0.1",
    http_port: int = 8000,
    grpc_port: int | None = 8001,
    token: str | None = None,
    max_request_bytes: int = 64 << 20,
    config: ModelConfig | None = None,
) -> None:
    """Serve ``models`` (ONNX files, each named by its file stem) and/or every model of
    ``model_repository`` (Triton's ``name/version/model.onnx`` layout) over the Open
    Inference Protocol until SIGTERM/SIGINT. Blocks. ``config`` holds the defaults for
    every model (a repository model's ``config.json`` overrides them)."""
    if not log.handlers:  # one JSON object per line on stderr: loads, unloads, failures
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
    repo = Repository(models, model_repository, config)
    service = Service(repo, token=token, max_request_bytes=max_request_bytes)
    asyncio.run(serve_async(service, host, http_port, grpc_port))
