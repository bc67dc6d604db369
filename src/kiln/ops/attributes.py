"""The attributes of the ops Kiln defines beyond ONNX's schemas (its own ``ai.kiln`` ops and
onnxruntime's ``com.microsoft`` ops), for load-time validation: a node naming an attribute
its op does not take is refused when the model is loaded, as onnxruntime refuses it.

A plain kernel's keyword-only parameters are its op's attributes. Prepared kernels read
theirs inside ``prepare``: FusedConv's are listed here; a kernel taking ``**attrs`` names
none, and its nodes' attribute names are not checked.
"""

from __future__ import annotations

from kiln.onnxio import importer
from kiln.ops.conv import CONV_ATTRS
from kiln.ops.microsoft import MS_DOMAIN
from kiln.ops.registry import KILN_DOMAIN, lookup

DOMAINS = frozenset({KILN_DOMAIN, MS_DOMAIN})
"""Domains whose attributes Kiln's definitions state (ONNX's own domains use ONNX's
schemas; other custom domains, including users' ``register_op`` ones, are not checked)."""

# What the prepared FusedConv kernels (both domains) read in ``prepare``.
_PREPARED = {"FusedConv": frozenset(CONV_ATTRS) | {"activation", "activation_params"}}


def attribute_names(domain: str, op_type: str, opset: int
                    ) -> tuple[int, frozenset[str] | None] | None:
    """``(since, attribute names)`` of the op version Kiln defines for ``opset``, the names
    None where Kiln does not check them (outside :data:`DOMAINS`, or a kernel taking
    ``**attrs``); None when Kiln has no such op."""
    opdef = lookup(domain, op_type, opset)
    if opdef is None:
        return None
    if domain not in DOMAINS:
        return opdef.since, None
    if opdef.prepare:  # a prepare function may say which attributes it reads
        return opdef.since, getattr(opdef.kernel, "attributes", _PREPARED.get(op_type))
    if "*" in opdef.reference.attr_names:
        return opdef.since, None
    return opdef.since, opdef.reference.attr_names


importer.set_attribute_source(attribute_names)
