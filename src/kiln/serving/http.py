"""The Open Inference Protocol over HTTP/REST as a Starlette (ASGI) app: the same app
runs under uvicorn (``kiln serve``) and inside Ray Serve. Errors are ``{"error": ...}``
with the status the protocol uses."""

from __future__ import annotations

import asyncio
import json
import re
import zlib
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kiln.serving import tensors
from kiln.serving.service import (
    EXTENSIONS,
    VERSION,
    BadRequest,
    Service,
    TooLarge,
    message_of,
    status_of,
)
from kiln.serving.shm import SharedMemory

HEADER_LENGTH = "inference-header-content-length"
INFER_PATH = re.compile(r"/v2/models/(?P<name>[^/]+)(?:/versions/(?P<version>[^/]+))?/infer")
"""The inference routes, as Starlette's routes below match them (``{name}``: ``[^/]+``)."""

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


def _error(e: BaseException) -> Response:
    code = status_of(e)[0]
    headers = {"Retry-After": "1"} if code == 503 else None
    return JSONResponse({"error": message_of(e)}, status_code=code, headers=headers)


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused past ``limit`` bytes (also once decompressed)."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge(
            f"the request has {int(declared)} bytes; this server takes at most "
            f"{limit} (--max-request-size)"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise TooLarge(
                f"the request is over {limit} bytes, this server's limit (--max-request-size)"
            )
        if chunk:
            chunks.append(chunk)
    # one piece (the whole body, as kiln serve's connection hands it over) is not copied
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity")
    if encoding in ("gzip", "deflate"):
        d = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
        try:
            body = d.decompress(body, limit + 1)
        except zlib.error as e:
            raise BadRequest(f"the {encoding} body does not decompress: {e}") from None
        if len(body) > limit:
            raise TooLarge(
                f"the request decompresses to over {limit} bytes, this server's "
                "limit (--max-request-size)"
            )
    elif encoding != "identity":
        raise BadRequest(f"Content-Encoding {encoding!r} is not supported (gzip, deflate)")
    return body


def _parse(body: bytes, header_length: str | None) -> tuple[dict, memoryview]:
    raw = memoryview(body)
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise BadRequest(
                f"Inference-Header-Content-Length {header_length!r} does not "
                f"fit a body of {len(body)} bytes"
            )
        n = int(header_length)
        head, raw = body[:n], raw[n:]
    else:
        head, raw = body, raw[len(body) :]
    try:
        req = json.loads(head)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"the request is not valid JSON: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise BadRequest("an inference request is a JSON object with an 'inputs' list")
    return req, raw


def _shm_of(name: str, params: Any) -> tuple[str, int, int] | None:
    """(region, offset, byte size) when ``params`` place tensor ``name`` in shared memory."""
    if not isinstance(params, dict) or "shared_memory_region" not in params:
        return None
    region = params["shared_memory_region"]
    size = params.get("shared_memory_byte_size")
    offset = params.get("shared_memory_offset", 0)
    if not isinstance(region, str) or not isinstance(size, int) or not isinstance(offset, int):
        raise BadRequest(
            f"tensor {name!r}: shared_memory_region is a name, shared_memory_byte_size "
            "and shared_memory_offset are integers"
        )
    return region, offset, size


def _decode(req: dict, raw: memoryview, shm: SharedMemory) -> dict[str, Any]:
    feed, pos = {}, 0
    for i, t in enumerate(req["inputs"]):
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise BadRequest(f"input #{i} is not an object with a 'name'")
        name = t["name"]
        shape = tensors.check_shape(name, t.get("shape"))
        params = t.get("parameters") or {}
        size = params.get("binary_data_size") if isinstance(params, dict) else None
        place = _shm_of(name, params)
        if place is not None:
            data = shm.read(place[0], name, place[1], place[2])
            feed[name] = tensors.from_bytes(name, t.get("datatype"), shape, data)
        elif size is not None:
            if not isinstance(size, int) or size < 0 or pos + size > len(raw):
                raise BadRequest(
                    f"input {name!r}: binary_data_size {size!r} runs past the "
                    f"{len(raw)} bytes of binary data"
                )
            feed[name] = tensors.from_bytes(name, t.get("datatype"), shape, raw[pos : pos + size])
            pos += size
        elif "data" in t:
            feed[name] = tensors.from_json(name, t.get("datatype"), shape, t["data"])
        else:
            raise BadRequest(f"input {name!r} has neither 'data' nor a binary_data_size")
    if pos != len(raw):
        raise BadRequest(f"{len(raw) - pos} bytes of binary data belong to no input")
    return feed


