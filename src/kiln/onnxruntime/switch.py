"""The switch that gives code doing ``import onnxruntime`` this package instead:
:func:`install` (an import alias, for this process) and ``python -m kiln.onnxruntime``
(a program or module run with the alias installed)."""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from kiln.errors import OptionError

_REAL = "kiln.onnxruntime"


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``onnxruntime`` and ``onnxruntime.X`` as ``kiln.onnxruntime(.X)``, the same
    module objects, so classes and ``except`` clauses agree whichever name imported
    them. A submodule Kiln lacks is not found (ModuleNotFoundError)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "onnxruntime" and not fullname.startswith("onnxruntime."):
            return None
        if importlib.util.find_spec(_REAL + fullname[len("onnxruntime"):]) is None:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(_REAL + spec.name[len("onnxruntime"):])

    def exec_module(self, module) -> None:
        """Already executed under its kiln name."""


_FINDER = _Alias()


def install() -> None:
    """From now on in this process, ``import onnxruntime`` (and ``onnxruntime.X``) gives
    ``kiln.onnxruntime`` (and ``kiln.onnxruntime.X``). Call it before anything imports
    onnxruntime: an OptionError says so if the real one is already imported."""
    real = sys.modules.get("onnxruntime")
    if real is not None and not getattr(real, "__name__", "").startswith(_REAL):
        raise OptionError("onnxruntime was imported before kiln.onnxruntime.install(); call "
                          "install() first (or run the program with "
                          "`python -m kiln.onnxruntime`)")
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    sys.modules["onnxruntime"] = importlib.import_module(_REAL)


def uninstall() -> None:
    """Undo :func:`install`: ``import onnxruntime`` finds the real package again
    (modules that imported the alias keep it)."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == "onnxruntime" or n.startswith("onnxruntime.")]:
        if getattr(sys.modules[name], "__name__", "").startswith(_REAL):
            del sys.modules[name]


def installed() -> bool:
    """Whether ``import onnxruntime`` gives this package now."""
    return _FINDER in sys.meta_path
