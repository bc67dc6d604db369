"""Conformance against the ONNX backend test suite."""
