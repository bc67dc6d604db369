"""What the torch kernels need from torch's native runtimes, set in the loaded libraries
themselves, whatever was imported first, without touching the process environment
(child processes and other libraries see the environment the user gave):

- OpenMP (libgomp): worker threads sleep soon after a parallel region. By default they
  spin ~300,000 iterations first; on a busy machine the spinning threads take the cores
  others need (docs/performance.md, "Overhead, threads and the compile cache").
- MKL (torch's BLAS) on AMD and Hygon CPUs: its CNR mode AUTO, in which it picks its code
  by the CPU's features instead of a slower branch for CPUs that are not Intel's.

A setting the user made (``GOMP_SPINCOUNT``, ``OMP_WAIT_POLICY``, ``MKL_CBWR``, or
``KILN_OMP_SPIN=default``) is kept. Where a library is not the one expected (another
OpenMP, no MKL, a libgomp whose spin count cannot be found unambiguously) nothing is
changed, and :data:`SETTLED` says so.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
from pathlib import Path

SPIN_COUNT = 10_000
"""OpenMP's spin-wait (iterations) before a worker thread sleeps: long enough to span the
gap between one small layer's parallel region and the next in a run (a shorter spin made
the threads sleep between layers, and waking them cost models of many small layers at
batch 1 a clear share of their time on a quiet machine), far shorter than libgomp's own
(docs/performance.md, "ShuffleNetV2's batch-1 slowdown, found")."""
_GOMP_DEFAULT_SPIN, _GOMP_DEFAULT_THROTTLED = 300_000, 100
"""libgomp's own values when neither GOMP_SPINCOUNT nor OMP_WAIT_POLICY is set."""
_MKL_CBWR_BRANCH, _MKL_CBWR_OFF, _MKL_CBWR_AUTO = 1, 1, 2
_AMD = ("AuthenticAMD", "HygonGenuine")

SETTLED: dict[str, str] = {}
"""What :func:`settle` did, per runtime ("openmp", "mkl"): a sentence for reports."""


def settle() -> dict[str, str]:
    """Apply both settings once torch is loaded (idempotent); returns :data:`SETTLED`."""
    if not SETTLED:
        import torch  # noqa: F401  (loads libgomp and MKL)

        SETTLED["openmp"] = _settle_openmp()
        SETTLED["mkl"] = _settle_mkl()
    return SETTLED


def _settle_openmp() -> str:
    env = os.environ
    if "GOMP_SPINCOUNT" in env or "OMP_WAIT_POLICY" in env:
        return "kept the user's GOMP_SPINCOUNT/OMP_WAIT_POLICY"
    if env.get("KILN_OMP_SPIN") == "default":
        return "kept OpenMP's own spin (KILN_OMP_SPIN=default)"
    found = _gomp_spin_address()
    if isinstance(found, str):
        return f"left OpenMP's spin as it is: {found}"
    ctypes.c_uint64.from_address(found).value = SPIN_COUNT
    return f"libgomp threads spin {SPIN_COUNT} iterations before sleeping"


def _gomp_spin_address() -> int | str:
    """The address of libgomp's spin count in this process, or why it is not known.

    libgomp keeps it in a hidden variable it sets once from the environment when it loads
    (its ``do_spin`` reads it before every wait, so a new value holds from the next wait).
    It is found in libgomp's zero-initialised data as the one 8-byte word holding the
    default spin (300,000), followed within 32 bytes by the one holding the default
    throttled spin (100): both must be unique, else nothing is written."""
    lib = _loaded_library("libgomp")
    if lib is None:
        return "no libgomp in this process (another OpenMP runtime)"
    path, base = lib
    try:
        bss = _section(path, b".bss")
    except (OSError, ValueError, struct.error) as e:
        return f"cannot read {path} ({e})"
    if bss is None:
        return f"{path} has no .bss section"
    start, size = base + bss[0], bss[1]
    words = struct.unpack(f"<{size // 8}Q", ctypes.string_at(start, size - size % 8))
    spins = [i for i, w in enumerate(words) if w == _GOMP_DEFAULT_SPIN]
    throttled = [i for i, w in enumerate(words) if w == _GOMP_DEFAULT_THROTTLED]
    if len(spins) != 1 or len(throttled) != 1 or not 0 < throttled[0] - spins[0] <= 4:
        if words.count(SPIN_COUNT) == 1:
            return "it already spins as set here"
        return f"its spin count is not recognisable in {Path(path).name}"
    return start + 8 * spins[0]


def _settle_mkl() -> str:
    """MKL's CNR mode AUTO through its service API (``mkl_cbwr_set``), which it accepts
    only before its first call, like the ``MKL_CBWR`` variable it stands for."""
    if "MKL_CBWR" in os.environ:
        return "kept the user's MKL_CBWR"
    if not any(v in _cpu_vendor() for v in _AMD):
        return "MKL left in its default mode (not an AMD CPU)"
    lib = _loaded_library("libtorch_cpu")
    try:
        handle = ctypes.CDLL(lib[0]) if lib else None
        get, set_ = handle.mkl_serv_cbwr_get, handle.mkl_serv_cbwr_set
    except (OSError, AttributeError):
        return "torch's BLAS is not MKL here"
    if get(_MKL_CBWR_BRANCH) != _MKL_CBWR_OFF:
        return "MKL's CNR mode already set"
    if set_(_MKL_CBWR_AUTO) != 0:
        return "MKL had already run before Kiln loaded torch: its mode is as it was"
    return "MKL runs in CNR mode AUTO"


def _loaded_library(stem: str) -> tuple[str, int] | None:
    """(path, load address) of the shared library ``stem*.so*`` mapped in this process."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in maps:
        parts = line.split()
        if len(parts) >= 6 and Path(parts[5]).name.startswith(stem) and \
                ".so" in parts[5] and int(parts[2], 16) == 0:
            return parts[5], int(parts[0].split("-")[0], 16)
    return None


def _section(path: str, name: bytes) -> tuple[int, int] | None:
    """(virtual address, size) of section ``name`` of the 64-bit little-endian ELF file."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    strtab_off, = struct.unpack_from("<Q", data, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        h = shoff + i * shentsize
        name_off, = struct.unpack_from("<I", data, h)
        end = data.index(b"\0", strtab_off + name_off)
        if data[strtab_off + name_off:end] == name:
            addr, = struct.unpack_from("<Q", data, h + 0x10)
            size, = struct.unpack_from("<Q", data, h + 0x20)
            return addr, size
    return None


def _cpu_vendor() -> str:
    """The CPU's vendor id as the OS reports it ('' where it does not)."""
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor()


settle()  # loaded first of the torch kernel modules (registry.BACKEND_MODULES), before any
# of them computes: MKL takes its mode only before its first call
