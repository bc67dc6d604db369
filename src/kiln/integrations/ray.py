"""Batch inference on Ray Data: one Kiln session per actor, the model shared through
Ray's object store, dataset columns in, output columns out.

    import ray, kiln.integrations.ray as kr
    ref = kr.share_model("model.onnx")                   # ray.put once, by the driver
    ds = ray.data.read_parquet("data/").map_batches(
        kr.KilnPredictor, fn_constructor_kwargs={"model": ref}, concurrency=4,
        batch_size=256, num_cpus=2)                      # 2 threads per actor

or ``kr.predict(ds, "model.onnx", concurrency=4, threads=2)``, which does the same and
sets the fault-tolerance options. Ray is optional: ``pip install -e ".[ray]"``.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import InputError, KilnError, MissingDependencyError, OptionError
from kiln.onnxio import to_proto
from kiln.runtime.backends import backend_entry
from kiln.runtime.run_settings import default_backend_name
from kiln.session_api import InferenceSession
from kiln.tools.common import backend_options, load_model

RAY_INSTALL = 'pip install -e ".[ray]"'
"""How to get Ray Data (named when it is missing)."""


def _ray(needed_for: str = "batch inference on Ray") -> Any:
    try:
        import ray
        import ray.data  # noqa: F401  (ray without the data extra lacks it)
    except ImportError:
        raise MissingDependencyError("ray[data]", RAY_INSTALL, needed_for) from None
    return ray


def model_bytes(model: Any) -> bytes:
    """The serialized ONNX model for ``model`` (a path, zoo name, bytes, ModelProto or
    Model), external data included, read through Kiln's loader."""
    if isinstance(model, bytes):
        return model
    return to_proto(load_model(model)).SerializeToString()


def share_model(model: Any) -> Any:
    """Put ``model``'s bytes in Ray's object store once and return the ``ObjectRef`` to
    hand every actor (``fn_constructor_kwargs={"model": ref}``): actors on a node map the
    same copy instead of each reading the file. An ObjectRef is returned as it is."""
    ray = _ray()
    if isinstance(model, ray.ObjectRef):
        return model
    if not ray.is_initialized():
        ray.init()
    return ray.put(model_bytes(model))


def actor_threads(threads: int | None = None) -> int:
    """Threads for one actor's session: the CPUs Ray reserved for it (``num_cpus`` of
    ``map_batches``, at least 1), so actors x threads never exceeds a node's CPUs.
    ``threads`` above that reservation raises OptionError; outside a Ray worker,
    ``threads`` or 1."""
    ray = _ray()
    cpus = None
    if ray.is_initialized():
        cpus = ray.get_runtime_context().get_assigned_resources().get("CPU")
    if cpus is None:
        return threads or 1
    granted = max(1, int(cpus))
    if threads is None:
        return granted
    if threads > granted:
        raise OptionError(f"threads={threads} but Ray reserved {cpus:g} CPU(s) for this "
                          f"actor: pass num_cpus={threads} to map_batches so Ray places "
                          "actors without oversubscribing a node's CPUs")
    return threads


