"""The Open Inference Protocol's gRPC messages (package ``inference``), the subset Kiln
serves, declared as protobuf descriptors at import: nothing is generated at install time
and no client library is needed. Field numbers are the protocol's, so any KServe v2 or
Triton client reads them."""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

F = descriptor_pb2.FieldDescriptorProto
B, I32, I64, U32, U64 = F.TYPE_BOOL, F.TYPE_INT32, F.TYPE_INT64, F.TYPE_UINT32, F.TYPE_UINT64
FLT, DBL, STR, BYT, MSG = F.TYPE_FLOAT, F.TYPE_DOUBLE, F.TYPE_STRING, F.TYPE_BYTES, F.TYPE_MESSAGE
ENUM = F.TYPE_ENUM
REP = "repeated"
PACKAGE = "inference"
SERVICE = f"{PACKAGE}.GRPCInferenceService"


def _message(parent, name: str, fields: list[tuple], oneof: str | None = None) -> Any:
    """Add message ``name`` to ``parent`` (a file or message); each field is (name, number,
    type[, message type][, "repeated"])."""
    m = (parent.message_type if hasattr(parent, "message_type") else parent.nested_type).add()
    m.name = name
    if oneof:
        m.oneof_decl.add().name = oneof
    for spec in fields:
        fname, number, ftype, *rest = spec
        f = m.field.add(name=fname, number=number, type=ftype)
        f.label = F.LABEL_REPEATED if REP in rest else F.LABEL_OPTIONAL
        for r in rest:
            if r != REP:
                f.type_name = r
        if oneof:
            f.oneof_index = 0
    return m


def _map(message, full: str, field: str, number: int, value_type: str) -> None:
    """A ``map<string, value_type>`` field of ``message`` (full name ``full``): a repeated
    nested entry message."""
    entry = _message(
        message,
        field.title().replace("_", "") + "Entry",
        [("key", 1, STR), ("value", 2, MSG, value_type)],
    )
    entry.options.map_entry = True
    message.field.add(
        name=field,
        number=number,
        type=MSG,
        label=F.LABEL_REPEATED,
        type_name=f".{PACKAGE}.{full}.{entry.name}",
    )


def _enum(parent, name: str, values: list[str]) -> None:
    """Add enum ``name`` to ``parent`` (a file or message), numbered from 0 in order."""
    e = parent.enum_type.add(name=name)
    for number, value in enumerate(values):
        e.value.add(name=value, number=number)


def _model_config(fd, p: str) -> None:
    """Triton's ``ModelConfig`` (model_config.proto), the fields Kiln fills in."""
    _enum(
        fd,
        "DataType",
        ["TYPE_INVALID", "TYPE_BOOL"]
        + [f"TYPE_{t}" for t in ("UINT8", "UINT16", "UINT32", "UINT64")]
        + [f"TYPE_{t}" for t in ("INT8", "INT16", "INT32", "INT64")]
        + ["TYPE_FP16", "TYPE_FP32", "TYPE_FP64", "TYPE_STRING", "TYPE_BF16"],
    )
    policy = _message(
        fd,
        "ModelVersionPolicy",
        [("latest", 1, MSG, f"{p}ModelVersionPolicy.Latest")],
        oneof="policy_choice",
    )
    _message(policy, "Latest", [("num_versions", 1, U32)])
    dtype = f"{p}DataType"
    _message(
        fd,
        "ModelInput",
        [("name", 1, STR), ("data_type", 2, ENUM, dtype), ("dims", 4, I64, REP)],
    )
    _message(
        fd,
        "ModelOutput",
        [("name", 1, STR), ("data_type", 2, ENUM, dtype), ("dims", 3, I64, REP)],
    )
    _message(fd, "ModelQueuePolicy", [("max_queue_size", 4, U32)])
    _message(
        fd,
        "ModelDynamicBatching",
        [
            ("preferred_batch_size", 1, I32, REP),
            ("max_queue_delay_microseconds", 2, U64),
            ("default_queue_policy", 6, MSG, f"{p}ModelQueuePolicy"),
        ],
    )
    group = _message(
        fd,
        "ModelInstanceGroup",
        [
            ("name", 1, STR),
            ("count", 2, I32),
            ("gpus", 3, I32, REP),
            ("kind", 4, ENUM, f"{p}ModelInstanceGroup.Kind"),
        ],
    )
    _enum(group, "Kind", ["KIND_AUTO", "KIND_GPU", "KIND_CPU", "KIND_MODEL"])
    _message(fd, "ModelParameter", [("string_value", 1, STR)])
    config = _message(
        fd,
        "ModelConfig",
        [
            ("name", 1, STR),
            ("platform", 2, STR),
            ("version_policy", 3, MSG, f"{p}ModelVersionPolicy"),
            ("max_batch_size", 4, I32),
            ("input", 5, MSG, REP, f"{p}ModelInput"),
            ("output", 6, MSG, REP, f"{p}ModelOutput"),
            ("instance_group", 7, MSG, REP, f"{p}ModelInstanceGroup"),
            ("default_model_filename", 8, STR),
            ("dynamic_batching", 11, MSG, f"{p}ModelDynamicBatching"),
            ("backend", 17, STR),
        ],
    )
    _map(config, "ModelConfig", "parameters", 14, f"{p}ModelParameter")
    _message(fd, "ModelConfigRequest", [("name", 1, STR), ("version", 2, STR)])
    _message(fd, "ModelConfigResponse", [("config", 1, MSG, f"{p}ModelConfig")])


