"""``compile=True`` programs kept on disk (CPU), so a later process does not compile again.

The torch backend's program for one input signature is exported (``torch.export``) and
compiled ahead of time by AOTInductor into a package (a shared library and the frozen
weights) in the cache folder: ``$KILN_COMPILE_CACHE``, else ``compiled`` under Kiln's cache
root (``kiln.cache``; ``KILN_COMPILE_CACHE=0`` or ``off`` turns the cache off and compiles
in memory with torch.compile).
A process that builds the same program loads the package instead of compiling it; a
program AOTInductor failed on leaves a ``.failed`` note under its key instead, so later
processes run those layers eagerly at once rather than spend the compile again.

The key covers everything the program's results depend on: the generated source, each
layer's op, version and attributes, the host parameters and every constant's bytes, the
input signature, the backend's options, torch's version and Kiln's own source files, so a
changed model, option or Kiln never reuses a stale program. Packages are written under a
temporary name and renamed, so a crash never leaves a half-written one under the key. The
folder holds compiled code that is loaded and run: like torch's own inductor cache, it
must be writable only by the user (a folder others can write to is not used).
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.utils._pytree as pytree

from kiln.cache import optional_location
from kiln.runtime.specialize import CompileFailed, CompileWarning, log


def folder() -> Path | None:
    """The cache folder (created), or None when the cache is turned off."""
    path = optional_location("KILN_COMPILE_CACHE", "compiled")
    if path is None:
        return None
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        warnings.warn(f"the compile cache {path} is writable by other users, so it is not "
                      "used (programs compile in memory); chmod go-w it or set "
                      "KILN_COMPILE_CACHE to a private folder", CompileWarning, stacklevel=6)
        return None
    return path


@functools.cache
def _kiln_code() -> str:
    """A digest of Kiln's own source files: a program built by other code is not reused."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for p in sorted(root.rglob("*.py")):
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()


def _feed(h, x) -> None:
    """Hash a value unambiguously (arrays by dtype, shape and bytes, not their repr)."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.view(torch.uint8) if x.dtype == torch.bfloat16 else x
        x = x.contiguous().numpy()
    if isinstance(x, np.ndarray):
        h.update(f"{x.dtype.str}{x.shape}".encode())
        h.update(np.ascontiguousarray(x).view(np.uint8).data)
    elif isinstance(x, dict):
        for k in sorted(x):
            h.update(repr(k).encode())
            _feed(h, x[k])
    elif isinstance(x, (list, tuple)):
        h.update(f"{type(x).__name__}{len(x)}".encode())
        for e in x:
            _feed(h, e)
    else:
        h.update(f"{type(x).__name__}:{x!r};".encode())


def key(plan, source: str, params: dict, constants: dict, inputs: list, options: str) -> str:
    """The cache key of one program (see the module's docstring for what it covers)."""
    h = hashlib.sha256()
    h.update(f"{source}\n{options}\n{torch.__version__}\n{_kiln_code()}".encode())
    for s in plan.steps:
        h.update(f"{s.node.domain}:{s.node.op_type}:{s.opset};".encode())
        _feed(h, s.node.attrs)
    _feed(h, params)
    _feed(h, constants)
    for x in inputs:
        h.update(f"{tuple(x.shape)}{x.dtype};".encode())
    return h.hexdigest()[:40]


def program(module: torch.nn.Module, plan, source: str, params: dict, constants: dict,
            options: str, where: Path, log: list[str]) -> Callable[[list], list]:
    """``run(inputs)`` for ``module``: at the first call its package is loaded from
    ``where`` or, if absent, exported, compiled and stored there (``log`` says which)."""
    runner: list = []

    def run(inputs: list) -> list:
        if not runner:
            runner.append(_load_or_build(module, plan, source, params, constants, options,
                                         where, inputs, log))
        with torch.no_grad():
            return list(runner[0](*inputs))
    return run


def _load_or_build(module, plan, source, params, constants, options, where: Path, inputs,
                   log: list[str]):
    path = where / f"{key(plan, source, params, constants, inputs, options)}.pt2"
    failed = path.with_suffix(".failed")
    if failed.exists():  # a failure is as deterministic as a success: not retried per process
        log.append(f"failed before {failed}")
        raise CompileFailed(f"AOTInductor failed on this program before "
                            f"({failed.read_text(errors='replace')}); delete {failed} to "
                            "try again")
    if path.exists():
        try:
            loaded = _load(path)
            log.append(f"loaded {path}")
            return loaded
        except Exception:  # noqa: BLE001 - an unreadable package is rebuilt
            path.unlink(missing_ok=True)
    from torch._inductor import aoti_compile_and_package

    tmp = where / f".{path.stem}-{os.getpid()}.pt2"
    try:
        with torch.no_grad():
            exported = torch.export.export(module.eval(), tuple(inputs), strict=False)
            aoti_compile_and_package(exported, package_path=str(tmp),
                                     inductor_configs={"freezing": True})
        os.replace(tmp, path)
        loaded = _load(path)
    except Exception as e:  # noqa: BLE001 - the plan then runs eagerly, with a note
        tmp.unlink(missing_ok=True)
        msg = str(e).strip().splitlines()
        why = f"{type(e).__name__}: {msg[0] if msg else ''}"
        if not isinstance(e, OSError):  # a full disk or a lost file may pass: not kept
            _write_atomically(failed, why)
        raise CompileFailed(f"AOTInductor failed ({why})") from e
    log.append(f"compiled {path}")
    return loaded


def _write_atomically(path: Path, text: str) -> None:
    """``path`` holds ``text`` whole or not at all (processes share the folder)."""
    tmp = path.with_name(f".{path.name}-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> Callable:
    """The package at ``path`` as ``program(*inputs) -> outputs``, through torch's package
    loader itself rather than ``torch._inductor.aoti_load_package``: that one imports
    inductor and dynamo and compiles a probe program per vector ISA only to warn when the
    CPU differs from the compiling one (seconds per process), none of which a package
    built on this machine for this torch needs. That loader is private: where its
    signature differs (another torch version), the public loader takes over."""
    try:
        loader = _private_loader(path)
        out_spec = pytree.treespec_loads(loader.get_call_spec()[1])
        boxed_run = loader.boxed_run
    except (TypeError, AttributeError) as e:
        log.debug("torch's package loader did not take the call (%s: %s); loading %s "
                  "through torch._inductor.aoti_load_package", type(e).__name__, e, path)
        from torch._inductor import aoti_load_package

        return aoti_load_package(str(path))

    def run(*inputs):
        flat = [x for x in inputs if isinstance(x, torch.Tensor)]  # as torch's own caller
        return pytree.tree_unflatten(boxed_run(flat), out_spec)
    return run


def _private_loader(path: Path):
    """torch's package loader, called as torch 2.13 takes it."""
    return torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
