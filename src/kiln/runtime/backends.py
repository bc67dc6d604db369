"""The backends, by name: the one registry the session, the CLI, the onnxruntime layer,
conformance, quantization and the tools read (they never list backend names themselves).

A backend is an adapter (its array type, device and transfers: :class:`Backend`), a kernel
table (``OpDef.kernels[name]``, filled with ``@kernel(name, ...)`` from the modules in
``registry.BACKEND_MODULES[name]``) and optionally a compiler (``Backend.specialize``).
:func:`register_backend` adds one: ``make(**options)`` builds it, ``options`` names what it
takes (anything else is refused with an OptionError naming them).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kiln.errors import MissingDependencyError, OptionError
from kiln.runtime.backend import Backend, limit_blas_threads, usable_cores
from kiln.runtime.threads import default_threads


def _always() -> bool:
    return True


def _none() -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class BackendEntry:
    """A registered backend: how to build it, what it takes and what it can do. Code above
    the runtime asks these, never a backend's name: a backend registered once appears in
    the CLI's choices, the onnxruntime layer's providers, conformance, quantization and
    ``kiln tune``'s candidates."""

    name: str
    make: Callable[..., Backend]
    options: tuple[str, ...]
    """Option names ``make`` accepts (``threads`` is every backend's); ``"compile"`` among
    them means it has a compiler, ``"precision"`` that it computes in reduced types."""
    devices: tuple[str, ...] = ("cpu",)
    """Device kinds it can run on ("cpu", "cuda")."""
    about: str = ""
    preference: int = 0
    """A session given no backend gets the usable one with the highest preference (the
    first registered among equals)."""
    usable: Callable[[], bool] = _always
    """Whether its dependency imports here."""
    install: str = ""
    """How to get its dependency, said when it is missing."""
    exact: bool = False
    """It has a kernel for every op, fused ones included, and gives the same result run
    after run: the reference that checks the others (quantization, tune, deterministic
    compute)."""
    integer_kernels: bool = False
    """Quantized layers run on integer kernels (else they are dequantized to float, so
    quantizing does not make them faster)."""
    threads_per_run: bool = False
    """Its thread count is set per run, so one session can be timed at several counts."""
    precisions: Callable[[], tuple[str, ...]] = _none
    """The reduced precisions (``precision=`` values) it computes natively on this CPU."""

    def takes(self, option: str) -> bool:
        """Whether ``make`` accepts ``option``."""
        return option == "threads" or option in self.options


_BACKENDS: dict[str, BackendEntry] = {}


def register_backend(name: str, make: Callable[..., Backend], options: tuple[str, ...] = (),
                     devices: tuple[str, ...] = ("cpu",), about: str = "",
                     **capabilities: Any) -> None:
    """Make ``backend=name`` build ``make(**options)``; ``capabilities`` are the other
    :class:`BackendEntry` fields. A name registered again is replaced (tests register
    their own)."""
    _BACKENDS[name] = BackendEntry(name, make, tuple(options), tuple(devices), about,
                                   **capabilities)


def unregister_backend(name: str) -> None:
    """Remove ``name`` from the registry (tests that registered their own)."""
    _BACKENDS.pop(name, None)


def backend_names(usable_only: bool = False) -> list[str]:
    """The registered backend names, in registration order ("numpy", "torch", ...); with
    ``usable_only``, those whose dependency imports here."""
    return [n for n, e in _BACKENDS.items() if not usable_only or e.usable()]


def backend_entry(name: str) -> BackendEntry:
    """The registry entry for ``name``, or OptionError listing the names there are."""
    entry = _BACKENDS.get(name)
    if entry is None:
        gpu = backends_where(lambda e: "cuda" in e.devices)
        hint = f" (a GPU is backend={gpu[0]!r}, device='cuda')" \
            if name.startswith("cuda") and gpu else ""
        names = " or ".join(repr(n) for n in _BACKENDS)
        raise OptionError(f"unknown backend {name!r}; choose {names}{hint}")
    return entry


def backends_where(test: Callable[[BackendEntry], bool]) -> list[str]:
    """The names of the registered backends whose entry passes ``test``, in order."""
    return [n for n, e in _BACKENDS.items() if test(e)]


def default_backend_name(usable_only: bool = True) -> str:
    """The backend of a session given none: the usable one with the highest preference
    (without ``usable_only``, whatever is installed: what the default is where every
    dependency is, said without importing any)."""
    entries = [e for e in _BACKENDS.values() if not usable_only or e.usable()]
    return max(entries, key=lambda e: e.preference).name


def reference_backend_name() -> str:
    """The first :attr:`BackendEntry.exact` backend (NumPy's reference kernels)."""
    return backends_where(lambda e: e.exact)[0]


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


def _torch_usable() -> bool:
    """Installed means importable: a broken or shadowed torch leaves it unusable (the
    import is the one the torch backend would do anyway)."""
    if importlib.util.find_spec("torch") is None:
        return False
    try:
        importlib.import_module("torch")
    except ImportError:
        return False
    return True


def _torch_precisions() -> tuple[str, ...]:
    import torch

    from kiln.runtime.torch_backend import native_on_cpu

    return ("bf16",) if native_on_cpu(torch.bfloat16) else ()


register_backend("numpy", _numpy, ("device",), about="NumPy's reference kernels on the CPU",
                 exact=True)
# On the real-model benchmark and the zoo (docs/performance.md) the torch backend is faster
# at batch 1 on most models, and the NumPy one many times slower than onnxruntime on every
# conv net; the few tiny models where NumPy wins are a small absolute difference, so one
# rule, not a per-model guess, makes torch the default wherever it imports.
register_backend("torch", _torch, ("device", "precision", "compile", "channels_last", "warn"),
                 ("cpu", "cuda"),
                 about="PyTorch kernels on the CPU or a CUDA device, optionally compiled",
                 preference=1, usable=_torch_usable, install=TORCH_INSTALL,
                 integer_kernels=True, threads_per_run=True, precisions=_torch_precisions)

__all__ = ["BackendEntry", "backend_entry", "backend_names", "backends_where",
           "default_backend_name", "make_backend", "reference_backend_name",
           "register_backend", "unregister_backend"]
