"""The models a server holds: loaded from files (named by their stem) or from a
Triton-style repository folder (``name/version/model.onnx``, with an optional
``name/config.json``), each with its session, metadata and batcher."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import InputError, KilnError, ModelLoadError
from kiln.runtime.run_settings import default_backend_name
from kiln.serving.batching import Batcher
from kiln.serving.stats import Statistics
from kiln.serving.tensors import ONNX_TYPES, datatype_of
from kiln.session_api import InferenceSession
from kiln.tools.common import backend_options

PLATFORM = "onnx_kiln"
# KServe datatype -> the DataType enum name of Triton's model configuration
CONFIG_TYPES = {name: f"TYPE_{name}" for name in ONNX_TYPES.values()} | {"BYTES": "TYPE_STRING"}


class ModelNotFound(KilnError):
    """A request named a model or version the server does not hold."""


@dataclass
class ModelConfig:
    """Per-model settings; a repository model reads them from ``name/config.json`` (the
    same keys), a file given on the command line from the server's defaults."""

    backend: str = field(default_factory=default_backend_name)  # as a session given none
    device: str | None = None
    precision: str | None = None
    threads: int | None = None
    max_batch_size: int = 32  # 0 or 1: every request runs alone
    max_queue_delay_microseconds: int = 0  # how long the first request waits for others
    max_queue_size: int = 256  # requests waiting per model before 503

    @classmethod
    def read(cls, path: Path, defaults: ModelConfig) -> ModelConfig:
        """``defaults`` overridden by the JSON object in ``path``; unknown keys are refused
        so a typo is not silently ignored."""
        try:
            given = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: not a readable JSON object ({e})") from None
        known = {f.name for f in fields(cls)}
        if not isinstance(given, dict) or set(given) - known:
            extra = sorted(set(given) - known) if isinstance(given, dict) else given
            raise ModelLoadError(
                f"{path}: unknown settings {extra}; the keys are {', '.join(sorted(known))}"
            )
        values = {f.name: getattr(defaults, f.name) for f in fields(cls)}
        values.update(given)
        return cls(**values)


@dataclass
class TensorSpec:
    """An input or output: name, KServe datatype, shape with -1 for variable dims."""

    name: str
    datatype: str
    shape: list[int]

    def as_json(self) -> dict:
        return {"name": self.name, "datatype": self.datatype, "shape": self.shape}


def _spec(arg: Any) -> TensorSpec:
    shape = [d if isinstance(d, int) else -1 for d in (arg.shape or [])]
    return TensorSpec(arg.name, ONNX_TYPES.get(arg.type, arg.type), shape)


