"""Kiln's own shape rules for the common compute and shape ops (which spare a node ONNX's
slower per-node inference) against ONNX's shape inference as the oracle: the same output
types for concrete shapes, and symbolic results that agree with ONNX once values are
substituted for the symbols."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln.ir import DType, SymDim
from kiln.onnxio import load
from kiln.ops import registry
from kiln.ops.symdim import InferContext, substitute
from kiln.passes.infer_shapes import infer_model

F = TensorProto.FLOAT

# (op, input shapes, attributes, constant inputs by position, opset)
CASES = [
    ("Shape", [(2, 3, 4)], {}, {}, 17),
    ("Shape", [(2, 3, 4, 5)], {"start": 1, "end": -1}, {}, 17),
    ("Shape", [(2, 3)], {"start": 5}, {}, 17),
    ("Unsqueeze", [(3, 4)], {}, {1: [0, -1]}, 13),
    ("Unsqueeze", [(3, 4)], {"axes": [1]}, {}, 11),
    ("Unsqueeze", [()], {}, {1: [0]}, 13),
    ("Squeeze", [(1, 3, 1, 4)], {}, {}, 13),
    ("Squeeze", [(1, 3, 1, 4)], {}, {1: [-2]}, 13),
    ("Squeeze", [(1, 3, 1, 4)], {"axes": [0, 2]}, {}, 11),
    ("Cast", [(2, 5)], {"to": TensorProto.INT64}, {}, 17),
    ("Cast", [(7,)], {"to": TensorProto.FLOAT16}, {}, 17),
    ("Gather", [(5, 6, 7), (2, 3)], {"axis": 1}, {}, 13),
    ("Gather", [(5, 6, 7), ()], {"axis": -1}, {}, 13),
    ("Gather", [(5,), (4,)], {}, {}, 13),
    ("Transpose", [(2, 3, 4)], {}, {}, 13),
    ("Transpose", [(2, 3, 4, 5)], {"perm": [0, 2, 3, 1]}, {}, 13),
    ("MatMul", [(2, 3, 4), (4, 5)], {}, {}, 13),
    ("MatMul", [(4,), (3, 4, 5)], {}, {}, 13),
    ("MatMul", [(2, 1, 3, 4), (4, 6)], {}, {}, 13),
    ("MatMul", [(3, 4), (4,)], {}, {}, 13),
    ("MatMul", [(4,), (4,)], {}, {}, 13),
    ("MatMul", [(7, 1, 3, 4), (5, 4, 2)], {}, {}, 13),
    ("Gemm", [(3, 4), (4, 5)], {}, {}, 13),
    ("Gemm", [(4, 3), (5, 4)], {"transA": 1, "transB": 1}, {}, 13),
    ("Conv", [(1, 3, 9, 9), (8, 3, 3, 3)], {}, {}, 13),
    ("Conv", [(2, 4, 10, 11), (6, 2, 3, 3)],
     {"group": 2, "strides": [2, 2], "pads": [1, 0, 1, 2]}, {}, 13),
    ("Conv", [(1, 3, 10, 10), (4, 3, 3, 3)], {"dilations": [2, 3]}, {}, 13),
    ("Conv", [(1, 3, 10, 11), (4, 3, 3, 3)], {"auto_pad": "SAME_UPPER", "strides": [3, 2]},
     {}, 13),
    ("Conv", [(1, 3, 10, 11), (4, 3, 3, 3)], {"auto_pad": "SAME_LOWER"}, {}, 13),
    ("Conv", [(1, 3, 10, 11), (4, 3, 3, 2)], {"auto_pad": "VALID", "strides": [2, 3]}, {}, 13),
    ("Conv", [(2, 3, 17), (4, 3, 5)], {"strides": [4], "pads": [2, 1]}, {}, 13),
    ("Conv", [(1, 2, 5, 6, 7), (3, 2, 1, 2, 3)], {"kernel_shape": [1, 2, 3]}, {}, 13),
    ("LayerNormalization", [(2, 5, 8), (8,), (8,)], {"axis": -1}, {}, 17),
    ("MaxPool", [(1, 3, 9, 9)], {"kernel_shape": [2, 2], "strides": [2, 2]}, {}, 17),
    ("MaxPool", [(2, 4, 10, 11)], {"kernel_shape": [3, 3], "strides": [2, 2],
                                   "pads": [1, 1, 1, 1]}, {}, 17),
    ("MaxPool", [(1, 3, 10, 11)], {"kernel_shape": [3, 2], "auto_pad": "SAME_UPPER",
                                   "strides": [3, 2]}, {}, 17),
    ("MaxPool", [(1, 3, 12, 12)], {"kernel_shape": [2, 2], "dilations": [2, 3]}, {}, 17),
    ("AveragePool", [(2, 3, 17)], {"kernel_shape": [5], "strides": [4], "pads": [2, 1]},
     {}, 17),
    ("AveragePool", [(1, 2, 5, 6, 7)], {"kernel_shape": [1, 2, 3], "auto_pad": "VALID"},
     {}, 17),
    ("ReduceMean", [(2, 3, 4, 5)], {"axes": [2, 3], "keepdims": 0}, {}, 17),
    ("ReduceMean", [(2, 3, 4, 5)], {"axes": [-1]}, {}, 17),
    ("ReduceMax", [(2, 3, 4)], {}, {}, 17),
    ("ReduceMean", [(2, 3, 4, 5)], {"keepdims": 0}, {1: [1, -1]}, 18),
    ("ReduceSum", [(2, 3, 4)], {}, {1: [0]}, 13),
    ("ReduceSum", [(2, 3, 4)], {"noop_with_empty_axes": 1}, {}, 13),
    ("ReduceL2", [(6, 7)], {"keepdims": 0}, {1: [0]}, 18),
]


def _model(op, shapes, attrs, consts, opset, dims=None):
    names = [f"x{i}" for i in range(len(shapes))]
    inputs, inits = [], []
    for i, shape in enumerate(shapes):
        dt = TensorProto.INT64 if op == "Gather" and i == 1 else F
        shape = dims[i] if dims else shape
        inputs.append(helper.make_tensor_value_info(names[i], dt, shape))
    for i, value in consts.items():
        names.append(f"c{i}")
        inits.append(numpy_helper.from_array(np.array(value, np.int64), f"c{i}"))
    node = helper.make_node(op, names, ["y"], **attrs)
    graph = helper.make_graph([node], "g", inputs,
                              [helper.make_empty_tensor_value_info("y")],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _onnx_type(model):
    out = onnx.shape_inference.infer_shapes(model, strict_mode=True).graph.output[0].type
    dims = tuple(d.dim_value for d in out.tensor_type.shape.dim)
    return DType(out.tensor_type.elem_type), dims


def _kiln_rule(model):
    """The op's own rule's type for ``y`` (not ONNX's fallback)."""
    m = load(model.SerializeToString())
    infer_model(m)
    node = m.graph.nodes[0]
    opset = m.opset_of("")
    rule = registry.lookup("", node.op_type, opset).infer
    return rule(InferContext(node, opset))


@pytest.mark.parametrize("op, shapes, attrs, consts, opset", CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_rule_types_like_onnx(op, shapes, attrs, consts, opset):
    model = _model(op, shapes, attrs, consts, opset)
    t = _kiln_rule(model)
    assert t is not None, "the rule left the node to ONNX's inference"
    assert (t.dtype, t.shape) == _onnx_type(model)


SYMBOLIC = [  # dims named by text; the rule's symbolic answer is checked at these values
    ("Conv", [("N", 3, "H", "W"), (8, 3, 3, 3)], {"pads": [1, 1, 1, 1]}),
    ("Conv", [("N", 3, "H", "W"), (8, 3, 3, 3)], {"auto_pad": "SAME_UPPER"}),
    ("Conv", [("N", 3, "H", "W"), (8, 3, 3, 5)], {"auto_pad": "VALID", "dilations": [2, 1]}),
    ("MatMul", [("N", "S", 16), (16, 4)], {}),
    ("MatMul", [("B", 1, "S", 8), ("H", 8, "S")], {}),
    ("Gather", [("V", 8), ("N", "S")], {}),
    ("Transpose", [("N", "S", 4, 2)], {"perm": [0, 2, 1, 3]}),
    ("Gemm", [("N", 16), (8, 16)], {"transB": 1}),
    ("MaxPool", [("N", 3, 9, 9)], {"kernel_shape": [3, 3], "strides": [2, 2],
                                   "pads": [1, 1, 1, 1]}),
    ("ReduceMean", [("N", "S", 8)], {"axes": [-1]}),
]


@pytest.mark.parametrize("op, dims, attrs", SYMBOLIC, ids=[c[0] for c in SYMBOLIC])
def test_symbolic_results_agree_with_onnx_at_values(op, dims, attrs):
    t = _kiln_rule(_model(op, dims, attrs, {}, 17, dims=dims))
    assert t is not None and all(d is not None for d in t.shape)
    assert any(isinstance(d, SymDim) for d in t.shape)
    for values in ({"N": 2, "H": 11, "W": 7, "S": 5, "B": 3, "V": 9},
                   {"N": 1, "H": 32, "W": 30, "S": 9, "B": 1, "V": 4}):
        concrete = [tuple(values[d] if isinstance(d, str) else d for d in s) for s in dims]
        if op == "MatMul" and len(concrete[1]) == 3:
            concrete[1] = (values["B"],) + concrete[1][1:]  # H broadcasts against B
            values = {**values, "H": values["B"]}
        expected = _onnx_type(_model(op, concrete, attrs, {}, 17))
        got = tuple(substitute(d, values) for d in t.shape)
        assert (t.dtype, got) == expected
