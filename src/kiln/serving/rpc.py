"""The Open Inference Protocol over gRPC (``inference.GRPCInferenceService``) on grpc.aio,
in the same event loop as the HTTP app. Tensors come as ``raw_input_contents`` (what
tritonclient sends) or typed ``contents``; outputs go back as ``raw_output_contents``."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
from google.protobuf import json_format

from kiln.errors import MissingDependencyError
from kiln.serving import tensors
from kiln.serving.metrics import SERVE_INSTALL
from kiln.serving.models import ModelNotFound
from kiln.serving.protocol import MESSAGES, SERVICE
from kiln.serving.service import EXTENSIONS, VERSION, BadRequest, Service, message_of, status_of
from kiln.serving.shm import SharedMemory

# KServe datatype -> the typed ``contents`` field that carries it
CONTENTS = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}


def _grpc():
    try:
        import grpc
    except ImportError:
        raise MissingDependencyError("grpcio", SERVE_INSTALL, "kiln serve's gRPC") from None
    return grpc


def _shm_of(params: Any) -> tuple[str, int, int] | None:
    """(region, offset, byte size) when ``params`` place a tensor in shared memory."""
    if "shared_memory_region" not in params:
        return None
    return (
        params["shared_memory_region"].string_param,
        params["shared_memory_offset"].int64_param if "shared_memory_offset" in params else 0,
        params["shared_memory_byte_size"].int64_param,
    )


def _decode(req: Any, shm: SharedMemory) -> dict[str, np.ndarray]:
    raw = list(req.raw_input_contents)
    places = [_shm_of(t.parameters) for t in req.inputs]
    in_raw = sum(p is None for p in places)  # raw contents are those of the other inputs
    if raw and len(raw) != in_raw:
        raise BadRequest(
            f"{len(raw)} raw_input_contents for {in_raw} inputs not in shared memory; "
            "send one per input or none"
        )
    feed, next_raw = {}, iter(raw)
    for t, place in zip(req.inputs, places):
        shape = tensors.check_shape(t.name, list(t.shape))
        if place is not None:
            data = shm.read(place[0], t.name, place[1], place[2])
            feed[t.name] = tensors.from_bytes(t.name, t.datatype, shape, data)
        elif raw:
            feed[t.name] = tensors.from_bytes(t.name, t.datatype, shape, next(next_raw))
        elif t.datatype in CONTENTS:
            feed[t.name] = tensors.from_json(
                t.name, t.datatype, shape, list(getattr(t.contents, CONTENTS[t.datatype]))
            )
        else:
            raise BadRequest(f"input {t.name!r}: {t.datatype!r} travels in raw_input_contents only")
    return feed


def _handlers(service: Service) -> dict[str, tuple[Any, str, str]]:
    """Method name -> (coroutine, request message, response message)."""
    M = MESSAGES

    async def live(req, ctx):
        return M["ServerLiveResponse"](live=True)

    async def ready(req, ctx):
        return M["ServerReadyResponse"](ready=bool(service.repository.loaded()))

    async def model_ready(req, ctx):
        # as Triton answers: an unknown model or version is not ready (no error status)
        try:
            service.repository.get(req.name, req.version)
        except ModelNotFound:
            return M["ModelReadyResponse"](ready=False)
        return M["ModelReadyResponse"](ready=True)

    async def server_metadata(req, ctx):
        return M["ServerMetadataResponse"](name="kiln", version=VERSION, extensions=EXTENSIONS)

    async def model_metadata(req, ctx):
        meta = service.repository.get(req.name, req.version).metadata()
        return M["ModelMetadataResponse"](**meta)

    async def model_config(req, ctx):
        config = service.repository.get(req.name, req.version).model_config()
        return M["ModelConfigResponse"](config=json_format.ParseDict(config, M["ModelConfig"]()))

    async def statistics(req, ctx):
        stats = {"model_stats": service.statistics(req.name, req.version)}
        return json_format.ParseDict(stats, M["ModelStatisticsResponse"]())

    async def infer(req, ctx):
        served = service.repository.get(req.model_name, req.model_version)
        wanted = [o.name for o in req.outputs] or None
        places = {o.name: _shm_of(o.parameters) for o in req.outputs}
        results = await service.infer(served, _decode(req, service.shm), wanted, "grpc")
        resp = M["ModelInferResponse"](
            model_name=served.name, model_version=served.version, id=req.id
        )
        # outputs in shared memory last: tritonclient pairs raw_output_contents with
        # outputs by position, and those have none
        order = sorted(results, key=lambda n: places.get(n) is not None)
        for name in order:
            arr = results[name]
            out = resp.outputs.add(
                name=name, datatype=tensors.datatype_of(arr), shape=list(arr.shape)
            )
            blob = tensors.to_bytes(arr)
            place = places.get(name)
            if place is None:
                resp.raw_output_contents.append(blob)
                continue
            service.shm.write(place[0], name, place[1], place[2], blob)
            out.parameters["shared_memory_region"].string_param = place[0]
            out.parameters["shared_memory_byte_size"].int64_param = len(blob)
        return resp

    async def shm_status(req, ctx):
        resp = M["SystemSharedMemoryStatusResponse"]()
        for region in service.shm.status(req.name):
            resp.regions[region["name"]].CopyFrom(
                M["SystemSharedMemoryStatusResponse"].RegionStatus(**region)
            )
        return resp

    async def shm_register(req, ctx):
        service.shm.register(req.name, req.key, req.offset, req.byte_size)
        return M["SystemSharedMemoryRegisterResponse"]()

    async def shm_unregister(req, ctx):
        service.shm.unregister(req.name)
        return M["SystemSharedMemoryUnregisterResponse"]()

    async def index(req, ctx):
        resp = M["RepositoryIndexResponse"]()
        for row in service.repository.index():
            resp.models.add(**row)
        return resp

    async def load(req, ctx):
        await asyncio.to_thread(service.load, req.model_name)
        return M["RepositoryModelLoadResponse"]()

    async def unload(req, ctx):
        service.unload(req.model_name)
        return M["RepositoryModelUnloadResponse"]()

    return {
        "ServerLive": (live, "ServerLiveRequest", "ServerLiveResponse"),
        "ServerReady": (ready, "ServerReadyRequest", "ServerReadyResponse"),
        "ModelReady": (model_ready, "ModelReadyRequest", "ModelReadyResponse"),
        "ServerMetadata": (server_metadata, "ServerMetadataRequest", "ServerMetadataResponse"),
        "ModelMetadata": (model_metadata, "ModelMetadataRequest", "ModelMetadataResponse"),
        "ModelConfig": (model_config, "ModelConfigRequest", "ModelConfigResponse"),
        "ModelStatistics": (statistics, "ModelStatisticsRequest", "ModelStatisticsResponse"),
        "ModelInfer": (infer, "ModelInferRequest", "ModelInferResponse"),
        "SystemSharedMemoryStatus": (
            shm_status,
            "SystemSharedMemoryStatusRequest",
            "SystemSharedMemoryStatusResponse",
        ),
        "SystemSharedMemoryRegister": (
            shm_register,
            "SystemSharedMemoryRegisterRequest",
            "SystemSharedMemoryRegisterResponse",
        ),
        "SystemSharedMemoryUnregister": (
            shm_unregister,
            "SystemSharedMemoryUnregisterRequest",
            "SystemSharedMemoryUnregisterResponse",
        ),
        "RepositoryIndex": (index, "RepositoryIndexRequest", "RepositoryIndexResponse"),
        "RepositoryModelLoad": (load, "RepositoryModelLoadRequest", "RepositoryModelLoadResponse"),
        "RepositoryModelUnload": (
            unload,
            "RepositoryModelUnloadRequest",
            "RepositoryModelUnloadResponse",
        ),
    }


def build_server(service: Service, address: str) -> Any:
    """A grpc.aio server for ``service`` bound to ``address`` ("host:port"; port 0 picks
    one: read it from ``server.kiln_port``). Start it in a running event loop."""
    grpc = _grpc()
    public = {"ServerLive", "ServerReady"}

    def wrap(name: str, fn):
        async def method(req, ctx):
            try:
                if name not in public:
                    auth = dict(ctx.invocation_metadata()).get("authorization")
                    service.authorize(auth)
                return await fn(req, ctx)
            except Exception as e:  # noqa: BLE001 - every failure is a status, never a crash
                code = getattr(grpc.StatusCode, status_of(e)[1])
                if code == grpc.StatusCode.UNAVAILABLE:
                    ctx.set_trailing_metadata((("retry-after", "1"),))
                await ctx.abort(code, message_of(e))

        return method

    methods = {
        name: grpc.unary_unary_rpc_method_handler(
            wrap(name, fn),
            request_deserializer=MESSAGES[req].FromString,
            response_serializer=MESSAGES[resp].SerializeToString,
        )
        for name, (fn, req, resp) in _handlers(service).items()
    }
    limit = service.max_request_bytes
    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", -1)]
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, methods),))
    server.kiln_port = server.add_insecure_port(address)
    return server