@dataclass
class ServedModel:
    """One loaded model version: its session, I/O specs and the queue its runs go through."""

    name: str
    version: str
    path: Path
    config: ModelConfig
    session: InferenceSession = field(repr=False)
    inputs: list[TensorSpec] = field(default_factory=list)
    outputs: list[TensorSpec] = field(default_factory=list)
    batcher: Batcher = field(init=False, repr=False)
    stats: Statistics = field(default_factory=Statistics, repr=False)

    def __post_init__(self) -> None:
        self.inputs = [_spec(a) for a in self.session.get_inputs()]
        self.outputs = [_spec(a) for a in self.session.get_outputs()]
        # Merging along dim 0 is only right when every input and output has a free dim 0.
        batchable = all(s.shape and s.shape[0] == -1 for s in self.inputs + self.outputs)
        # Triton's max_batch_size: 0 means the model has no batch dimension to merge on
        self.max_batch_size = max(self.config.max_batch_size, 0) if batchable else 0
        self.batcher = Batcher(
            self.name,
            self._run,
            self.max_batch_size,
            self.config.max_queue_delay_microseconds / 1e6,
            self.config.max_queue_size,
        )
        self.batcher.observers.append(self.stats.executed)

    def _run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(None, feed)

    def metadata(self) -> dict:
        """The model metadata response of the Open Inference Protocol."""
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": PLATFORM,
            "inputs": [s.as_json() for s in self.inputs],
            "outputs": [s.as_json() for s in self.outputs],
        }

    def model_config(self) -> dict:
        """The model's configuration as Triton's model configuration extension answers it
        (the JSON form of its ``ModelConfig`` message): with a max batch size, dims leave
        out the batch dimension, as Triton's do."""
        skip = 1 if self.max_batch_size > 0 else 0

        def tensor(s: TensorSpec) -> dict:
            return {"name": s.name, "data_type": CONFIG_TYPES[s.datatype], "dims": s.shape[skip:]}

        device = self.config.device or "cpu"
        group: dict[str, Any] = {"name": self.name, "count": 1, "kind": "KIND_CPU"}
        if device.startswith("cuda"):
            group.update(kind="KIND_GPU", gpus=[int(device.partition(":")[2] or 0)])
        config: dict[str, Any] = {
            "name": self.name,
            "platform": PLATFORM,
            "backend": "kiln",
            "version_policy": {"latest": {"num_versions": 1}},  # the newest version serves
            "max_batch_size": self.max_batch_size,
            "input": [tensor(s) for s in self.inputs],
            "output": [tensor(s) for s in self.outputs],
            # one worker thread per model runs its batches one after another
            "instance_group": [group],
            "default_model_filename": self.path.name,
            "parameters": {
                key: {"string_value": str(value)}
                for key, value in (
                    ("backend", self.config.backend),
                    ("device", self.config.device),
                    ("precision", self.config.precision),
                    ("threads", self.config.threads),
                )
                if value is not None
            },
        }
        if self.max_batch_size > 1:
            # Kiln has no preferred batch sizes: it runs what has queued, up to the max
            config["dynamic_batching"] = {
                "max_queue_delay_microseconds": self.config.max_queue_delay_microseconds,
                "default_queue_policy": {"max_queue_size": self.config.max_queue_size},
            }
        return config

    def rows_of(self, feed: dict[str, np.ndarray]) -> int:
        """How many inferences a request holds, as Triton counts them: its batch size
        for a model with a batch dimension, else 1."""
        if self.max_batch_size == 0 or not feed:
            return 1
        first = next(iter(feed.values()))
        return first.shape[0] if first.ndim else 1

    def check_feed(self, feed: dict[str, np.ndarray]) -> None:
        """Refuse a feed the model cannot take, before it joins a batch with others. BYTES
        tensors for a string input become str arrays in place: ONNX strings are UTF-8 text,
        and a model compares and joins them as text (``b"a" != "a"``)."""
        specs = {s.name: s for s in self.inputs}
        for name in feed:
            if name not in specs:
                raise InputError(
                    f"model {self.name!r} has no input {name!r}; its inputs are {', '.join(specs)}"
                )
        for s in self.inputs:
            if s.name not in feed:
                raise InputError(
                    f"model {self.name!r} needs input {s.name!r} ({s.datatype} {s.shape})"
                )
            arr = feed[s.name]
            got = datatype_of(arr)
            if got != s.datatype:
                raise InputError(
                    f"input {s.name!r} of model {self.name!r} is {s.datatype}, "
                    f"the request sent {got}"
                )
            if len(arr.shape) != len(s.shape) or any(
                want not in (-1, have) for want, have in zip(s.shape, arr.shape)
            ):
                raise InputError(
                    f"input {s.name!r} of model {self.name!r} has shape "
                    f"{s.shape} (-1: any size), the request sent "
                    f"{list(arr.shape)}"
                )
            if s.datatype == "BYTES":
                feed[s.name] = _as_text(s.name, arr)


def _as_text(name: str, arr: np.ndarray) -> np.ndarray:
    try:
        return np.array(
            [x.decode() if isinstance(x, bytes) else str(x) for x in arr.reshape(-1)], dtype=object
        ).reshape(arr.shape)
    except UnicodeDecodeError as e:
        raise InputError(
            f"input {name!r} is a string tensor and an element is not UTF-8 text: {e}"
        ) from None


def load_model(name: str, version: str, path: Path, config: ModelConfig) -> ServedModel:
    """A ServedModel for the ONNX file at ``path`` with ``config``'s session options."""
    opts = backend_options(config.backend, config.device, config.threads, config.precision)
    session = InferenceSession(str(path), backend=config.backend, **opts)
    return ServedModel(name, version, path, config, session)


