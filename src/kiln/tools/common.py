"""Helpers the tools share: resolving a model argument, describing types, making feeds."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from kiln.errors import InputError, KilnError
from kiln.ir import DType, Model, SymDim, TensorType, Value, parse_dim, plain_shape
from kiln.onnxio import load, to_proto
from kiln.runtime.backends import backend_entry, backends_where
from kiln.runtime.run_settings import default_backend_name, stored

# What to run when an optional dependency is missing (extras of pyproject.toml; the README
# installs Kiln from its checkout with ``pip install -e .``).




MODEL_NAMES: list[Callable[[str, bool | None], Any]] = []
"""Resolvers of model names that are not paths, tried in order: ``resolve(name,
progress)`` returns a path, None (not one of its names) or raises ModelLoadError. The zoo,
a layer above the tools, registers its own (:mod:`kiln.model_names`)."""


def resolve_path(model: Any, progress: bool | None = None) -> Any:
    """``model`` as given, or the file a registered resolver finds for it when it is a
    name (``resnet18``, a zoo model, built first if it is not yet, saying so on stderr;
    ``progress``: see :func:`kiln.zoo.path`) rather than an existing path.

    A name close to a zoo model's raises ``ModelLoadError`` suggesting it (``resnet`` ->
    ``resnet18``)."""
    if not isinstance(model, (str, os.PathLike)) or os.path.exists(model):
        return model
    name = str(model)
    if os.sep in name or name.endswith(".onnx"):
        return model
    for resolve in MODEL_NAMES:
        found = resolve(name, progress)
        if found is not None:
            return found
    return model


def load_model(model: Any) -> Model:
    """A Model from a path, zoo model name, ``onnx.ModelProto``, bytes or a Model."""
    return model if isinstance(model, Model) else load(resolve_path(model))


def model_name(model: Any) -> str:
    """A short label for ``model``: its file name, or the graph's name."""
    if isinstance(model, (str, os.PathLike)):
        return Path(model).name if os.path.exists(model) else str(model)
    if isinstance(model, Model):
        return model.graph.name or "model"
    return "model"


def onnx_source(model: Any) -> str | bytes:
    """What onnxruntime can load for ``model``: a path, or serialized bytes."""
    model = resolve_path(model)
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    if isinstance(model, bytes):
        return model
    if isinstance(model, onnx.ModelProto):
        return model.SerializeToString()
    return to_proto(model).SerializeToString()


def dtype_name(t: DType | None) -> str:
    """``float32``, ``int64``, ``bool``, ``string``... (NumPy names), ``?`` when unknown."""
    if t is None or t == DType.UNDEFINED:
        return "?"
    if t == DType.STRING:
        return "string"
    return t.numpy.name


def dims_of(v: Value) -> list[int | str | None] | None:
    """The declared shape of ``v`` as a list (ints, symbolic dims as text such as ``batch``
    or ``batch*12``, None), None if unranked."""
    t = v.type
    return plain_shape(t.shape) if isinstance(t, TensorType) else None


def fmt_dims(dims: list | tuple | None) -> str:
    """``(batch, 3, 224, 224)``: fixed dims as numbers, symbolic ones by name, ``?`` unknown."""
    if dims is None:
        return "(?...)"
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"


def type_name(v: Value) -> str:
    """The element type of a tensor value, or the ONNX type string of anything else."""
    t = v.type
    if isinstance(t, TensorType):
        return dtype_name(t.dtype)
    return "?" if t is None else str(t)


def concrete_shape(dims: list | None, sizes: dict[str, int] | None = None,
                   default: int = 1) -> tuple[int, ...] | None:
    """``dims`` with symbols replaced from ``sizes`` (else ``default``), unknowns by
    ``default``; None when the rank is unknown. Expressions such as ``batch*seq`` (what
    shape inference writes for reshaped dims) are evaluated over the symbols' sizes."""
    if dims is None:
        return None
    sizes = sizes or {}
    out = []
    for d in dims:
        if isinstance(d, str):
            d = int(sizes[d]) if d in sizes else parse_dim(d)
        if isinstance(d, SymDim):
            d = max(d.evaluate(sizes, default), 0)
        out.append(default if d is None else int(d))
    return tuple(out)


def random_feeds(model: Model, dims: dict[str, int] | None = None, seed: int = 0,
                 batch: int | None = None) -> dict[str, np.ndarray]:
    """Random inputs of the declared shapes: floats ~ N(0, 1), integers in [0, 2) (valid
    token ids, masks and segment ids alike), booleans true. Symbolic dims take their size
    from ``dims`` (default 1); ``batch`` sets a symbolic or unknown first dim."""
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for v in model.graph.inputs:
        t = v.type
        if not isinstance(t, TensorType):
            raise InputError(f"input {v.name!r} is a {t}: --random makes only tensors; "
                             "give it with --input")
        d = dims_of(v)
        if d is None:
            raise InputError(f"input {v.name!r} has no declared shape: give it with --input")
        if batch is not None and d:
            if isinstance(d[0], int) and d[0] != batch:
                raise InputError(f"input {v.name!r} has a fixed first dim {d[0]}, so the "
                                 f"batch size cannot be set to {batch}")
            d = [batch, *d[1:]]
        shape = concrete_shape(d, dims)
        np_t = t.dtype.numpy if t.dtype != DType.UNDEFINED else np.dtype(np.float32)
        if t.dtype.is_float or np_t.kind == "c":
            x = rng.standard_normal(shape).astype(np_t)
        elif np_t.kind == "b":
            x = np.ones(shape, np.bool_)
        elif np_t.kind in "iu":
            x = rng.integers(0, 2, shape).astype(np_t)
        elif t.dtype == DType.STRING:
            x = np.full(shape, "a", dtype=object)
        else:
            raise InputError(f"cannot make random values of {t} for input {v.name!r}")
        feeds[v.name] = x
    return feeds