def _statistics(fd, p: str) -> None:
    """The statistics extension's messages (Triton's grpc_service.proto)."""
    duration = f"{p}StatisticDuration"
    _message(fd, "StatisticDuration", [("count", 1, U64), ("ns", 2, U64)])
    _message(
        fd,
        "InferStatistics",
        [
            (name, number, MSG, duration)
            for number, name in enumerate(
                [
                    "success",
                    "fail",
                    "queue",
                    "compute_input",
                    "compute_infer",
                    "compute_output",
                    "cache_hit",
                    "cache_miss",
                ],
                start=1,
            )
        ],
    )
    _message(
        fd,
        "InferBatchStatistics",
        [
            ("batch_size", 1, U64),
            ("compute_input", 2, MSG, duration),
            ("compute_infer", 3, MSG, duration),
            ("compute_output", 4, MSG, duration),
        ],
    )
    _message(fd, "MemoryUsage", [("type", 1, STR), ("id", 2, I64), ("byte_size", 3, U64)])
    _message(
        fd,
        "ModelStatistics",
        [
            ("name", 1, STR),
            ("version", 2, STR),
            ("last_inference", 3, U64),
            ("inference_count", 4, U64),
            ("execution_count", 5, U64),
            ("inference_stats", 6, MSG, f"{p}InferStatistics"),
            ("batch_stats", 7, MSG, REP, f"{p}InferBatchStatistics"),
            ("memory_usage", 8, MSG, REP, f"{p}MemoryUsage"),
        ],
    )
    _message(fd, "ModelStatisticsRequest", [("name", 1, STR), ("version", 2, STR)])
    _message(fd, "ModelStatisticsResponse", [("model_stats", 1, MSG, REP, f"{p}ModelStatistics")])


def _shared_memory(fd, p: str) -> None:
    """The system shared memory extension's messages (Triton's grpc_service.proto)."""
    region = [("name", 1, STR), ("key", 2, STR), ("offset", 3, U64), ("byte_size", 4, U64)]
    _message(fd, "SystemSharedMemoryStatusRequest", [("name", 1, STR)])
    status = _message(fd, "SystemSharedMemoryStatusResponse", [])
    _message(status, "RegionStatus", region)
    _map(
        status,
        "SystemSharedMemoryStatusResponse",
        "regions",
        1,
        f"{p}SystemSharedMemoryStatusResponse.RegionStatus",
    )
    _message(fd, "SystemSharedMemoryRegisterRequest", region)
    _message(fd, "SystemSharedMemoryRegisterResponse", [])
    _message(fd, "SystemSharedMemoryUnregisterRequest", [("name", 1, STR)])
    _message(fd, "SystemSharedMemoryUnregisterResponse", [])


