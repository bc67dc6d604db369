"""Triton's system shared memory extension: a client on the same machine registers a
POSIX shared memory object (``/dev/shm/KEY``) under a region name; an input then names a
region, offset and size instead of carrying its bytes, and an output can be written into a
region instead of into the response."""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass, field

from kiln.errors import InputError, KilnError

SHM_FOLDER = "/dev/shm"


class RegionError(KilnError):
    """A shared memory region that is not registered, or a bad registration."""


@dataclass
class Region:
    """One registered region: ``byte_size`` bytes of ``key`` from ``offset``."""

    name: str
    key: str
    offset: int
    byte_size: int
    map: mmap.mmap = field(repr=False)

    def as_json(self) -> dict:
        """The region's entry in Triton's status response."""
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }


class SharedMemory:
    """The regions registered with one server, by name."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}
        self._lock = threading.Lock()

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        """Map ``byte_size`` bytes of shared memory object ``key`` from ``offset``."""
        if not name:
            raise RegionError("a shared memory region needs a name")
        bare = key.removeprefix("/")
        if not bare or "/" in bare or bare in (".", ".."):
            raise RegionError(f"shared memory key {key!r} is not a POSIX shared memory name")
        if not isinstance(offset, int) or not isinstance(byte_size, int):
            raise RegionError("offset and byte_size of a shared memory region are integers")
        if offset < 0 or byte_size <= 0:
            raise RegionError(f"region {name!r}: offset {offset} and byte_size {byte_size}")
        with self._lock:
            if name in self._regions:
                raise RegionError(f"shared memory region {name!r} is already registered")
            try:
                fd = os.open(os.path.join(SHM_FOLDER, bare), os.O_RDWR)
            except OSError as e:
                raise RegionError(f"cannot open shared memory object {key!r}: {e}") from None
            try:
                size = os.fstat(fd).st_size
                if offset + byte_size > size:
                    raise RegionError(
                        f"region {name!r}: offset {offset} + byte_size {byte_size} runs past "
                        f"the {size} bytes of shared memory object {key!r}"
                    )
                mapped = mmap.mmap(fd, offset + byte_size)
            finally:
                os.close(fd)
            self._regions[name] = Region(name, key, offset, byte_size, mapped)

    def unregister(self, name: str = "") -> None:
        """Forget region ``name`` (every region when empty); unknown names are no error,
        as in Triton."""
        with self._lock:
            gone = list(self._regions) if not name else [name] if name in self._regions else []
            for n in gone:
                self._regions.pop(n).map.close()

    def status(self, name: str = "") -> list[dict]:
        """The registered regions (only ``name`` when given, which must exist)."""
        with self._lock:
            if name:
                return [self._get(name).as_json()]
            return [r.as_json() for r in self._regions.values()]

    def _get(self, name: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise RegionError(f"no shared memory region {name!r} is registered")
        return region

    def _span(self, region: Region, tensor: str, offset: int, size: int) -> int:
        if offset < 0 or size < 0 or offset + size > region.byte_size:
            raise InputError(
                f"tensor {tensor!r}: {size} bytes at offset {offset} do not fit region "
                f"{region.name!r} of {region.byte_size} bytes"
            )
        return region.offset + offset

    def read(self, name: str, tensor: str, offset: int, size: int) -> bytes:
        """A copy of ``size`` bytes at ``offset`` in region ``name`` (a copy: the client
        may rewrite the region once answered, while the request waits for a batch)."""
        with self._lock:
            region = self._get(name)
            start = self._span(region, tensor, offset, size)
            return region.map[start : start + size]

    def write(self, name: str, tensor: str, offset: int, size: int, data: bytes) -> None:
        """Write output ``tensor``'s ``data`` into the ``size`` bytes at ``offset`` of
        region ``name``."""
        if len(data) > size:
            raise InputError(
                f"output {tensor!r} has {len(data)} bytes; its shared memory holds {size}"
            )
        with self._lock:
            region = self._get(name)
            start = self._span(region, tensor, offset, size)
            region.map[start : start + len(data)] = data
