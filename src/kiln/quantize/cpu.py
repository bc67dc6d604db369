"""Which weight range the target CPU's integer kernels compute exactly.

x86 integer kernels without VNNI (onnxruntime's and fbgemm's AVX2/SSE paths) multiply
uint8 x int8 pairs with ``vpmaddubsw``, which adds two products into a saturating int16:
255 * 127 * 2 overflows, so weights must stay in -63..63 (7 bits) there. With VNNI
(``vpdpbusd``, AVX-512 VNNI or AVX-VNNI) products accumulate in int32 and full 8-bit
weights are exact; ARM's dot-product kernels accumulate in int32 too.
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

__all__ = ["VNNI_FLAGS", "WeightRange", "cpu_flags", "weight_range"]

VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "avx_vnni_int8", "amx_int8")
"""/proc/cpuinfo flags of x86 instructions that accumulate u8 x s8 products in int32."""


@dataclass(frozen=True)
class WeightRange:
    """The weight bits chosen and why (the quantization report prints ``reason``)."""

    bits: int
    reason: str


def cpu_flags(cpuinfo: str | None = None) -> tuple[str, set[str]]:
    """(machine, flags): the architecture and the CPU feature flags of the first CPU in
    ``cpuinfo`` (the text of /proc/cpuinfo; read from the OS when None)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo", errors="replace") as f:
                cpuinfo = f.read()
        except OSError:
            cpuinfo = ""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags = set(val.split())
            break
    machine = platform.machine().lower()
    if "avx2" in flags or "sse2" in flags:
        machine = "x86_64"
    elif "asimd" in flags:
        machine = "aarch64"
    return machine, flags


def weight_range(reduce_range: bool | None = None, cpuinfo: str | None = None) -> WeightRange:
    """7 or 8 weight bits: ``reduce_range`` when the caller chose, else what the CPU
    described by ``cpuinfo`` (this machine's when None) computes exactly."""
    if reduce_range is not None:
        return WeightRange(7 if reduce_range else 8,
                           f"reduce_range={reduce_range} given by the caller")
    machine, flags = cpu_flags(cpuinfo)
    if machine not in ("x86_64", "amd64", "i386", "i686", "x86"):
        return WeightRange(8, f"{machine or 'this'} CPU: its int8 kernels accumulate in "
                              "int32, full-range weights are exact")
    vnni = [f for f in VNNI_FLAGS if f in flags]
    if vnni:
        return WeightRange(8, f"this CPU has {', '.join(vnni)}: int8 products accumulate "
                              "in int32, full-range weights are exact")
    simd = "AVX2" if "avx2" in flags else "SSE"
    return WeightRange(7, f"this CPU has {simd} without VNNI: weights in -63..63 so that "
                          "no pair of products overflows the int16 sums of its int8 "
                          "kernels (reduce_range)")
