"""``kiln serve``'s HTTP app as a Ray Serve application: each replica loads the models and
answers the Open Inference Protocol with the same ASGI app ``kiln serve`` runs, batching
within the replica; Ray Serve's proxy spreads requests over replicas and its autoscaler
adds and removes them.

    from ray import serve
    from kiln.serving.ray import application
    serve.run(application(["model.onnx"], num_replicas=2), route_prefix="/")

Model paths must be readable on every node that hosts a replica (a shared or copied
folder). Needs ``pip install -e ".[serve,ray]"``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from kiln.errors import MissingDependencyError
from kiln.runtime.backends import backend_entry
from kiln.serving.http import build_app
from kiln.serving.models import ModelConfig, Repository
from kiln.serving.service import Service


def _serve() -> Any:
    try:
        from ray import serve
    except ImportError:
        raise MissingDependencyError(
            "ray[serve]", 'pip install "ray[serve]"', "kiln serve on Ray Serve"
        ) from None
    return serve


class KilnReplica:
    """One Ray Serve replica: the models and the Open Inference Protocol app over them."""

    def __init__(
        self,
        models: Sequence[str],
        model_repository: str | None,
        config: ModelConfig | None,
        token: str | None,
        max_request_bytes: int,
    ):
        repo = Repository(list(models), model_repository, config)
        self.service = Service(repo, token=token, max_request_bytes=max_request_bytes)

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self.service)


def application(
    models: Sequence[str | os.PathLike] = (),
    model_repository: str | None = None,
    *,
    config: ModelConfig | None = None,
    token: str | None = None,
    max_request_bytes: int = 64 << 20,
    num_replicas: int | str = 1,
    autoscaling_config: dict | None = None,
    num_cpus: float = 1,
    max_ongoing_requests: int = 64,
) -> Any:
    """A bound Ray Serve application serving ``models`` / ``model_repository`` like
    ``kiln serve``; run it with ``serve.run(app, route_prefix="/")`` (the protocol's
    routes start at /v2). ``autoscaling_config`` (Ray Serve's) replaces ``num_replicas``;
    ``num_cpus`` is reserved per replica and, unless ``config`` sets threads, used as its
    run threads."""
    serve = _serve()
    config = config or ModelConfig()
    if config.threads is None and backend_entry(config.backend).threads_per_run:
        config.threads = max(1, int(num_cpus))
    options: dict[str, Any] = {
        "ray_actor_options": {"num_cpus": num_cpus},
        "max_ongoing_requests": max_ongoing_requests,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = autoscaling_config
    else:
        options["num_replicas"] = num_replicas
    cls = serve.deployment(serve.ingress()(KilnReplica), name="kiln").options(**options)
    return cls.bind(
        [str(os.path.abspath(m)) for m in models],
        os.path.abspath(model_repository) if model_repository else None,
        config,
        token,
        max_request_bytes,
    )
