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
    if not _m.name.startswith("_") and _m.name not in ("registry", "shape_rules"):
        importlib.import_module(f"{__name__}.{_m.name}")
# The symbolic shape rules attach to the definitions above, so they load once all exist.
importlib.import_module(f"{__name__}.shape_rules")

__all__ = ["KILN_DOMAIN", "KernelContext", "OpDef", "backend_kernel", "infer", "lookup", "op",
           "register_op", "registered"]
