"""``kiln serve``: models behind the Open Inference Protocol (KServe v2), over HTTP/REST
and gRPC, with dynamic batching, Prometheus metrics, an optional bearer token and a
repository API to load and unload models; the same ASGI app runs on Ray Serve
(``kiln.serving.ray``). Needs ``pip install -e ".[serve]"``.

    import kiln
    kiln.serve(["model.onnx"], http_port=8000, grpc_port=8001)   # blocks until SIGTERM

The package is ``kiln.serving``; ``kiln.serve`` is the function, so the one name never
means two things. Importing this package needs no serve extra: the HTTP and gRPC front
ends import Starlette and grpc only when a server starts.
"""

from kiln.serving.models import ModelConfig, Repository
from kiln.serving.server import serve, serve_async
from kiln.serving.service import Service

__all__ = ["ModelConfig", "Repository", "Service", "serve", "serve_async"]
