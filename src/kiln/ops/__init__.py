"""Operator definitions. Every module in this package registers its ops on import; the
package imports them all, so adding a module is all it takes to add ops."""

import importlib
import pkgutil

from kiln.ops.registry import (
    KILN_DOMAIN,
    KernelContext,
    OpDef,
    backend_kernel,
    infer,
    lookup,
    op,
    register_op,
    registered,
)

for _m in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if not _m.name.startswith("_") and _m.name != "registry":
        importlib.import_module(f"{__name__}.{_m.name}")

__all__ = ["KILN_DOMAIN", "KernelContext", "OpDef", "backend_kernel", "infer", "lookup", "op",
           "register_op", "registered"]
