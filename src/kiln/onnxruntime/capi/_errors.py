"""onnxruntime's exception classes, and the translation of Kiln's errors into them.

onnxruntime raises ``Fail``, ``InvalidArgument``, ``NoSuchFile``... (plain ``Exception``
subclasses made by pybind11) for failures of its C++ core, and ``RuntimeError`` /
``ValueError`` for some checks. A Kiln error raised through ``kiln.onnxruntime`` is an
instance of both its Kiln class and the class onnxruntime raises in the same situation, so
``except`` clauses written for either catch it."""

from __future__ import annotations

import contextlib
import functools

from kiln.errors import (
    ExternalDataError,
    InputError,
    KernelError,
    KilnError,
    ModelLoadError,
    OptionError,
    RunCancelledError,
    ShapeError,
    UnsupportedOpError,
)


class Fail(Exception):
    """onnxruntime status FAIL."""


class InvalidArgument(Exception):
    """onnxruntime status INVALID_ARGUMENT: a feed or option that does not fit."""


class NoSuchFile(Exception):
    """onnxruntime status NO_SUCHFILE: the model file does not exist."""


class NoModel(Exception):
    """onnxruntime status NO_MODEL."""


class EngineError(Exception):
    """onnxruntime status ENGINE_ERROR."""


class RuntimeException(Exception):
    """onnxruntime status RUNTIME_EXCEPTION: a layer failed while running."""


class InvalidProtobuf(Exception):
    """onnxruntime status INVALID_PROTOBUF: the bytes are not an ONNX model."""


class ModelLoaded(Exception):
    """onnxruntime status MODEL_LOADED."""


class NotImplemented(Exception):  # noqa: A001 - onnxruntime's name
    """onnxruntime status NOT_IMPLEMENTED: an operator with no implementation."""


class InvalidGraph(Exception):
    """onnxruntime status INVALID_GRAPH: the model's graph is malformed."""


class EPFail(Exception):
    """onnxruntime status EP_FAIL: an execution provider failed."""


class ModelLoadCancelled(Exception):
    """onnxruntime status MODEL_LOAD_CANCELED."""


class ModelRequiresCompilation(Exception):
    """onnxruntime status MODEL_REQUIRES_COMPILATION."""


class NotFound(Exception):
    """onnxruntime status NOT_FOUND."""


STATUS = {Fail: (1, "FAIL"), InvalidArgument: (2, "INVALID_ARGUMENT"),
          NoSuchFile: (3, "NO_SUCHFILE"), NoModel: (4, "NO_MODEL"),
          EngineError: (5, "ENGINE_ERROR"), RuntimeException: (6, "RUNTIME_EXCEPTION"),
          InvalidProtobuf: (7, "INVALID_PROTOBUF"), ModelLoaded: (8, "MODEL_LOADED"),
          NotImplemented: (9, "NOT_IMPLEMENTED"), InvalidGraph: (10, "INVALID_GRAPH"),
          EPFail: (11, "EP_FAIL"), ModelLoadCancelled: (12, "MODEL_LOAD_CANCELED"),
          ModelRequiresCompilation: (13, "MODEL_REQUIRES_COMPILATION"),
          NotFound: (14, "NOT_FOUND")}


def ort_class(e: KilnError) -> type[Exception]:
    """The class onnxruntime raises where Kiln raised ``e``."""
    msg = str(e)
    if isinstance(e, ExternalDataError):
        return Fail
    if isinstance(e, ModelLoadError):
        if msg.startswith("no model file"):
            return NoSuchFile
        if "protobuf" in msg or "not a valid ONNX model" in msg:
            return InvalidProtobuf
        return InvalidGraph
    if isinstance(e, UnsupportedOpError):
        return NotImplemented
    if isinstance(e, (InputError, OptionError)):
        return InvalidArgument
    if isinstance(e, (KernelError, ShapeError)):
        return RuntimeException
    if isinstance(e, RunCancelledError):
        return Fail
    return Fail


@functools.cache
def both(kiln_cls: type[Exception], ort_cls: type[Exception]) -> type[Exception]:
    """A class that is both ``kiln_cls`` and ``ort_cls`` (named as onnxruntime's)."""
    return type(ort_cls.__name__, (kiln_cls, ort_cls),
                {"__module__": "kiln.onnxruntime.capi.onnxruntime_pybind11_state",
                 "__doc__": f"Kiln's {kiln_cls.__name__}, raised as onnxruntime's "
                            f"{ort_cls.__name__}."})


def as_ort(e: KilnError, ort_cls: type[Exception] | None = None) -> Exception:
    """``e`` as an instance of its Kiln class and of onnxruntime's (``ort_cls``, or the
    one :func:`ort_class` picks), its message prefixed as onnxruntime's are."""
    ort_cls = ort_cls or ort_class(e)
    cls = both(type(e), ort_cls)
    code, name = STATUS.get(ort_cls, (1, "FAIL"))
    new = cls.__new__(cls)
    new.__dict__.update(e.__dict__)
    Exception.__init__(new, f"[ONNXRuntimeError] : {code} : {name} : {e}")
    return new


@contextlib.contextmanager
def translated():
    """Inside, a KilnError leaves as :func:`as_ort` of it (chained to the original)."""
    try:
        yield
    except KilnError as e:
        if isinstance(e, tuple(STATUS)):
            raise
        raise as_ort(e) from e


def runtime_error(message: str) -> Exception:
    """What onnxruntime's bindings raise for a bad call (pybind11: RuntimeError): also
    Kiln's OptionError, so Kiln's own ``except KilnError`` catches it."""
    return both(OptionError, RuntimeError)(message)