class KilnPredictor:
    """A Ray Data callable class: ``ds.map_batches(KilnPredictor, fn_constructor_kwargs=
    {"model": ref, ...}, concurrency=N, batch_size=B, num_cpus=T, num_gpus=G)``.

    Each actor builds one session from ``model`` (best an ObjectRef from
    :func:`share_model`; a path or bytes also work). ``inputs`` maps model inputs to
    dataset columns and ``outputs`` model outputs to columns; both default to the same
    names, and ``outputs`` also chooses which outputs are computed. Columns that are not
    model inputs (ids, labels) pass through. ``backend`` (default: a session's default,
    torch when installed, else numpy), ``device``, ``optimize`` are the session's
    options; ``threads`` defaults to the CPUs Ray reserved for the actor, and ``device``
    to ``"cuda"`` when it was given a GPU (torch backend).
    """

    def __init__(self, model: Any, *, backend: str | None = None, device: str | None = None,
                 threads: int | None = None, optimize: bool = True,
                 inputs: dict[str, str] | None = None, outputs: dict[str, str] | None = None):
        ray = _ray()
        backend = backend or default_backend_name()
        if isinstance(model, ray.ObjectRef):
            model = ray.get(model)
        n = actor_threads(threads)
        gpus = ray.get_runtime_context().get_assigned_resources().get("GPU", 0) \
            if ray.is_initialized() else 0
        if device is None and gpus and "cuda" in backend_entry(backend).devices:
            device = "cuda"  # Ray's CUDA_VISIBLE_DEVICES leaves this actor its own GPU(s)
        if not backend_entry(backend).threads_per_run:
            _limit_blas_threads(n)
        self.session = InferenceSession(model, backend=backend, optimize=optimize,
                                        **backend_options(backend, device, n))
        self.threads = n
        graph_inputs = {v.name: v for v in self.session.model.graph.inputs}
        self._specs = {a.name: (a.shape, graph_inputs[a.name].type.dtype.numpy)
                       for a in self.session.get_inputs()}
        names = [o.name for o in self.session.get_outputs()]
        self.inputs = _mapping(inputs, list(self._specs), "input")
        self.outputs = _mapping(outputs, names, "output") if outputs else {n: n for n in names}

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Score one batch (NumPy batch format): the pass-through columns plus one column
        per output."""
        missing = [c for c in self.inputs.values() if c not in batch]
        if missing:
            raise InputError(f"the batch has no column(s) {missing} for the model's inputs "
                             f"(columns: {sorted(batch)}); map them with "
                             "inputs={'model_input': 'column'}")
        feeds = {name: _as_input(batch[col], *self._specs[name])
                 for name, col in self.inputs.items()}
        outs = self.session.run(list(self.outputs), feeds)
        used = set(self.inputs.values())
        result = {k: v for k, v in batch.items() if k not in used}
        result.update({col: np.asarray(o) for col, o in zip(self.outputs.values(), outs)})
        return result


def _mapping(given: dict[str, str] | None, names: list[str], what: str) -> dict[str, str]:
    if given is None:
        return {n: n for n in names}
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise OptionError(f"the model has no {what}(s) {unknown}; its {what}s are {names}")
    if what == "input":
        return {n: given.get(n, n) for n in names}
    return dict(given)


def _limit_blas_threads(n: int) -> None:
    """A backend without per-run threads (NumPy's are BLAS's): cap the process's BLAS
    threads at the actor's share."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # Ray already sets OMP_NUM_THREADS to the actor's CPUs
        return
    threadpool_limits(limits=n)


def _as_input(col: np.ndarray, shape: list | None, dtype: np.dtype) -> np.ndarray:
    """A dataset column as the model input: list-valued parquet columns stacked, rows
    reshaped to the input's fixed dims when they hold as many values (64 -> 1x8x8)."""
    a = np.stack([np.asarray(x) for x in col]) if col.dtype == object else np.asarray(col)
    rest = shape[1:] if shape else None
    if rest and all(isinstance(d, int) for d in rest) and a.shape[1:] != tuple(rest) \
            and a.size == len(a) * int(np.prod(rest)):
        a = a.reshape((len(a), *rest))
    return a.astype(dtype, copy=False)


def predict(ds: Any, model: Any, *, concurrency: int = 1, batch_size: int = 256,
            backend: str | None = None, device: str | None = None, threads: int = 1,
            num_gpus: float = 0, optimize: bool = True, inputs: dict[str, str] | None = None,
            outputs: dict[str, str] | None = None) -> Any:
    """``ds`` scored by ``concurrency`` actors of ``threads`` CPUs each: the model put in
    the object store once, a killed actor restarted and its batch run again (every row
    scored exactly once). Returns the lazy Ray Dataset."""
    ray = _ray()
    ref = share_model(model)
    kwargs = {"model": ref, "backend": backend, "device": device, "threads": threads,
              "optimize": optimize, "inputs": inputs, "outputs": outputs}
    # Fault tolerance is Ray Data's actor pool default, which tests/serve/test_ray.py holds it to:
    # max_restarts=-1 and max_task_retries=-1, so a killed actor process is restarted and
    # the batches it had not returned are run again on it (setting them here would only
    # repeat the default through a keyword Ray deprecates).
    return ds.map_batches(KilnPredictor, fn_constructor_kwargs=kwargs, batch_format="numpy",
                          compute=ray.data.ActorPoolStrategy(size=concurrency),
                          batch_size=batch_size, num_cpus=threads, num_gpus=num_gpus or None)


@dataclass
class BatchResult:
    """What :func:`batch_files` did: rows scored, output folder, wall time."""

    rows: int
    files: int
    output: str
    seconds: float


def read_files(patterns: list[str], input_name: str | None = None) -> tuple[Any, int]:
    """A Ray Dataset of the files matching ``patterns`` (globs): parquet as it is, each
    .npz's arrays as columns named by their keys, each .npy as the column ``input_name``.
    Returns the dataset and the number of files.

    Files are read by Ray tasks that reserve no CPU: the scoring actors may hold every
    CPU of a small cluster, and a reader waiting for one would wait forever."""
    ray = _ray()
    files = input_files(patterns, input_name)

    def read(batch: dict[str, np.ndarray]) -> Any:
        return _read_file(str(batch["item"][0]), input_name)

    ds = ray.data.from_items(files, override_num_blocks=len(files))
    return ds.map_batches(read, batch_size=1, batch_format="numpy", num_cpus=0), len(files)