def load_array(path: str | os.PathLike) -> np.ndarray | dict[str, np.ndarray]:
    """One array from .npy / .pb (a TensorProto), or every array of an .npz (a dict)."""
    p = str(path)
    if not os.path.exists(p):
        raise InputError(f"input file {p!r} does not exist")
    try:
        if p.endswith(".npz"):
            with np.load(p, allow_pickle=False) as f:
                return {k: f[k] for k in f.files}
        if p.endswith(".npy"):
            return np.load(p, allow_pickle=False)
        if p.endswith(".pb"):
            t = onnx.TensorProto()
            with open(p, "rb") as f:
                t.ParseFromString(f.read())
            return onnx.numpy_helper.to_array(t)
    except (ValueError, OSError) as e:
        raise InputError(f"cannot read input file {p!r}: {e}") from None
    except Exception as e:  # protobuf DecodeError and friends
        raise InputError(f"cannot read input file {p!r}: {type(e).__name__}: {e}") from None
    raise InputError(f"input file {p!r}: use .npy, .npz or .pb (an ONNX TensorProto)")


def feeds_from_specs(model: Model, specs: list[str]) -> dict[str, np.ndarray]:
    """Feeds from ``name=file`` specs (``.npy`` / ``.pb`` / ``.npz``), or bare ``file.npz``
    whose keys are input names. A bare ``.npy``/``.pb`` feeds the inputs in order."""
    names = [v.name for v in model.graph.inputs]
    feeds: dict[str, np.ndarray] = {}
    positional = 0
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or (name not in names and os.path.exists(spec)):
            name, path = "", spec
        data = load_array(path)
        if isinstance(data, dict):
            if name:
                if name in data:
                    feeds[name] = data[name]
                elif len(data) == 1:
                    feeds[name] = next(iter(data.values()))
                else:
                    raise InputError(f"{path!r} holds {sorted(data)}; none is named {name!r}")
            else:
                feeds.update(data)
            continue
        if not name:
            if positional >= len(names):
                raise InputError(f"{path!r}: the model has only {len(names)} input(s); "
                                 "name the input with NAME=FILE")
            name = names[positional]
            positional += 1
        feeds[name] = data
    unknown = [n for n in feeds if n not in names]
    if unknown:
        raise InputError(f"unknown input name(s) {unknown}; the model's inputs are {names}")
    return feeds


def parse_assignments(items: list[str] | None, what: str) -> dict[str, str]:
    """``["a=1", "b=2"]`` -> ``{"a": "1", "b": "2"}``; ValueError naming ``what`` if malformed."""
    out: dict[str, str] = {}
    for it in items or ():
        k, sep, v = it.partition("=")
        if not sep or not k or not v:
            raise ValueError(f"{what} expects NAME=VALUE, got {it!r}")
        out[k] = v
    return out


def parse_dims(items: list[str] | None) -> dict[str, int]:
    """``--dim batch=4`` values as ``{"batch": 4}``."""
    out = {}
    for k, v in parse_assignments(items, "--dim").items():
        try:
            out[k] = int(v)
        except ValueError:
            raise ValueError(f"--dim {k}= needs an integer, got {v!r}") from None
        if out[k] < 0:
            raise ValueError(f"--dim {k}= must not be negative")
    return out


def backend_options(backend: str, device: str | None = None,
                    threads: int | None = None, precision: str | None = None,
                    compile: bool = False) -> dict[str, Any]:
    """The backend options the CLI's ``--device``/``--threads``/``--precision``/
    ``--compile`` mean, for the backends that take them (the registry says which: asking
    a backend for what it does not take is refused in the CLI's own words, naming the
    backends that do)."""
    entry = backend_entry(backend)

    def others(test) -> str:
        return " or ".join(backends_where(test)) or "another backend"

    kind = (device or "cpu").split(":")[0]
    if device and kind not in entry.devices:
        raise KilnError(f"the {backend} backend runs on {' and '.join(entry.devices)} only; "
                        f"use --backend {others(lambda e: kind in e.devices)} for device "
                        f"{device!r}")
    for asked, option in (((precision not in (None, "fp32")) and f"--precision {precision}",
                           "precision"), (compile and "--compile", "compile")):
        if asked and not entry.takes(option):
            raise KilnError(f"{asked} needs --backend "
                            f"{others(lambda e, o=option: e.takes(o))} (the {backend} "
                            "backend computes in the model's own types, eagerly)")
    opts: dict[str, Any] = {"warn": False} if entry.takes("warn") else {}
    if device and entry.takes("device"):
        opts["device"] = device
    if threads and entry.threads_per_run:  # a process-wide pool is the caller's to set
        opts["threads"] = threads
    if precision and entry.takes("precision"):
        opts["precision"] = precision
    if compile:
        opts["compile"] = True
    return opts


def session_for(model: Any, backend: str | None = None, device: str | None = None,
                threads: int | None = None, optimize: bool = True,
                precision: str | None = None, compile: bool = False):
    """An InferenceSession on ``backend`` (``device``, ``threads``, ``precision`` and
    ``compile`` as :func:`backend_options` passes them), optimized as sessions are by default unless
    ``optimize`` is False. ``backend=None``: the backend and options the model file
    stores (``kiln tune``), the options given here winning, else the default backend."""
    from kiln.session_api import InferenceSession

    m = load_model(model)
    got = stored(m.metadata) if backend is None else None
    name = got[0] if got else backend or default_backend_name()
    opts = backend_options(name, device, threads, precision, compile)
    return InferenceSession(m, backend=None if got else name, optimize=optimize, **opts)