def _wanted(req: dict) -> tuple[list[str] | None, dict[str, bool], dict[str, tuple]]:
    """The outputs asked for (None: all), which travel as binary data, and which go to
    shared memory (name -> region, offset, byte size)."""
    default = bool((req.get("parameters") or {}).get("binary_data_output", False))
    outs = req.get("outputs")
    if outs is None:
        return None, {"*": default}, {}
    if not isinstance(outs, list) or not all(isinstance(o, dict) and "name" in o for o in outs):
        raise BadRequest("'outputs' must be a list of objects with a 'name'")
    binary = {
        o["name"]: bool((o.get("parameters") or {}).get("binary_data", default)) for o in outs
    }
    places = {o["name"]: _shm_of(o["name"], o.get("parameters")) for o in outs}
    return [o["name"] for o in outs], binary, {n: p for n, p in places.items() if p}


def _compressed(body: bytes, accept: str) -> tuple[bytes, dict[str, str]]:
    """``body`` compressed with the first of gzip and deflate ``accept`` (the request's
    Accept-Encoding) names with a non-zero weight, as Triton's HTTP endpoint does."""
    offered = {}
    for part in accept.split(","):
        coding, _, params = part.strip().partition(";")
        q = params.strip().removeprefix("q=") if params.strip().startswith("q=") else "1"
        try:
            offered[coding.strip().lower()] = float(q)
        except ValueError:
            offered[coding.strip().lower()] = 0.0
    for coding in ("gzip", "deflate"):
        if offered.get(coding, 0) > 0:
            # gzip: zlib's gzip wrapper; deflate means the zlib format (RFC 9110 8.4.1.2)
            c = zlib.compressobj(wbits=zlib.MAX_WBITS | 16 if coding == "gzip" else zlib.MAX_WBITS)
            return c.compress(body) + c.flush(), {"Content-Encoding": coding}
    return body, {}


def _encode(
    served: Any,
    rid: Any,
    results: dict,
    binary: dict[str, bool],
    accept: str | None = None,
    shm: SharedMemory | None = None,
    places: dict[str, tuple] | None = None,
) -> Response:
    outputs, blobs = [], []
    for name, arr in results.items():
        out: dict[str, Any] = {
            "name": name,
            "datatype": tensors.datatype_of(arr),
            "shape": list(arr.shape),
        }
        if places and name in places:
            region, offset, size = places[name]
            blob = tensors.to_bytes(arr)
            shm.write(region, name, offset, size, blob)
            out["parameters"] = {
                "shared_memory_region": region,
                "shared_memory_byte_size": len(blob),
            }
            if offset:
                out["parameters"]["shared_memory_offset"] = offset
        elif binary.get(name, binary.get("*", False)):
            blob = tensors.to_bytes(arr)
            out["parameters"] = {"binary_data_size": len(blob)}
            blobs.append(blob)
        else:
            out["data"] = tensors.to_json(arr)
        outputs.append(out)
    resp: dict[str, Any] = {
        "model_name": served.name,
        "model_version": served.version,
        "outputs": outputs,
    }
    if rid is not None:
        resp["id"] = rid
    head = json.dumps(resp, separators=(",", ":")).encode()
    body, headers = (
        _compressed(b"".join([head, *blobs]), accept) if accept else (b"".join([head, *blobs]), {})
    )
    if not blobs:
        return Response(body, media_type="application/json", headers=headers)
    # the header length counts the uncompressed JSON, as Triton's clients read it
    headers["Inference-Header-Content-Length"] = str(len(head))
    return Response(body, media_type="application/octet-stream", headers=headers)


def build_app(service: Service) -> Starlette:
    """The ASGI app answering the Open Inference Protocol's HTTP routes for ``service``."""
    return _build(service)[0]


