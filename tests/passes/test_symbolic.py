"""The typed symbolic dim (kiln.ir.SymDim): arithmetic, canonical text, hashing, parsing
of user text, and where dims cross into ONNX files and onnxruntime-style APIs."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import onnx
import pytest
from onnx import helper

import kiln
from kiln.ir import DType, SymDim, TensorType, Undecidable, as_dim, broadcast, parse_dim
from kiln.onnxio import to_proto
from kiln.passes.infer_shapes import infer_model

B, S = SymDim("batch"), SymDim("seq")


def test_arithmetic_is_polynomial_and_constants_are_ints():
    assert B * 12 == 12 * B == parse_dim("batch*12")
    assert S + S == 2 * S == parse_dim("seq*2")
    assert B * S * 768 == parse_dim("768*seq*batch")
    assert (S + 1) - 1 == S
    assert B - B == 0 and type(B - B) is int
    assert B * 0 == 0 and type(B * 0) is int
    minus_b = -B
    assert -minus_b == B and str(minus_b) == "-batch"
    assert 3 - B == parse_dim("-batch+3")
    assert (B + 1) * (B - 1) == parse_dim("batch*batch-1")


def test_numpy_integers_combine_like_ints():
    assert np.int64(3) * B == B * 3
    assert type(np.int64(3) * B) is SymDim
    assert B + np.int32(2) == parse_dim("batch+2")


def test_canonical_text_is_the_one_strings_used():
    assert str(B * 12) == "batch*12"
    assert str(SymDim("heads") * B) == "batch*heads"
    assert str(B * S * 12) == "batch*seq*12"
    assert str(S + 1) == "seq+1"
    assert str(1 - S) == "-seq+1"
    assert str(B * B * 2 + S - 3) == "batch*batch*2+seq-3"
    assert repr(B * 12) == "SymDim('batch*12')"
    for text in ("batch*seq*12", "seq+1", "-seq+1", "batch*batch*2+seq-3"):
        assert str(parse_dim(text)) == text


def test_equality_and_hash_agree_with_the_canonical_string():
    assert B == "batch" and "batch" == B and B != "seq"
    assert B * 12 == "batch*12" and B * 12 != "12*batch"
    assert hash(B * 12) == hash("batch*12") == hash(parse_dim("12*batch"))
    assert {"batch": 4}.get(B) == 4
    assert len({B * 2, B + S - S + B, parse_dim("2*batch")}) == 1
    assert B != 1 and (B == 1) is False
    assert ("batch", 3) == (B, 3)  # shapes compare with the names users write


def test_parse_user_text():
    assert parse_dim("batch") == B and parse_dim("12") == 12
    assert parse_dim("past_sequence_length + 1") == SymDim("past_sequence_length") + 1
    assert parse_dim("seq*2") == parse_dim("2*seq")
    assert parse_dim("a-a") == 0
    odd = parse_dim("weird-name.0")  # not an expression: one opaque symbol, kept whole
    assert odd.symbols == {"weird-name.0"} and str(odd) == "weird-name.0"
    assert as_dim("batch*2") == B * 2 and as_dim(np.int64(5)) == 5 and as_dim(None) is None
    assert as_dim(B) is B
    with pytest.raises(TypeError):
        as_dim(2.5)
    with pytest.raises(ValueError, match="parse_dim"):
        SymDim("batch*2")  # an expression is not a symbol name


def test_exact_division_and_floor_division_where_decidable():
    assert (B * S * 768).div_exact(B * S) == 768
    assert (B * 12).div_exact(12) == B
    assert (B * 12).div_exact(5) is None
    assert (B * 2 + 2).div_exact(B + 1) == 2
    assert (B + 1).div_exact(B) is None
    assert (B * 4 + 3) // 2 == B * 2 + 1 and (B * 4 + 3) % 2 == 1
    assert (B * S) // S == B and (B * S) % S == 0
    with pytest.raises(Undecidable):
        _ = (B + 1) // 2
    with pytest.raises(Undecidable):
        _ = 768 // B
    with pytest.raises(ZeroDivisionError):
        _ = B // 0


def test_comparison_with_ints_when_every_value_agrees():
    assert B >= 0 and B + 1 > 0 and -B <= 0 and not (B < 0)
    assert S + 1 > S and S < S + 1
    with pytest.raises(Undecidable):
        _ = B > 0  # batch may be 0
    with pytest.raises(Undecidable):
        _ = B - S < 0


def test_substitute_and_evaluate():
    assert (B * S * 12).substitute({"batch": 2, "seq": 3}) == 72
    assert (B * S * 12).substitute({"batch": 2}) == S * 24
    assert (B * S + 1).evaluate({"batch": 2, "seq": 3}) == 7
    assert (B * S).evaluate({"batch": 2}, default=1) == 2
    with pytest.raises(KeyError):
        (B * S).evaluate({"batch": 2})


def test_immutable_and_picklable():
    d = B * S + 1
    with pytest.raises(AttributeError):
        d._terms = ()
    assert pickle.loads(pickle.dumps(d)) == d
    assert copy.deepcopy(d) is d
    assert d.symbols == {"batch", "seq"} and d.constant == 1 and B.symbol == "batch"
    assert (B * 2).symbol is None


def test_broadcast_of_symbolic_shapes():
    assert broadcast((B, 1, 3), (S, 3)) == (B, S, 3)
    assert broadcast((B, 4), (None, 1)) == (B, 4)
    assert broadcast((B,), (5,)) == (5,)
    assert broadcast((B,), (S,)) == (None,)


def _model(nodes, inputs, outputs):
    g = helper.make_graph(nodes, "g", inputs, outputs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_import_types_dims_and_export_writes_their_text():
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "seq*2", 3])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    m = kiln.load(_model([helper.make_node("Relu", ["x"], ["y"])], [x], [y]))
    shape = m.graph.inputs[0].type.shape
    assert shape == (B, S * 2, 3) and all(type(d) is not str for d in shape)
    infer_model(m)
    assert m.graph.outputs[0].type == TensorType(DType.FLOAT, (B, S * 2, 3))
    dims = to_proto(m).graph.output[0].type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", "seq*2", 3]


def test_session_and_reports_show_strings():
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["batch", 4])
    proto = _model([helper.make_node("Relu", ["x"], ["y"])], [x], [y])
    sess = kiln.InferenceSession(proto.SerializeToString())
    shape = sess.get_inputs()[0].shape
    assert shape == ["batch", 4] and type(shape[0]) is str
    from kiln.tools.common import concrete_shape, dims_of

    m = kiln.load(proto)
    assert dims_of(m.graph.inputs[0]) == ["batch", 4]
    assert type(dims_of(m.graph.inputs[0])[0]) is str
    assert concrete_shape(["batch*seq", B * 2, None], {"batch": 2, "seq": 3}) == (6, 4, 1)


def test_user_shapes_given_as_text_still_work():
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [None, 3])
    y = helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)
    proto = _model([helper.make_node("Relu", ["x"], ["y"])], [x], [y])
    m = kiln.optimize(kiln.load(proto), input_shapes={"x": ["batch", 3]})
    assert m.graph.inputs[0].type.shape == (B, 3)
    assert isinstance(m.graph.inputs[0].type.shape[0], SymDim)
