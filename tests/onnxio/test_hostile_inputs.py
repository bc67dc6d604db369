"""Hostile inputs: malformed models and odd feeds raise a KilnError naming what is wrong
(or, where onnxruntime accepts the input, give its result), never a raw Python exception.
One test per defect found by the hostile-input campaign (issue 14)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import kiln
from kiln.errors import ExternalDataError, InputError, ModelLoadError

BACKENDS = ["numpy", "torch"]


def _relu(shape=(2,), dtype=TP.FLOAT, outputs=("y",), **attrs) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], list(outputs), **attrs)], "g",
        [helper.make_tensor_value_info("x", dtype, list(shape))],
        [helper.make_tensor_value_info("y", dtype, list(shape))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _ort_rejects(model: onnx.ModelProto) -> bool:
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    except Exception:  # noqa: BLE001 - any refusal by onnxruntime counts
        return True
    return False


# -- node validation against the op's schema ---------------------------------------------

def test_a_relu_declaring_two_outputs_is_refused_naming_the_node():
    m = _relu(outputs=("y", "y2"))
    m.graph.node[0].name = "the_relu"
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"the_relu.*2 outputs.*Relu"):
        kiln.load(m)


def test_too_few_inputs_are_refused_at_load():
    m = _relu()
    m.graph.node[0].op_type = "Add"
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"1 inputs.*Add"):
        kiln.load(m)


def _with_unused(node: onnx.NodeProto) -> onnx.ModelProto:
    """x -> Neg -> y, plus ``node`` reading x whose result nothing reads."""
    graph = helper.make_graph(
        [node, helper.make_node("Neg", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TP.FLOAT, [2])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("node, message", [
    (helper.make_node("Relu", ["x"], [""]), r"output 0 has an empty name.*Relu-14 requires"),
    (helper.make_node("Add", ["x", ""], ["z"]), r"input 1 has an empty name.*Add-14 requires"),
    (helper.make_node("Foo", ["x"], ["z"]), r"ai.onnx has no op 'Foo' at opset 17"),
    # Gelu joined ONNX at opset 20: at 17 no such op exists, even where nothing reads it
    (helper.make_node("Gelu", ["x"], ["z"]), r"ai.onnx has no op 'Gelu' at opset 17"),
], ids=["empty required output", "empty required input", "unknown op", "op newer than opset"])
def test_nodes_onnxruntime_refuses_are_refused_at_load_even_when_unused(node, message):
    m = _with_unused(node)
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=message):
        kiln.load(m)


def test_a_model_output_of_element_type_undefined_is_refused_at_load():
    m = _relu()
    m.graph.output[0].type.tensor_type.elem_type = 0
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"output 'y' declares element type 0"):
        kiln.load(m)


def test_attributes_are_checked_when_the_model_imports_no_default_opset():
    """The long campaign's case 3167043: the opset import's domain was garbled, and Kiln
    ran the Conv (at opset 1, its fallback) without checking its attribute 'pad='."""
    m = _relu(alpha=1.0)
    del m.opset_import[:]
    m.opset_import.append(helper.make_opsetid("garbled.domain", 1))
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"'alpha'"):
        kiln.load(m)


def test_empty_names_for_optional_inputs_and_outputs_load_and_run_as_in_onnxruntime():
    graph = helper.make_graph(
        [helper.make_node("Clip", ["x", "", ""], ["c"]),
         helper.make_node("Dropout", ["c"], ["y", ""])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TP.FLOAT, [3])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    want = ort.InferenceSession(m.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for backend in BACKENDS:
        np.testing.assert_array_equal(
            kiln.InferenceSession(m, backend=backend).run(None, {"x": x})[0], want[0])


def test_an_attribute_of_the_wrong_type_is_refused_at_load():
    w = np.ones((4, 1, 3, 3), np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv0", group=[2])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [1, 2, 5, 5])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "w")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"conv0.*'group' is INTS.*INT"):
        kiln.load(m)


def _model(node: onnx.NodeProto, inputs: dict[str, list[int]], opsets: dict[str, int],
           functions=()) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, TP.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in
                                                opsets.items()], functions=list(functions))
    m.ir_version = 9
    return m


def test_a_misspelt_attribute_is_refused_naming_the_node_and_the_valid_ones():
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv0", kernal_shape=[3, 3])
    m = _model(node, {"x": [1, 2, 5, 5], "w": [4, 2, 3, 3]}, {"": 17})
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"conv0.*'kernal_shape' \(did you mean "
                                             r"'kernel_shape'\?\).*Conv-11 takes 'auto_pad', "
                                             r"'dilations', 'group', 'kernel_shape'"):
        kiln.load(m)


MS = {"": 17, "com.microsoft": 1}


@pytest.mark.parametrize("node, inputs, opsets", [
    (helper.make_node("Relu", ["x"], ["y"], foo=1), {"x": [2]}, {"": 17}),
    # Relu-1's consumed_inputs is gone from Relu-6 on
    (helper.make_node("Relu", ["x"], ["y"], consumed_inputs=[0]), {"x": [2]}, {"": 13}),
    (helper.make_node("Normalizer", ["x"], ["y"], domain="ai.onnx.ml", norm="MAX", nrm="L1"),
     {"x": [2, 3]}, {"": 17, "ai.onnx.ml": 3}),
    (helper.make_node("Gelu", ["x"], ["y"], domain="com.microsoft", approximate="tanh"),
     {"x": [2]}, MS),
    (helper.make_node("FusedMatMul", ["x", "w"], ["y"], domain="com.microsoft", transb=1),
     {"x": [2, 3], "w": [2, 3]}, MS),
    (helper.make_node("FusedConv", ["x", "w"], ["y"], domain="com.microsoft", activaton="Relu"),
     {"x": [1, 1, 3, 3], "w": [1, 1, 1, 1]}, MS),
], ids=["Relu", "Relu-13-consumed_inputs", "ml-Normalizer", "ms-Gelu", "ms-FusedMatMul",
        "ms-FusedConv"])
def test_an_attribute_the_op_does_not_define_is_refused_as_onnxruntime_refuses_it(
        node, inputs, opsets):
    m = _model(node, inputs, opsets)
    assert _ort_rejects(m)
    bad = next(a.name for a in node.attribute if a.name not in ("norm",))
    with pytest.raises(ModelLoadError, match=rf"unknown attribute '{bad}'.*{node.op_type}-"):
        kiln.load(m)


def test_an_attribute_without_a_name_is_refused():
    m = _relu()
    m.graph.node[0].attribute.add(type=onnx.AttributeProto.INT, i=1)
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match="an attribute with no name"):
        kiln.load(m)


def test_a_missing_required_attribute_is_refused():
    node = helper.make_node("Concat", ["x", "x"], ["y"], name="cat")  # axis is required
    m = _model(node, {"x": [2, 3]}, {"": 17})
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"cat.*Concat-13's required attribute 'axis'"):
        kiln.load(m)


def test_an_attribute_given_twice_is_refused():
    node = helper.make_node("LeakyRelu", ["x"], ["y"], alpha=0.5)
    node.attribute.append(helper.make_attribute("alpha", 0.25))
    m = _model(node, {"x": [4]}, {"": 17})
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"'alpha' appears twice"):
        kiln.load(m)
    # also on an op no schema describes (found by the fuzzer on an unknown op type)
    node.op_type, node.domain = "F", "my.dom"
    fn = helper.make_function("my.dom", "F", ["a"], ["b"], [helper.make_node("Relu", ["a"],
                                                                             ["b"])],
                              [helper.make_opsetid("", 17)], attributes=["alpha"])
    m = _model(node, {"x": [4]}, {"": 17, "my.dom": 1}, [fn])
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"appears twice in \['alpha', 'alpha'\]"):
        kiln.load(m)


def _accepted(node, inputs, opsets, functions=()):
    m = _model(node, inputs, opsets, functions)
    feeds = {n: np.linspace(-1, 1, int(np.prod(s)), dtype=np.float32).reshape(s)
             for n, s in inputs.items()}
    want = ort.InferenceSession(m.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)
    for backend in BACKENDS:
        got = kiln.InferenceSession(m, backend=backend).run(None, feeds)
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_names_onnx_never_checks_are_accepted_as_onnxruntime_accepts_them():
    # "__"-prefixed names are ONNX's internal symbols; schemas skip them
    _accepted(helper.make_node("Relu", ["x"], ["y"], __origin="exporter"), {"x": [4]},
              {"": 17})
    # onnx declares LayerNormalization-17 with AllowUncheckedAttributes
    _accepted(helper.make_node("LayerNormalization", ["x", "s"], ["y"], extra=1),
              {"x": [2, 3], "s": [3]}, {"": 17})
    # onnxruntime's SimplifiedLayerNormalization (ONNX domain) takes extra attributes too
    _accepted(helper.make_node("SimplifiedLayerNormalization", ["x", "s"], ["y"], extra=1),
              {"x": [2, 3], "s": [3]}, {"": 17})
    # a model-local function's caller may pass attributes the function does not declare
    fn = helper.make_function("my.dom", "F", ["a"], ["b"], [helper.make_node("Relu", ["a"],
                                                                             ["b"])],
                              [helper.make_opsetid("", 17)], attributes=["alpha"])
    _accepted(helper.make_node("F", ["x"], ["y"], domain="my.dom", beta=1), {"x": [4]},
              {"": 17, "my.dom": 1}, [fn])


def test_kilns_com_microsoft_ops_take_exactly_onnxruntimes_attributes():
    """Kiln refuses an attribute its com.microsoft kernel does not name: each of them must
    name every attribute onnxruntime's schema defines, and no other."""
    from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

    from kiln.ops import registered
    from kiln.ops.attributes import attribute_names

    ort_attrs = {(s.name, s.since_version): set(s.attributes)
                 for s in get_all_operator_schema() if s.domain == "com.microsoft"}
    checked = 0
    for d in registered():
        if d.domain == "com.microsoft":
            known = attribute_names(d.domain, d.op_type, d.since)
            if known is not None:
                assert set(known[1]) == ort_attrs[(d.op_type, known[0])], d.op_type
                checked += 1
    assert checked >= 20