def _file() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(
        name="kiln_inference.proto", package=PACKAGE, syntax="proto3"
    )
    p = f".{PACKAGE}."
    for call, reply in [("ServerLive", "live"), ("ServerReady", "ready"), ("ModelReady", "ready")]:
        _message(
            fd,
            f"{call}Request",
            [("name", 1, STR), ("version", 2, STR)] if call == "ModelReady" else [],
        )
        _message(fd, f"{call}Response", [(reply, 1, B)])
    _message(fd, "ServerMetadataRequest", [])
    _message(
        fd,
        "ServerMetadataResponse",
        [("name", 1, STR), ("version", 2, STR), ("extensions", 3, STR, REP)],
    )
    _message(fd, "ModelMetadataRequest", [("name", 1, STR), ("version", 2, STR)])
    meta = _message(
        fd,
        "ModelMetadataResponse",
        [
            ("name", 1, STR),
            ("versions", 2, STR, REP),
            ("platform", 3, STR),
            ("inputs", 4, MSG, REP, f"{p}ModelMetadataResponse.TensorMetadata"),
            ("outputs", 5, MSG, REP, f"{p}ModelMetadataResponse.TensorMetadata"),
        ],
    )
    _message(
        meta, "TensorMetadata", [("name", 1, STR), ("datatype", 2, STR), ("shape", 3, I64, REP)]
    )
    _message(
        fd,
        "InferParameter",
        [
            ("bool_param", 1, B),
            ("int64_param", 2, I64),
            ("string_param", 3, STR),
            ("double_param", 4, DBL),
            ("uint64_param", 5, U64),
        ],
        oneof="parameter_choice",
    )
    _message(
        fd,
        "InferTensorContents",
        [
            ("bool_contents", 1, B, REP),
            ("int_contents", 2, I32, REP),
            ("int64_contents", 3, I64, REP),
            ("uint_contents", 4, U32, REP),
            ("uint64_contents", 5, U64, REP),
            ("fp32_contents", 6, FLT, REP),
            ("fp64_contents", 7, DBL, REP),
            ("bytes_contents", 8, BYT, REP),
        ],
    )
    param, contents = f"{p}InferParameter", f"{p}InferTensorContents"
    req = _message(
        fd,
        "ModelInferRequest",
        [
            ("model_name", 1, STR),
            ("model_version", 2, STR),
            ("id", 3, STR),
            ("inputs", 5, MSG, REP, f"{p}ModelInferRequest.InferInputTensor"),
            ("outputs", 6, MSG, REP, f"{p}ModelInferRequest.InferRequestedOutputTensor"),
            ("raw_input_contents", 7, BYT, REP),
        ],
    )
    _map(req, "ModelInferRequest", "parameters", 4, param)
    tin = _message(
        req,
        "InferInputTensor",
        [
            ("name", 1, STR),
            ("datatype", 2, STR),
            ("shape", 3, I64, REP),
            ("contents", 5, MSG, contents),
        ],
    )
    _map(tin, "ModelInferRequest.InferInputTensor", "parameters", 4, param)
    tout = _message(req, "InferRequestedOutputTensor", [("name", 1, STR)])
    _map(tout, "ModelInferRequest.InferRequestedOutputTensor", "parameters", 2, param)
    resp = _message(
        fd,
        "ModelInferResponse",
        [
            ("model_name", 1, STR),
            ("model_version", 2, STR),
            ("id", 3, STR),
            ("outputs", 5, MSG, REP, f"{p}ModelInferResponse.InferOutputTensor"),
            ("raw_output_contents", 6, BYT, REP),
        ],
    )
    _map(resp, "ModelInferResponse", "parameters", 4, param)
    rout = _message(
        resp,
        "InferOutputTensor",
        [
            ("name", 1, STR),
            ("datatype", 2, STR),
            ("shape", 3, I64, REP),
            ("contents", 5, MSG, contents),
        ],
    )
    _map(rout, "ModelInferResponse.InferOutputTensor", "parameters", 4, param)
    _message(fd, "RepositoryIndexRequest", [("repository_name", 1, STR), ("ready", 2, B)])
    index = _message(
        fd,
        "RepositoryIndexResponse",
        [("models", 1, MSG, REP, f"{p}RepositoryIndexResponse.ModelIndex")],
    )
    _message(
        index,
        "ModelIndex",
        [("name", 1, STR), ("version", 2, STR), ("state", 3, STR), ("reason", 4, STR)],
    )
    _message(
        fd,
        "ModelRepositoryParameter",
        [
            ("bool_param", 1, B),
            ("int64_param", 2, I64),
            ("string_param", 3, STR),
            ("bytes_param", 4, BYT),
        ],
        oneof="parameter_choice",
    )
    for call in ("Load", "Unload"):
        m = _message(
            fd,
            f"RepositoryModel{call}Request",
            [("repository_name", 1, STR), ("model_name", 2, STR)],
        )
        _map(m, f"RepositoryModel{call}Request", "parameters", 3, f"{p}ModelRepositoryParameter")
        _message(fd, f"RepositoryModel{call}Response", [])
    _model_config(fd, p)
    _statistics(fd, p)
    _shared_memory(fd, p)
    return fd


def _classes() -> dict[str, type]:
    # A private pool: a client library in the same process (tritonclient) registers
    # messages of the same full names in the default pool.
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_file())
    file = pool.FindFileByName("kiln_inference.proto")
    return {
        name: message_factory.GetMessageClass(d) for name, d in file.message_types_by_name.items()
    }


MESSAGES = _classes()
"""Message classes by name: ``MESSAGES["ModelInferRequest"]``."""
