"""The backends, by name: the one registry the session, the CLI, the onnxruntime layer,
conformance, quantization and the tools read (they never list backend names themselves).

A backend is an adapter (its array type, device and transfers: :class:`Backend`), a kernel
table (``OpDef.kernels[name]``, filled with ``@kernel(name, ...)`` from the modules in
``registry.BACKEND_MODULES[name]``) and optionally a compiler (``Backend.specialize``).
:func:`register_backend` adds one: ``make(**options)`` builds it, ``options`` names what it
takes (anything else is refused with an OptionError naming them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.errors import MissingDependencyError, OptionError
from kiln.runtime.backend import Backend, limit_blas_threads, usable_cores
from kiln.runtime.threads import default_threads


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: how to build it and what it takes."""

    name: str
    make: Callable[..., Backend]
    options: tuple[str, ...]
    """Option names ``make`` accepts (``threads`` is every backend's)."""
    devices: tuple[str, ...] = ("cpu",)
    """Device kinds it can run on ("cpu", "cuda")."""
    about: str = ""


_BACKENDS: dict[str, BackendEntry] = {}


def register_backend(name: str, make: Callable[..., Backend], options: tuple[str, ...] = (),
                     devices: tuple[str, ...] = ("cpu",), about: str = "") -> None:
    """Make ``backend=name`` build ``make(**options)``; a name registered again is
    replaced (tests register their own)."""
    _BACKENDS[name] = BackendEntry(name, make, tuple(options), tuple(devices), about)


def backend_names() -> list[str]:
    """The registered backend names, in registration order ("numpy", "torch", ...)."""
    return list(_BACKENDS)


def backend_entry(name: str) -> BackendEntry:
    """The registry entry for ``name``, or OptionError listing the names there are."""
    entry = _BACKENDS.get(name)
    if entry is None:
        hint = " (a GPU is backend='torch', device='cuda')" if name.startswith("cuda") else ""
        names = " or ".join(repr(n) for n in _BACKENDS)
        raise OptionError(f"unknown backend {name!r}; choose {names}{hint}")
    return entry


def make_backend(name: str, **options: Any) -> Backend:
    """The backend object for ``name`` built with ``options``."""
    threads = options.get("threads")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise OptionError(f"threads must be a positive int, got {threads!r}")
    entry = backend_entry(name)
    unknown = sorted(set(options) - set(entry.options) - {"threads"})
    if unknown:
        takes = ", ".join(("threads",) + entry.options)
        owners = [e.name for e in _BACKENDS.values() if set(unknown) <= set(e.options)]
        hint = f" ({' and '.join(unknown)} {'are' if len(unknown) > 1 else 'is'} the " \
            f"{' or '.join(owners)} backend's)" if owners else ""
        raise OptionError(f"the {name} backend has no option {', '.join(unknown)}; it takes "
                          f"only {takes}{hint}")
    return entry.make(**options)


def _numpy(device: str = "cpu", threads: int | None = None) -> Backend:
    if device != "cpu":
        raise OptionError(f"the numpy backend runs on the CPU only; for device "
                          f"{device!r} use backend='torch'")
    if threads is None:  # never raise what the process set (Ray sets OMP_NUM_THREADS=1)
        cores = usable_cores()
        free = default_threads(cores)
        threads = None if free == cores else free
    limit_blas_threads(threads)
    return Backend()


TORCH_INSTALL = 'pip install -e ".[torch]"'
"""How to get the torch backend's dependency (named when it is missing)."""


def _torch(**options: Any) -> Backend:
    try:
        from kiln.runtime.torch_backend import TorchBackend
    except ImportError as e:  # torch missing, or an install that cannot be imported
        if (e.name or "torch").split(".")[0] != "torch":
            raise
        raise MissingDependencyError("torch", TORCH_INSTALL, "the torch backend") from None
    return TorchBackend(**options)


register_backend("numpy", _numpy, ("device",), about="NumPy's reference kernels on the CPU")
register_backend("torch", _torch, ("device", "precision", "compile", "channels_last", "warn"),
                 ("cpu", "cuda"),
                 about="PyTorch kernels on the CPU or a CUDA device, optionally compiled")

__all__ = ["BackendEntry", "backend_entry", "backend_names", "make_backend",
           "register_backend"]