def input_files(patterns: list[str], input_name: str | None = None) -> list[str]:
    """The files matching ``patterns``, checked to be ones :func:`read_files` can read
    (no Ray needed: a bad path is refused before a cluster starts)."""
    files = sorted({os.path.abspath(f) for p in patterns for f in glob.glob(p)})
    if not files:
        raise InputError(f"no file matches {patterns}")
    kinds = {Path(f).suffix.lower() for f in files}
    if not kinds <= {".parquet", ".npz", ".npy"}:
        raise InputError(f"cannot read {sorted(kinds)}: give .parquet, .npz or .npy files")
    if ".npy" in kinds and input_name is None:
        raise InputError("a .npy file feeds a model with one input only; use .npz with one "
                         "array per input name, or parquet")
    return files


def _check_address(address: str | None) -> None:
    """``None``, ``auto``, ``local``, ``HOST:PORT`` or ``ray://HOST:PORT``, or an
    OptionError saying so (Ray's own error comes after seconds of start-up, as a
    ValueError)."""
    if address is None or address in ("auto", "local"):
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise OptionError(f"--address {address!r}: give 'auto' (a running cluster on this "
                          "machine), HOST:PORT or ray://HOST:PORT")


def _read_file(path: str, input_name: str | None) -> Any:
    """One input file as a pyarrow Table (arrays of more than one dim as tensor columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from ray.data.extensions import ArrowTensorArray

    if path.endswith(".parquet"):
        return pq.read_table(path)
    if path.endswith(".npy"):
        arrays = {input_name: np.load(path)}
    else:
        with np.load(path) as z:
            arrays = dict(z)
    return pa.table({k: ArrowTensorArray.from_numpy(v) if v.ndim > 1 else v
                     for k, v in arrays.items()})


def batch_files(model: Any, patterns: list[str], output: str, *, address: str | None = None,
                concurrency: int = 1, batch_size: int = 256, backend: str | None = None,
                device: str | None = None, threads: int = 1, num_gpus: float = 0,
                optimize: bool = True,
                on_stage: Callable[[str], None] | None = None) -> BatchResult:
    """Score the files matching ``patterns`` on Ray (a running cluster at ``address``,
    ``"auto"`` to find it, else a local one) and write parquet under ``output``.

    The model, files, output folder and options are checked before Ray starts.
    ``on_stage(text)`` is called as each stage starts (starting Ray, scoring, counting)."""
    stage = on_stage or (lambda text: None)
    if concurrency < 1 or batch_size < 1 or threads < 1:
        raise OptionError("concurrency, batch size and threads must be at least 1")
    if num_gpus < 0:
        raise OptionError(f"GPUs per actor must be 0 or more, not {num_gpus}")
    _check_address(address)
    if os.path.isdir(output) and os.listdir(output):
        raise InputError(f"{output} is not empty: give a new or empty output folder")
    if os.path.exists(output) and not os.path.isdir(output):
        raise InputError(f"{output} is a file: give a new or empty output folder")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise InputError(f"the folder {parent} (where {output} goes) does not exist: "
                         "create it first")
    data = model_bytes(model)
    names = [v.name for v in load_model(data).graph.inputs]
    input_name = names[0] if len(names) == 1 else None
    input_files(patterns, input_name)
    ray = _ray()
    if not ray.is_initialized():
        stage(f"connecting to the Ray cluster at {address}" if address else
              "starting a local Ray cluster")
        ray.init(address=address, log_to_driver=False)
    ds, nfiles = read_files(patterns, input_name)
    stage(f"scoring {nfiles} file(s) on {concurrency} actor(s) into {output}")
    t0 = time.perf_counter()
    scored = predict(ds, data, concurrency=concurrency, batch_size=batch_size,
                     backend=backend, device=device, threads=threads, num_gpus=num_gpus,
                     optimize=optimize)
    os.makedirs(output, exist_ok=True)
    scored.write_parquet(output, ray_remote_args={"num_cpus": 0})  # as reading: no CPU held
    seconds = time.perf_counter() - t0
    stage("counting the rows written")
    rows = ray.data.read_parquet(output).count()
    if rows == 0:
        raise KilnError(f"nothing was written to {output}")
    return BatchResult(rows, nfiles, output, seconds)