# -- malformed tensors and types ----------------------------------------------------------

def _softmax_sum(in_type: int) -> onnx.ModelProto:
    graph = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["s"], axis=-1),
         helper.make_node("ReduceSum", ["s", "axes"], ["y"], keepdims=1)], "g",
        [helper.make_tensor_value_info("x", in_type, [3, 4])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
        [helper.make_tensor("axes", TP.INT64, [1], [1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_an_input_of_element_type_undefined_is_refused_at_load():
    # found by the fuzzer: the attention-fusion rule asked UNDEFINED for its NumPy dtype
    # and the optimizer failed ("Please report this")
    m = _softmax_sum(TP.UNDEFINED)
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"input 'x' declares element type 0"):
        kiln.load(m)


def test_unknown_element_type_numbers_raise_model_load_error():
    m = _relu()
    m.graph.input[0].type.tensor_type.elem_type = 999
    with pytest.raises(ModelLoadError, match="999"):
        kiln.load(m.SerializeToString())
    m = _relu()
    t = helper.make_tensor("c", TP.FLOAT, [2], [1, 2])
    t.data_type = 999
    m.graph.initializer.append(t)
    with pytest.raises(ModelLoadError, match="999"):
        kiln.load(m.SerializeToString())
    m = _relu()
    m.graph.input[0].type.CopyFrom(
        helper.make_map_type_proto(999, helper.make_tensor_type_proto(TP.FLOAT, [1])))
    with pytest.raises(ModelLoadError, match="999"):
        kiln.load(m)


def test_a_string_tensor_with_too_few_values_is_refused():
    m = _relu()
    t = helper.make_tensor("s", TP.STRING, [1], [b"a"])
    t.dims[0] = 3
    m.graph.initializer.append(t)
    with pytest.raises(ModelLoadError, match=r"'s' has 1 values"):
        kiln.load(m)


def test_non_numeric_external_data_offsets_are_refused(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"\0" * 8)
    m = _relu()
    t = helper.make_tensor("c", TP.FLOAT, [2], [1, 2])
    t.ClearField("float_data")
    t.data_location = TP.EXTERNAL
    for key, value in (("location", "w.bin"), ("offset", "abc")):
        t.external_data.add(key=key, value=value)
    m.graph.initializer.append(t)
    with pytest.raises(ExternalDataError, match="'abc'"):
        kiln.load(m, base_dir=tmp_path)


def test_an_empty_tensor_with_a_dim_numpy_cannot_hold_is_refused():
    # found by the fuzzer: dims [2^62, 0] hold no element, but NumPy refuses the shape
    # (ValueError) for numbers and strings alike
    for dtype in (TP.FLOAT, TP.STRING):
        m = _relu()
        m.graph.initializer.append(helper.make_tensor("e", dtype, [2**62, 0], []))
        with pytest.raises(ModelLoadError, match=r"tensor 'e' is malformed"):
            kiln.load(m)
    # the long campaign's case 4658185: the same dims with (empty) raw_data, which the
    # importer reads straight into the array
    m = _relu()
    m.graph.initializer.append(helper.make_tensor("e", TP.FLOAT, [0, 2**62, 0], b"",
                                                  raw=True))
    with pytest.raises(ModelLoadError, match=r"tensor 'e' is malformed"):
        kiln.load(m.SerializeToString())


def test_dims_whose_product_overflows_int64_are_refused():
    m = _relu()
    t = helper.make_tensor("c", TP.FLOAT, [2], [1, 2])
    del t.dims[:]
    t.dims.extend([2**40, 2**40])
    m.graph.initializer.append(t)
    with pytest.raises(ModelLoadError, match="overflows int64"):
        kiln.load(m)


def test_invalid_utf8_in_op_types_and_names_is_refused():
    raw = _relu().SerializeToString()
    with pytest.raises(ModelLoadError, match="op type .* not valid UTF-8"):
        kiln.load(raw.replace(b"Relu", b"R\xffel"))
    with pytest.raises(ModelLoadError, match="name .* not valid UTF-8"):
        kiln.load(raw.replace(b"\n\x01x", b"\n\x01\xff"))


def test_invalid_utf8_in_a_dim_name_is_refused():
    # found by the fuzzer: a TypeError from the symbolic-dim parser, not a KilnError
    m = _relu(shape=("batch",))
    raw = m.SerializeToString()
    assert raw.count(b"batch") == 2  # the input's and the output's dim
    with pytest.raises(ModelLoadError, match=r"dim name b'\\xffatch' is not valid UTF-8"):
        kiln.load(raw.replace(b"batch", b"\xffatch"))  # same length: the proto stays whole


def test_a_subgraph_returning_an_outer_value_directly_is_refused():
    # found by the fuzzer: a KeyError from the executor, not a KilnError
    then = helper.make_graph([], "then", [], [helper.make_tensor_value_info("x", TP.FLOAT,
                                                                            None)])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TP.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [2]),
         helper.make_tensor_value_info("c", TP.BOOL, [])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert _ort_rejects(m)
    with pytest.raises(ModelLoadError, match=r"subgraph 'then' returns 'x' .* Identity"):
        kiln.load(m)


def _nested_ifs(depth: int) -> onnx.ModelProto:
    """If inside If ``depth`` times, built in place: serializing it would hit protobuf's own
    depth limit, so only an in-memory ModelProto reaches Kiln this deep."""
    m = onnx.ModelProto(ir_version=8)
    m.opset_import.add(domain="", version=17)
    g = m.graph
    g.name = "top"
    g.input.append(helper.make_tensor_value_info("cond", TP.BOOL, []))
    g.initializer.append(helper.make_tensor("c", TP.FLOAT, [1], [1.0]))
    g.output.append(helper.make_tensor_value_info("o0", TP.FLOAT, [1]))
    for i in range(depth):
        n = g.node.add(op_type="If", input=["cond"], output=[f"o{i}"])
        a = n.attribute.add(name="else_branch", type=onnx.AttributeProto.GRAPH)
        a.g.CopyFrom(helper.make_graph(
            [helper.make_node("Neg", ["c"], [f"e{i}"])], "e", [],
            [helper.make_tensor_value_info(f"e{i}", TP.FLOAT, [1])]))
        a = n.attribute.add(name="then_branch", type=onnx.AttributeProto.GRAPH)
        g = a.g
        g.name = f"b{i}"
        g.output.append(helper.make_tensor_value_info(f"o{i + 1}", TP.FLOAT, [1]))
    g.node.add(op_type="Identity", input=["c"], output=[f"o{depth}"])
    return m


def test_deeply_nested_subgraphs_raise_model_load_error_not_recursion_error():
    with pytest.raises(ModelLoadError, match="nested more than"):
        kiln.load(_nested_ifs(300))
    # The deepest nesting allowed still runs: onnxruntime's answer is NumPy's -c / c.
    s = kiln.InferenceSession(_nested_ifs(kiln.onnxio.importer.MAX_SUBGRAPH_DEPTH))
    np.testing.assert_array_equal(s.run(None, {"cond": np.array(True)})[0], [1.0])
    np.testing.assert_array_equal(s.run(None, {"cond": np.array(False)})[0], [-1.0])


# -- feeds ---------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_big_endian_feeds_are_converted(backend):
    # onnxruntime takes such arrays but reads their bytes as little-endian (1.5 comes out
    # as 6.9e-41); Kiln converts them, so the result is NumPy's on the same values.
    x = np.array([1.5, -2.0, 3.25], ">f4")
    got = kiln.InferenceSession(_relu(shape=(3,)), backend=backend).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, np.maximum(x.astype("<f4"), 0))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feed", [
    np.zeros(2, dtype=[("a", "f4")]),  # structured
    [[1.0], [1.0, 2.0]],               # ragged
    {"a": 1.0},                        # dict
    ["a", "b"],                        # text for a float input
], ids=["structured", "ragged", "dict", "text-list"])
def test_feeds_that_are_no_float_tensor_raise_input_error(backend, feed):
    s = kiln.InferenceSession(_relu(), backend=backend)
    with pytest.raises(InputError):
        s.run(None, {"x": feed})


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feed", [None, "3.5", b"3.5"], ids=["None", "str", "bytes"])
def test_none_or_text_is_not_a_float_scalar(backend, feed):
    s = kiln.InferenceSession(_relu(shape=()), backend=backend)
    with pytest.raises(InputError, match="cannot be a tensor of float"):
        s.run(None, {"x": feed})
    np.testing.assert_array_equal(s.run(None, {"x": 3.5})[0], np.float32(3.5))


