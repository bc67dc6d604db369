"""Kiln's intermediate representation: the single source of truth every stage works on."""

from kiln.ir.model import (
    AttrRef,
    Function,
    Graph,
    Model,
    Node,
    Use,
    Value,
    check_uses,
    collector_paused,
)
from kiln.ir.symbolic import SymDim, Undecidable, as_dim, broadcast, parse_dim, plain_shape
from kiln.ir.types import (
    Dim,
    DType,
    MapType,
    OptionalType,
    SequenceType,
    Shape,
    TensorType,
    ValueType,
)

__all__ = ["AttrRef", "DType", "Dim", "Function", "Graph", "MapType", "Model", "Node",
           "OptionalType", "SequenceType", "Shape", "SymDim", "TensorType", "Undecidable",
           "Use", "Value", "ValueType", "as_dim", "broadcast", "check_uses",
           "collector_paused", "parse_dim", "plain_shape"]
