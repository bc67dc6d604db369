"""The torch backend's own kernels, registered on the op definitions (``kiln.ops.registry``)
under the backend name "torch". ``kiln.ops.registry.load_backend("torch")`` imports these
modules (and so torch) the first time anything asks what the torch backend can run.

Only ops whose shared array-API kernel is measurably slower on torch tensors, or that need
a torch primitive (convolution, pooling, oneDNN weight packing), have a kernel here;
``docs/architecture.md`` lists them with their measured gain.
"""

from __future__ import annotations

import os
import platform
from functools import partial

from kiln.ops import registry


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


_AMD = ("AuthenticAMD", "HygonGenuine")


def _mkl_cnr_auto() -> None:
    """On AMD (and Hygon) CPUs, run MKL (torch's BLAS) in its CNR mode AUTO.

    Left alone, MKL takes a slower branch on CPUs that are not Intel's; in CNR mode
    (``MKL_CBWR``, a documented MKL setting) it picks its code by the CPU's features. On the
    2-core AMD EPYC (AVX2) that makes wide 16-row products up to 35% faster and BERT,
    RoBERTa and GPT-2 at sequence 16 3-17% (docs/performance.md). MKL reads the variable at
    its first call, so this runs before torch computes anything; a value the user set, or
    a process that already used MKL, is left as it is. Child processes inherit it.
    """
    if "MKL_CBWR" not in os.environ and any(v in _cpu_vendor() for v in _AMD):
        os.environ["MKL_CBWR"] = "AUTO"


_mkl_cnr_auto()

kernel = partial(registry.kernel, "torch")
"""``@kernel("Relu", 6)`` / ``@kernel("Conv", 1, prepare=True)``: a torch kernel for the op
versions from that opset on (see :func:`kiln.ops.registry.kernel`)."""
