"""ONNX import and export: the only place protobuf and the IR meet."""

from kiln.onnxio.exporter import save, to_proto, type_proto
from kiln.onnxio.importer import load, value_type

__all__ = ["load", "save", "to_proto", "type_proto", "value_type"]