# -- the command line ----------------------------------------------------------------------

def _cli(*args, env=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", **(env or {})}
    return subprocess.run([sys.executable, "-m", "kiln.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


def test_cli_prints_one_line_for_a_foreign_error_and_the_traceback_with_debug(tmp_path):
    model = tmp_path / "relu.onnx"
    model.write_bytes(_relu().SerializeToString())
    # A broken optional dependency: importing onnxruntime raises a RuntimeError, which is
    # not Kiln's; the user still gets one line and exit 1.
    (tmp_path / "shim").mkdir()
    (tmp_path / "shim" / "onnxruntime.py").write_text("raise RuntimeError('broken install')\n")
    env = {"PYTHONPATH": str(tmp_path / "shim") + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # --quiet: no "still building" line from a session slow to build on a loaded machine
    r = _cli("bench", model, "--vs", "onnxruntime", "--runs", "1", "--quiet", env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert "broken install" in lines[0] and "--debug" in lines[0]
    r = _cli("bench", model, "--vs", "onnxruntime", "--runs", "1", "--debug", env=env)
    assert r.returncode == 1 and "Traceback" in r.stderr and "broken install" in r.stderr


def test_cli_kiln_errors_are_one_line_and_raise_with_debug(tmp_path, capsys):
    from kiln.cli.main import main

    bad = tmp_path / "bad.onnx"
    bad.write_bytes(_relu(outputs=("y", "y2")).SerializeToString())
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kiln: error:") and "2 outputs" in err
    with pytest.raises(ModelLoadError, match="2 outputs"):  # the traceback Python prints
        main(["--debug", "inspect", str(bad)])


# -- bounded work --------------------------------------------------------------------------

def _constant_of_shape_sum(n: int) -> onnx.ModelProto:
    nodes = [helper.make_node("ConstantOfShape", ["shape"], ["big"],
                              value=helper.make_tensor("v", TP.FLOAT, [1], [0.5])),
             helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
             helper.make_node("Add", ["x", "s"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [])],
                              [helper.make_tensor_value_info("y", TP.FLOAT, [])],
                              [helper.make_tensor("shape", TP.INT64, [1], [n])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_folding_never_builds_a_huge_constant():
    import tracemalloc

    tracemalloc.start()
    try:
        om = kiln.optimize(kiln.load(_constant_of_shape_sum(10**9)))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 200 << 20, f"optimizing allocated {peak / 2**20:.0f} MiB"  # 10^9 floats: 4 GB
    assert "ConstantOfShape" in [n.op_type for n in om.graph.nodes]
    # A small one still folds away and computes what onnxruntime computes.
    small = _constant_of_shape_sum(10)
    x = np.array(1.0, np.float32)
    want = ort.InferenceSession(small.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    s = kiln.InferenceSession(small)
    assert "ConstantOfShape" not in [n.op_type for n in s.model.graph.nodes]
    np.testing.assert_allclose(s.run(None, {"x": x})[0], want)


def _counting_loop(trip: int, stop_after: int | None) -> onnx.ModelProto:
    """acc += 1 each iteration; the body's condition turns false after ``stop_after``."""
    body_nodes = [helper.make_node("Add", ["acc_in", "one"], ["acc_out"])]
    if stop_after is None:
        body_nodes.append(helper.make_node("Identity", ["cond_in"], ["cond_out"]))
    else:
        body_nodes.append(helper.make_node("Less", ["i", "limit"], ["cond_out"]))
    body = helper.make_graph(
        body_nodes, "body",
        [helper.make_tensor_value_info("i", TP.INT64, []),
         helper.make_tensor_value_info("cond_in", TP.BOOL, []),
         helper.make_tensor_value_info("acc_in", TP.FLOAT, [])],
        [helper.make_tensor_value_info("cond_out", TP.BOOL, []),
         helper.make_tensor_value_info("acc_out", TP.FLOAT, [])])
    graph = helper.make_graph(
        [helper.make_node("Loop", ["trip", "cond", "x"], ["y"], body=body)], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [])],
        [helper.make_tensor_value_info("y", TP.FLOAT, [])],
        [helper.make_tensor("trip", TP.INT64, [], [trip]),
         helper.make_tensor("cond", TP.BOOL, [], [True]),
         helper.make_tensor("one", TP.FLOAT, [], [1.0]),
         helper.make_tensor("limit", TP.INT64, [], [(stop_after or 0) - 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_loop_past_the_iteration_cap_raises_kernel_error(backend, monkeypatch):
    import kiln.ops.control

    monkeypatch.setattr(kiln.ops.control, "MAX_LOOP_ITERATIONS", 500)
    x = np.array(0.0, np.float32)
    s = kiln.InferenceSession(_counting_loop(2**62, None), backend=backend, optimize=False)
    with pytest.raises(kiln.KernelError, match="Loop ran 500 iterations"):
        s.run(None, {"x": x})
    # A while-loop with INT64_MAX as its trip count (as exporters write them) that stops
    # by its condition is not affected: onnxruntime's result.
    m = _counting_loop(2**63 - 1, 300)
    want = ort.InferenceSession(m.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = kiln.InferenceSession(m, backend=backend).run(None, {"x": x})[0]
    assert float(want) == 300.0
    np.testing.assert_array_equal(got, want)


def test_names_holding_python_code_are_never_executed(tmp_path):
    # Kiln generates Python for each plan; model names must never reach that source.
    marker = tmp_path / "pwned"
    code = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    m = _relu()
    m.graph.node[0].name = code
    m.graph.node[0].doc_string = code
    m.graph.node[0].output[0] = m.graph.output[0].name = f"y');{code};('"
    m.graph.input[0].name = m.graph.node[0].input[0] = f"x\n{code}"
    m.metadata_props.add(key="__init__", value=code)
    x = np.array([-1.0, 2.0], np.float32)
    for backend in ("numpy", "torch"):
        got = kiln.InferenceSession(m, backend=backend).run(None, {f"x\n{code}": x})[0]
        np.testing.assert_array_equal(got, np.maximum(x, 0))
    assert not marker.exists()


def test_keepdims_other_than_0_or_1_is_refused_where_onnx_implementations_disagree():
    # onnxruntime reads keepdims=2 as 0 and ONNX's reference evaluator as 1: the file has no
    # one meaning, so Kiln refuses it instead of silently picking either shape.
    node = helper.make_node("ReduceMean", ["x"], ["y"], name="rmean", axes=[1], keepdims=2)
    m = _model(node, {"x": [2, 3]}, {"": 13})
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    got_ort = ort.InferenceSession(m.SerializeToString(),
                                   providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    from onnx.reference import ReferenceEvaluator
    got_ref = ReferenceEvaluator(m).run(None, {"x": x})[0]
    assert got_ort.shape != got_ref.shape  # the disagreement this guards against
    with pytest.raises(ModelLoadError, match=r"'rmean'.*attribute 'keepdims' is 2.*0 and 1"):
        kiln.load(m)
