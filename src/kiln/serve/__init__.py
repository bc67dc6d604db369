"""``kiln serve``: models behind the Open Inference Protocol (KServe v2), over HTTP/REST
and gRPC, with dynamic batching, Prometheus metrics, an optional bearer token and a
repository API to load and unload models; the same ASGI app runs on Ray Serve
(``kiln.serve.ray``). Needs ``pip install -e ".[serve]"``.

    from kiln.serve import serve
    serve(["model.onnx"], http_port=8000, grpc_port=8001)   # blocks until SIGTERM
"""

from kiln.serve.models import ModelConfig, Repository
from kiln.serve.server import serve, serve_async
from kiln.serve.service import Service

__all__ = ["ModelConfig", "Repository", "Service", "serve", "serve_async"]