def file_model_name(path: Path) -> str:
    """The name a model file is served under: its stem, or for ``model.onnx`` its folder's
    name (a zoo model's ``resnet18/model.onnx``; Triton's ``name/1/model.onnx``), not
    "model"."""
    if path.name != "model.onnx":
        return path.stem
    folder = path.parent.parent if path.parent.name.isdigit() else path.parent
    return folder.name or path.stem


class Repository:
    """The models a server holds, by name; a model can be (re)loaded or unloaded while the
    others keep serving. Models given as files are fixed; a repository folder's models
    can be loaded and unloaded through the repository API."""

    def __init__(
        self,
        models: list[str | os.PathLike] = (),
        repository: str | None = None,
        defaults: ModelConfig | None = None,
        load_all: bool = True,
    ):
        self.defaults = defaults or ModelConfig()
        self.root = Path(repository) if repository else None
        self.files: dict[str, Path] = {}
        self._models: dict[str, ServedModel] = {}
        self._lock = threading.Lock()
        if self.root is not None and not self.root.is_dir():
            raise ModelLoadError(f"model repository {self.root} is not a folder")
        for m in models:
            p = Path(m)
            if not p.is_file():
                raise ModelLoadError(f"model file {p} does not exist")
            name = file_model_name(p)
            if name in self.files:
                raise ModelLoadError(
                    f"two model files are named {name!r}; rename one "
                    "(a model's name is its file stem, or its folder's for model.onnx)"
                )
            self.files[name] = p
        for name in self.files:
            self.load(name)
        if self.root is not None and load_all:
            for name in self.names_in_repository():
                self.load(name)

    def names_in_repository(self) -> list[str]:
        """Model folders of the repository (those with a version holding model.onnx)."""
        if self.root is None:
            return []
        return sorted(d.name for d in self.root.iterdir() if d.is_dir() and self._versions(d))

    @staticmethod
    def _versions(folder: Path) -> list[str]:
        return sorted(
            (
                v.name
                for v in folder.iterdir()
                if v.is_dir() and v.name.isdigit() and (v / "model.onnx").is_file()
            ),
            key=int,
        )

    def load(self, name: str) -> ServedModel:
        """Load (or reload) ``name``: its newest version from the repository, or its file.
        The old version keeps serving until the new one is ready."""
        if name in self.files:
            served = load_model(name, "1", self.files[name], self.defaults)
        else:
            folder = self.root / name if self.root is not None else None
            if folder is None or "/" in name or name.startswith(".") or not folder.is_dir():
                raise ModelNotFound(f"no model {name!r} in the model repository")
            versions = self._versions(folder)
            if not versions:
                raise ModelNotFound(
                    f"model {name!r} has no version folder holding "
                    "model.onnx (the layout is name/1/model.onnx)"
                )
            cfg = folder / "config.json"
            config = ModelConfig.read(cfg, self.defaults) if cfg.is_file() else self.defaults
            served = load_model(name, versions[-1], folder / versions[-1] / "model.onnx", config)
        with self._lock:
            old = self._models.get(name)
            self._models[name] = served
        if old is not None:
            old.batcher.close()
        return served

    def unload(self, name: str) -> None:
        """Stop serving ``name``; requests already queued for it still finish."""
        with self._lock:
            old = self._models.pop(name, None)
        if old is None:
            raise ModelNotFound(f"model {name!r} is not loaded")
        old.batcher.close()

    def get(self, name: str, version: str = "") -> ServedModel:
        """The loaded model ``name`` (at ``version`` if given) or ModelNotFound."""
        served = self._models.get(name)
        if served is None:
            raise ModelNotFound(
                f"model {name!r} is not loaded; loaded models: "
                f"{', '.join(sorted(self._models)) or 'none'}"
            )
        if version and version != served.version:
            raise ModelNotFound(
                f"model {name!r} has no version {version!r} loaded (loaded: {served.version})"
            )
        return served

    def index(self) -> list[dict]:
        """The repository index: every known model with its state."""
        rows = {
            n: {"name": n, "state": "UNAVAILABLE", "reason": "unloaded"}
            for n in self.names_in_repository()
        }
        for n, m in list(self._models.items()):
            rows[n] = {"name": n, "version": m.version, "state": "READY"}
        return [rows[n] for n in sorted(rows)]

    def loaded(self) -> list[ServedModel]:
        """Every loaded model."""
        return list(self._models.values())
