"""Kiln's intermediate representation: the single source of truth every stage works on."""

from kiln.ir.model import AttrRef, Function, Graph, Model, Node, Use, Value, check_uses
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
           "OptionalType", "SequenceType", "Shape", "TensorType", "Use", "Value", "ValueType",
           "check_uses"]