def serving_app(service: Service) -> ASGIApp:
    """:func:`build_app`'s app with its inference routes (POST) answered before
    Starlette's machinery: the same handler and the same response object, without the two
    error middlewares, the router's walk and the wrapping of ``send`` that every request
    otherwise passes through (``kiln serve``'s HTTP app; Ray Serve takes the Starlette
    app itself)."""
    app, infer = _build(service)
    match = INFER_PATH.fullmatch

    async def asgi(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            m = match(scope["path"])
            if m is not None:
                name, version = m.group("name", "version")
                scope["path_params"] = {"name": name} if version is None else \
                    {"name": name, "version": version}
                response = await infer(Request(scope, receive))
                await response(scope, receive, send)
                return
        await app(scope, receive, send)

    return asgi


def _build(service: Service) -> tuple[Starlette, Callable[[Request], Awaitable[Response]]]:
    """The Starlette app and its guarded inference endpoint."""

    def guarded(handler, public: bool = False):
        async def endpoint(request: Request) -> Response:
            try:
                if not public:
                    service.authorize(request.headers.get("authorization"))
                return await handler(request)
            except Exception as e:  # noqa: BLE001 - every failure is an error response
                return _error(e)

        return endpoint

    def model_of(request: Request):
        p = request.path_params
        return service.repository.get(p["name"], p.get("version", ""))

    async def live(request: Request) -> Response:
        return JSONResponse({"live": True})

    async def ready(request: Request) -> Response:
        ok = bool(service.repository.loaded())
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def server_metadata(request: Request) -> Response:
        return JSONResponse({"name": "kiln", "version": VERSION, "extensions": EXTENSIONS})

    async def model_metadata(request: Request) -> Response:
        return JSONResponse(model_of(request).metadata())

    async def model_config(request: Request) -> Response:
        return JSONResponse(model_of(request).model_config())

    async def statistics(request: Request) -> Response:
        p = request.path_params
        return JSONResponse(
            {"model_stats": service.statistics(p.get("name", ""), p.get("version", ""))}
        )

    async def model_ready(request: Request) -> Response:
        model_of(request)
        return JSONResponse({"name": request.path_params["name"], "ready": True})

    async def infer(request: Request) -> Response:
        served = model_of(request)
        body = await _body(request, service.max_request_bytes)
        req, raw = _parse(body, request.headers.get(HEADER_LENGTH))
        feed = _decode(req, raw, service.shm)
        wanted, binary, places = _wanted(req)
        results = await service.infer(served, feed, wanted, "http")
        return _encode(
            served,
            req.get("id"),
            results,
            binary,
            request.headers.get("accept-encoding"),
            service.shm,
            places,
        )

    async def index(request: Request) -> Response:
        return JSONResponse(service.repository.index())

    async def load(request: Request) -> Response:
        await asyncio.to_thread(service.load, request.path_params["name"])
        return JSONResponse({})

    async def unload(request: Request) -> Response:
        service.unload(request.path_params["name"])
        return JSONResponse({})

    async def shm_status(request: Request) -> Response:
        return JSONResponse(service.shm.status(request.path_params.get("region", "")))

    async def shm_register(request: Request) -> Response:
        body = await _body(request, 1 << 16)
        try:
            spec = json.loads(body)
        except ValueError as e:
            raise BadRequest(f"the request is not valid JSON: {e}") from None
        if not isinstance(spec, dict) or not isinstance(spec.get("key"), str):
            raise BadRequest("a registration is a JSON object with 'key', 'offset', 'byte_size'")
        service.shm.register(
            request.path_params["region"],
            spec["key"],
            spec.get("offset", 0),
            spec.get("byte_size"),
        )
        return JSONResponse({})

    async def shm_unregister(request: Request) -> Response:
        service.shm.unregister(request.path_params.get("region", ""))
        return JSONResponse({})

    async def metrics(request: Request) -> Response:
        body, ctype = service.metrics.exposition()
        return Response(body, media_type=ctype)

    model = "/v2/models/{name}"
    version = "/v2/models/{name}/versions/{version}"
    # Starlette tries the routes in order, each a regular expression: inference first
    routes = [Route(base + "/infer", guarded(infer), methods=["POST"]) for base in (model, version)]
    routes += [
        Route("/v2/health/live", guarded(live, public=True)),
        Route("/v2/health/ready", guarded(ready, public=True)),
        Route("/v2", guarded(server_metadata)),
        Route("/metrics", guarded(metrics)),
        # before /v2/models/{name}: "stats" here is the route, not a model's name
        Route("/v2/models/stats", guarded(statistics)),
        Route("/v2/repository/index", guarded(index), methods=["POST"]),
        Route("/v2/systemsharedmemory/status", guarded(shm_status)),
        Route("/v2/systemsharedmemory/region/{region}/status", guarded(shm_status)),
        Route(
            "/v2/systemsharedmemory/region/{region}/register",
            guarded(shm_register),
            methods=["POST"],
        ),
        Route("/v2/systemsharedmemory/unregister", guarded(shm_unregister), methods=["POST"]),
        Route(
            "/v2/systemsharedmemory/region/{region}/unregister",
            guarded(shm_unregister),
            methods=["POST"],
        ),
        Route("/v2/repository/models/{name}/load", guarded(load), methods=["POST"]),
        Route("/v2/repository/models/{name}/unload", guarded(unload), methods=["POST"]),
    ]
    for base in (model, version):
        routes += [
            Route(base, guarded(model_metadata)),
            Route(base + "/ready", guarded(model_ready)),
            Route(base + "/config", guarded(model_config)),
            Route(base + "/stats", guarded(statistics)),
        ]

    async def no_route(request: Request, exc: HTTPException) -> Response:
        return JSONResponse(
            {
                "error": f"{request.method} {request.url.path}: {exc.detail}; "
                "the routes are the Open Inference Protocol's (/v2/...)"
            },
            status_code=exc.status_code,
        )

    app = Starlette(routes=routes, exception_handlers={404: no_route, 405: no_route})
    return app, routes[0].endpoint
