"""Issue 39, "never silently wrong": what a file declares never changes a result, and values
the spec does not define are refused at load. Each test is one defect, checked against
onnxruntime (or ``onnx.reference`` where onnxruntime has no say)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as TP
from onnx import helper

import kiln

BACKENDS = ["numpy", "torch"]


def _ort(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    so = ort.SessionOptions()
    so.log_severity_level = 3  # its "lenient merge" warning on the declared shape
    return ort.InferenceSession(model.SerializeToString(), so,
                                providers=["CPUExecutionProvider"]).run(None, feed)


def _kiln(model: onnx.ModelProto, feed: dict, backend: str, optimize: bool = True) -> list:
    return kiln.InferenceSession(model.SerializeToString(), backend=backend,
                                 optimize=optimize).run(None, feed)


# -- declared shapes are claims, not facts ------------------------------------------------

def _shape_op(op: str, x_shape: list, declared: list, value_info: bool) -> onnx.ModelProto:
    """``op(x, s)`` with both fed; the result is declared ``declared`` (as the graph output,
    or as value_info of an intermediate that a Relu then returns)."""
    nodes = [helper.make_node(op, ["x", "s"], ["t" if value_info else "y"])]
    if value_info:
        nodes.append(helper.make_node("Relu", ["t"], ["y"]))
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, x_shape),
         helper.make_tensor_value_info("s", TP.INT64, [None])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None if value_info else declared)],
        value_info=[helper.make_tensor_value_info("t", TP.FLOAT, declared)] if value_info
        else [])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("value_info", [False, True], ids=["output", "value_info"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["expand", "reshape"])
def test_a_wrong_declared_shape_never_changes_the_result(case, backend, value_info):
    rng = np.random.default_rng(0)
    if case == "expand":  # [3,1] expanded by [2,1,6] is [2,3,6]; the file says [2,3,3]
        m = _shape_op("Expand", [3, 1], [2, 3, 3], value_info)
        feed = {"x": rng.random((3, 1), np.float32), "s": np.array([2, 1, 6], np.int64)}
    else:  # [6] reshaped by [-1] is [6]; the file says [3,2]
        m = _shape_op("Reshape", [None], [3, 2], value_info)
        feed = {"x": rng.random(6, np.float32), "s": np.array([-1], np.int64)}
    want = _ort(m, feed)[0]
    for optimize in (True, False):
        got = _kiln(m, feed, backend, optimize)[0]
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_get_outputs_still_describes_the_declared_shape_where_it_agrees():
    """Declarations still name dims for descriptions, as onnxruntime's ``get_outputs``."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TP.FLOAT, ["batch", 4])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    want = ort.InferenceSession(m.SerializeToString(),
                                providers=["CPUExecutionProvider"]).get_outputs()[0].shape
    for optimize in (True, False):
        s = kiln.InferenceSession(m.SerializeToString(), optimize=optimize)
        assert s.get_outputs()[0].shape == want


# -- "?" and "-1" dims are unknown, never one shared dim -----------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_question_mark_and_minus_one_dims_are_never_one_shared_dim(backend):
    """PaddleOCR's classifier declares its input ``x[-1,3,?,?]`` (as dim names); onnxruntime
    runs it on a non-square image, so the two ``?`` are not one dim."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, ["-1", 3, "?", "?"])],
        [helper.make_tensor_value_info("y", TP.FLOAT, ["-1", 3, "?", "?"])])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": np.random.default_rng(0).standard_normal((2, 3, 4, 7), np.float32)}
    want = _ort(m, feed)[0]
    np.testing.assert_array_equal(_kiln(m, feed, backend)[0], want)


# -- attribute values ONNX does not define are refused at load -----------------------------

def _one(node: onnx.NodeProto, x_shape, opset: int = 17, inits=(), x_type=TP.FLOAT,
         out_type=TP.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", x_type, x_shape)],
        [helper.make_tensor_value_info(o, out_type, None) for o in node.output if o],
        list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _ort_refuses(m: onnx.ModelProto, feed: dict) -> bool:
    try:
        _ort(m, feed)
    except Exception:  # noqa: BLE001 - any refusal counts
        return True
    return False


_I = onnx.numpy_helper.from_array
_AXIS_CASES = {  # op -> (node inputs, initializers, an axis past the rank-3 input's range)
    "ArgMax": (["x"], [], -4), "ArgMin": (["x"], [], -4), "Concat": (["x", "x"], [], -4),
    "Flatten": (["x"], [], -4), "Split": (["x"], [], -4),
    "GatherElements": (["x", "i"], [_I(np.zeros((2, 3, 4), np.int64), "i")], -4),
    "ScatterElements": (["x", "i", "x"], [_I(np.zeros((2, 3, 4), np.int64), "i")], -4),
    "Compress": (["x", "c"], [_I(np.array([True, False]), "c")], -4),
    "Softmax": (["x"], [], 3), "LogSoftmax": (["x"], [], 3), "Hardmax": (["x"], [], 3),
}


@pytest.mark.parametrize("known_rank", [True, False], ids=["rank-known", "rank-unknown"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,opset", [(op, 17) for op in _AXIS_CASES] +
                         [("Softmax", 11), ("LogSoftmax", 11), ("Hardmax", 11)])
def test_an_axis_outside_the_rank_is_refused_as_onnxruntime_does(op, opset, backend,
                                                                 known_rank):
    ins, inits, ax = _AXIS_CASES[op]
    outs = ["y", "z"] if op == "Split" else ["y"]
    m = _one(helper.make_node(op, ins, outs, axis=ax, **({"num_outputs": 2} if op == "Split"
                                                          and opset >= 18 else {})),
             [2, 3, 4] if known_rank else None, opset, inits,
             out_type=TP.INT64 if op.startswith("Arg") else TP.FLOAT)
    feed = {"x": np.arange(24, dtype=np.float32).reshape(2, 3, 4)}
    assert _ort_refuses(m, feed)
    for optimize in (True, False):
        with pytest.raises(kiln.KilnError, match=r"(?i)axis|dimension"):
            _kiln(m, feed, backend, optimize)


def test_onehot_axis_past_the_output_rank_is_refused():
    m = _one(helper.make_node("OneHot", ["x", "d", "v"], ["y"], axis=-5), [2, 3, 4], 17,
             [_I(np.array(3, np.int64), "d"), _I(np.array([0, 1], np.float32), "v")],
             x_type=TP.INT64)
    feed = {"x": np.zeros((2, 3, 4), np.int64)}
    assert _ort_refuses(m, feed)
    with pytest.raises(kiln.errors.InvalidAttributeError, match=r"'axis' is -5.*\[-4, 3\]"):
        kiln.load(m)
    m.graph.node[0].attribute[0].i = -4  # the lowest valid axis still runs, as onnxruntime
    np.testing.assert_array_equal(_kiln(m, feed, "numpy")[0], _ort(m, feed)[0])


_BAD_VALUES = [  # (node, input shape, opset, attribute, extra initializers)
    (helper.make_node("SoftmaxCrossEntropyLoss", ["x", "l"], ["y"], reduction="bogus"),
     [2, 3], 17, "reduction", [_I(np.zeros(2, np.int64), "l")]),
    (helper.make_node("NegativeLogLikelihoodLoss", ["x", "l"], ["y"], reduction="Mean"),
     [2, 3], 17, "reduction", [_I(np.zeros(2, np.int64), "l")]),
    (helper.make_node("Resize", ["x", "", "sc"], ["y"], mode="bilinear"), [1, 1, 2, 2], 17,
     "mode", [_I(np.array([1, 1, 2, 2], np.float32), "sc")]),
    (helper.make_node("GridSample", ["x", "g"], ["y"], mode="bilinear"), [1, 1, 2, 2], 20,
     "mode", [_I(np.zeros((1, 2, 2, 2), np.float32), "g")]),
    (helper.make_node("GridSample", ["x", "g"], ["y"], padding_mode="wrap"), [1, 1, 2, 2], 17,
     "padding_mode", [_I(np.zeros((1, 2, 2, 2), np.float32), "g")]),
    (helper.make_node("Upsample", ["x", "sc"], ["y"], mode="cubic"), [1, 1, 2, 2], 9, "mode",
     [_I(np.array([1, 1, 2, 2], np.float32), "sc")]),
    (helper.make_node("ReduceSum", ["x"], ["y"], noop_with_empty_axes=2), [2, 3], 17,
     "noop_with_empty_axes", []),
    (helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2, 2], ceil_mode=-1),
     [1, 1, 4, 4], 17, "ceil_mode", []),
    (helper.make_node("Conv", ["x", "w"], ["y"], auto_pad="SAME"), [1, 1, 4, 4], 17,
     "auto_pad", [_I(np.ones((1, 1, 3, 3), np.float32), "w")]),
    (helper.make_node("TopK", ["x", "k"], ["y", "i"], sorted=5), [2, 3], 17, "sorted",
     [_I(np.array([1], np.int64), "k")]),
    (helper.make_node("DepthToSpace", ["x"], ["y"], blocksize=2, mode="dcr"), [1, 4, 2, 2],
     17, "mode", []),
]


@pytest.mark.parametrize("case", _BAD_VALUES, ids=lambda c: f"{c[0].op_type}.{c[3]}"
                         if isinstance(c, tuple) else str(c))
def test_an_attribute_value_onnx_does_not_define_is_refused_naming_what_is_allowed(case):
    node, shape, opset, attribute, inits = case
    node.name = "the_node"
    m = _one(node, shape, opset, inits)
    with pytest.raises(kiln.errors.InvalidAttributeError,
                       match=rf"the_node.*'{attribute}'.*allows") as e:
        kiln.load(m)
    assert e.value.attribute == attribute and e.value.allowed


def test_bitshift_direction_and_is_causal_and_interleaved_are_refused():
    cases = [
        (helper.make_node("BitShift", ["x", "x"], ["y"], direction="UP"), 17, TP.UINT8,
         "direction"),
        (helper.make_node("Attention", ["x", "x", "x"], ["y"], is_causal=3), 23, TP.FLOAT,
         "is_causal"),
        (helper.make_node("RotaryEmbedding", ["x", "c", "c"], ["y"], interleaved=2), 23,
         TP.FLOAT, "interleaved"),
    ]
    for node, opset, t, attribute in cases:
        m = _one(node, None, opset, [_I(np.ones((1, 1), np.float32), "c")], x_type=t,
                 out_type=t)
        with pytest.raises(kiln.errors.InvalidAttributeError, match=f"'{attribute}'"):
            kiln.load(m)


def test_the_value_tables_agree_with_onnx_schemas():
    """Every rule names an attribute ONNX defines on that op, with the type the rule reads,
    and each schema default is an allowed value: the tables cannot refuse a valid model's
    defaults, nor check a name ONNX does not use."""
    from kiln.onnxio import rules

    by_op: dict = {}
    for s in onnx.defs.get_all_schemas_with_history():
        by_op.setdefault((s.domain, s.name), []).append(s)
    A = onnx.AttributeProto
    for name in rules.FLAGS:
        uses = [(s, s.attributes[name]) for ss in by_op.values() for s in ss
                if s.domain == "" and name in s.attributes]
        assert uses, name
        for s, a in uses:
            assert a.type == A.INT and a.default_value.i in (0, 1), (s.name, name)
    for (domain, op), attrs in rules.ENUMS.items():
        for name, versions in attrs.items():
            for since, _allowed in versions:
                have = [s for s in by_op[(domain, op)] if name in s.attributes]
                assert have, (op, name)
                for s in have:
                    a = s.attributes[name]
                    assert a.type in (A.STRING, A.STRINGS), (op, name)
                    d = a.default_value.s.decode() if a.default_value.HasField("s") else None
                    if d and s.since_version >= since:
                        assert d in rules._at(versions, s.since_version), (op, name, d)
    for op, (name, _, _) in rules.AXES.items():
        assert any(name in s.attributes for s in by_op[("", op)]), (op, name)


def test_a_huge_layernorm_axis_is_refused_before_onnx_shape_inference_can_crash():
    """Issue 39 item 10: onnx's C++ inference segfaulted on this node (axis >= 2^31 with the
    Mean and InvStdDev outputs); a subprocess, so a crash fails the test, not the run."""
    import subprocess
    import sys

    code = (
        "import numpy as np, onnx, kiln\n"
        "from onnx import helper as h, TensorProto as T\n"
        "g = h.make_graph([h.make_node('LayerNormalization', ['x', 's'], ['y', 'm', 'r'],"
        " axis=2**31)], 'g', [h.make_tensor_value_info('x', T.FLOAT, [2, 3]),"
        " h.make_tensor_value_info('s', T.FLOAT, [3])],"
        " [h.make_tensor_value_info(o, T.FLOAT, None) for o in 'ymr'])\n"
        "m = h.make_model(g, opset_imports=[h.make_opsetid('', 17)])\n"
        "try:\n"
        "    kiln.InferenceSession(m.SerializeToString())\n"
        "except kiln.errors.InvalidAttributeError:\n"
        "    print('refused')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and "refused" in r.stdout, (r.returncode, r.stderr[-500:])


# -- opsets ONNX does not define -------------------------------------------------------------

@pytest.mark.parametrize("version", [99, 2**31, 2**62, 0])
def test_an_opset_onnx_does_not_define_is_refused_at_load(version):
    """onnxruntime refuses these; Kiln ran opset 99 and gave a TypeError for 2^62."""
    m = _one(helper.make_node("Relu", ["x"], ["y"]), [2], version)
    assert _ort_refuses(m, {"x": np.ones(2, np.float32)})
    with pytest.raises(kiln.ModelLoadError, match=rf"opset {version} of ai.onnx.*1 to "):
        kiln.load(m)


# -- the torch backend's errors are KilnErrors, as the NumPy backend's -----------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_cast_to_an_unknown_element_type_is_refused_at_load(backend):
    m = _one(helper.make_node("Cast", ["x"], ["y"], to=99), [2])
    assert _ort_refuses(m, {"x": np.ones(2, np.float32)})
    with pytest.raises(kiln.errors.InvalidAttributeError, match="'to' is 99"):
        kiln.InferenceSession(m.SerializeToString(), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,target", [("Reshape", [1] * 64 + [2]),
                                       ("Expand", [1] * 65 + [2]), ("Expand", [2**62, 2])])
def test_results_no_numpy_array_can_hold_are_kernel_errors_on_both_backends(backend, op,
                                                                           target):
    graph = helper.make_graph(
        [helper.make_node(op, ["x", "s"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [2]),
         helper.make_tensor_value_info("s", TP.INT64, [None])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": np.ones(2, np.float32), "s": np.array(target, np.int64)}
    for optimize in (True, False):
        with pytest.raises(kiln.KernelError):
            _kiln(m, feed, backend, optimize)


# -- NaN and extreme attribute values as onnxruntime and onnx.reference ----------------------

def _node_model(node: onnx.NodeProto, shape, t=TP.FLOAT, opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", t, shape)],
                              [helper.make_tensor_value_info("y", t, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_maxpool_skips_a_nan_as_the_reference_and_onnxruntime_do(backend):
    """A NaN in a window is skipped. onnxruntime and onnx.reference each skip it in some
    windows and return NaN in others (order of their maxima; the spec says nothing), so
    Kiln's result must equal each of them wherever that one is a number, and be a number
    everywhere (no window here is all NaN)."""
    from onnx.reference import ReferenceEvaluator

    x = np.arange(64, dtype=np.float32).reshape(1, 1, 8, 8)
    x[0, 0, ::3, ::2] = np.nan
    for kw in ({"kernel_shape": [2, 2]}, {"kernel_shape": [3, 3], "strides": [2, 2]},
               {"kernel_shape": [3, 3]}):
        m = _node_model(helper.make_node("MaxPool", ["x"], ["y"], **kw), [1, 1, 8, 8])
        oracles = [ReferenceEvaluator(m).run(None, {"x": x})[0], _ort(m, {"x": x})[0]]
        for optimize in (True, False):
            got = _kiln(m, {"x": x}, backend, optimize)[0]
            assert not np.isnan(got).any()
            for want in oracles:
                seen = ~np.isnan(want)
                np.testing.assert_array_equal(got[seen], want[seen])


@pytest.mark.parametrize("backend", BACKENDS)
def test_elu_with_alpha_minus_infinity_is_onnxruntimes(backend):
    """x >= 0 gives x whatever alpha is (onnxruntime; the reference's 0 * -inf is NaN)."""
    m = _node_model(helper.make_node("Elu", ["x"], ["y"], alpha=float("-inf")), [5])
    x = {"x": np.array([-1, 0, 1, -0.0, -5], np.float32)}
    for optimize in (True, False):
        np.testing.assert_array_equal(_kiln(m, x, backend, optimize)[0], _ort(m, x)[0])


def test_celu_fp16_is_refused_as_onnxruntime_does_and_its_kernel_is_the_references():
    """onnxruntime has no fp16 Celu (the schema takes float only), so loading one is refused
    as a type-constraint violation. The kernel itself, reached by Kiln's own rewrites,
    computes alpha = 1e-30 in float as the reference does, where fp16 would make it 0 and
    x / alpha NaN at x = 0."""
    from onnx.reference import ReferenceEvaluator

    from kiln.ops.activation import celu

    m = _node_model(helper.make_node("Celu", ["x"], ["y"], alpha=1e-30), [5], TP.FLOAT16)
    x = {"x": np.array([-1, 0, 1, -5, 2], np.float16)}
    assert _ort_refuses(m, x)
    with pytest.raises(kiln.errors.InvalidAttributeError, match="tensor\\(float16\\)"):
        kiln.load(m)
    with np.errstate(all="ignore"):
        want = ReferenceEvaluator(m).run(None, x)[0]
    np.testing.assert_array_equal(celu(x["x"], alpha=1e-30), want)


# -- input types against the op's type constraints -----------------------------------------

@pytest.mark.parametrize("computed", [False, True], ids=["initializer", "computed"])
def test_an_input_type_the_schema_does_not_allow_is_refused(computed):
    """Split's ``split`` input is int64; a float one (from an initializer, or computed by
    another node, found only by inference) ran in Kiln where onnxruntime refuses it."""
    sizes = _I(np.array([1.0, 2.0], np.float32), "c")
    nodes = [helper.make_node("Split", ["x", "d" if computed else "c"], ["y", "z"], axis=0)]
    if computed:
        nodes.insert(0, helper.make_node("Identity", ["c"], ["d"]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TP.FLOAT, [3])],
                              [helper.make_tensor_value_info(o, TP.FLOAT, None)
                               for o in ("y", "z")], [sizes])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert _ort_refuses(m, {"x": np.ones(3, np.float32)})
    with pytest.raises(kiln.errors.InvalidAttributeError, match=r"input 1 is tensor\(float\)"):
        kiln.InferenceSession(m.SerializeToString())


def test_inputs_sharing_a_type_parameter_must_agree():
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
        [_I(np.ones(2, np.float64), "w")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert _ort_refuses(m, {"x": np.ones(2, np.float32)})
    with pytest.raises(kiln.errors.InvalidAttributeError, match="one type"):
        kiln.load(m)


# -- found by the grown fuzzer oracle (onnxruntime refused, Kiln ran) -----------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_split_sizes_that_do_not_cut_the_axis_into_its_outputs_are_an_error(backend):
    """A one-output Split was dropped as an identity whatever its sizes; sizes not summing
    to the axis were cut short. onnxruntime refuses both (fuzz case 6006323)."""
    for sizes, outs in (([4, 3], ["y"]), ([1, 1], ["y", "z"])):
        graph = helper.make_graph(
            [helper.make_node("Split", ["x", "s"], outs, axis=0)], "g",
            [helper.make_tensor_value_info("x", TP.FLOAT, [3, 4])],
            [helper.make_tensor_value_info(o, TP.FLOAT, None) for o in outs],
            [_I(np.array(sizes, np.int64), "s")])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        feed = {"x": np.ones((3, 4), np.float32)}
        assert _ort_refuses(m, feed)
        for optimize in (True, False):
            with pytest.raises(kiln.KilnError, match="Split"):
                _kiln(m, feed, backend, optimize)


@pytest.mark.parametrize("backend", BACKENDS)
def test_slice_starts_of_rank_two_are_an_error(backend):
    graph = helper.make_graph(
        [helper.make_node("Slice", ["x", "st", "en"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TP.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
        [_I(np.array([[0, 1]], np.int64), "st"), _I(np.array([[2, 3]], np.int64), "en")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": np.ones((3, 4), np.float32)}
    assert _ort_refuses(m, feed)
    for optimize in (True, False):
        with pytest.raises(kiln.KilnError, match="1-D"):
            _kiln(m, feed, backend, optimize)


def _refused_as_onnxruntime_does(m: onnx.ModelProto, feed: dict, match: str) -> None:
    assert _ort_refuses(m, feed)
    with pytest.raises(kiln.ModelLoadError, match=match):
        kiln.InferenceSession(m.SerializeToString())


def test_conv_and_pool_lists_of_the_wrong_length_are_refused():
    """kernel_shape [5, 1, 2^40, 0] on a 2-D Conv ran from the weights' shape (fuzz case
    6005176); pads, strides likewise."""
    w = _I(np.ones((1, 2, 3, 3), np.float32), "w")
    feed = {"x": np.ones((1, 2, 4, 4), np.float32)}
    for op, ins, attrs in (("Conv", ["x", "w"], {"kernel_shape": [5, 1, 2**40]}),
                           ("Conv", ["x", "w"], {"pads": [1, 1]}),
                           ("MaxPool", ["x"], {"kernel_shape": [2, 2], "strides": [1]})):
        graph = helper.make_graph(
            [helper.make_node(op, ins, ["y"], **attrs)], "g",
            [helper.make_tensor_value_info("x", TP.FLOAT, [1, 2, 4, 4])],
            [helper.make_tensor_value_info("y", TP.FLOAT, None)], [w] if "w" in ins else [])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        _refused_as_onnxruntime_does(m, feed, "entries for its rank-4 input")


def test_a_transpose_perm_that_is_no_permutation_is_refused():
    m = _one(helper.make_node("Transpose", ["x"], ["y"], perm=[0, 0]), [2, 3])
    _refused_as_onnxruntime_does(m, {"x": np.ones((2, 3), np.float32)}, "permutation")


def test_a_model_without_opset_import_or_input_types_is_refused():
    m = _one(helper.make_node("Relu", ["x"], ["y"]), [2])
    del m.opset_import[:]
    _refused_as_onnxruntime_does(m, {"x": np.ones(2, np.float32)}, "imports no opset")
    m = _one(helper.make_node("Relu", ["x"], ["y"]), [2])
    m.graph.input[0].type.Clear()
    _refused_as_onnxruntime_does(m, {"x": np.ones(2, np.float32)}, "declares no type")


def test_an_attribute_whose_value_is_not_in_its_types_field_is_refused():
    """An INT attribute holding a float (fuzz case 6013703, on an ``__``-prefixed one):
    Kiln read the INT field's default 0; onnxruntime refuses the mismatch."""
    m = _one(helper.make_node("Gather", ["x", "i"], ["y"], axis=1), [2, 3], 17,
             [_I(np.array([0], np.int64), "i")])
    a = m.graph.node[0].attribute[0]
    a.ClearField("i")
    a.f = 1.0  # still typed INT
    _refused_as_onnxruntime_does(m, {"x": np.ones((2, 3), np.float32)}, "holds its value in f")


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_if_condition_of_several_elements_is_an_error(backend):
    """Kiln read the first element (fuzz case 7031583); onnxruntime refuses the run."""
    branch = [helper.make_graph([helper.make_node("Identity", ["x"], [f"o{k}"])], f"b{k}", [],
                                [helper.make_tensor_value_info(f"o{k}", TP.FLOAT, None)])
              for k in (0, 1)]
    graph = helper.make_graph(
        [helper.make_node("Greater", ["x", "zero"], ["c"]),
         helper.make_node("If", ["c"], ["y"], then_branch=branch[0], else_branch=branch[1])],
        "g", [helper.make_tensor_value_info("x", TP.FLOAT, [3])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)],
        [_I(np.array(0, np.float32), "zero")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": np.array([1, -1, 2], np.float32)}
    assert _ort_refuses(m, feed)
    for optimize in (True, False):
        with pytest.raises(kiln.KilnError, match="one element"):
            _kiln(m, feed, backend, optimize)


def test_shape_and_axes_inputs_of_another_rank_than_one_are_refused():
    """A Reshape to [[4, 3]] and a ReduceSum over axes given as a scalar ran, flattened
    (fuzz cases 8000986, 8007620); the spec makes both 1-D and onnxruntime refuses them."""
    feed = {"x": np.ones((3, 4), np.float32)}
    for op, value in (("Reshape", np.array([[4, 3]], np.int64)),
                      ("ReduceSum", np.array(1, np.int64))):
        m = _one(helper.make_node(op, ["x", "v"], ["y"]), [3, 4], 17, [_I(value, "v")])
        _refused_as_onnxruntime_does(m, feed, "takes a 1-D tensor")


def test_window_attributes_below_their_spec_bounds_are_refused():
    """Negative pads and a zero kernel dim ran (fuzz cases 8049720, 8067286)."""
    w = _I(np.ones((1, 2, 3, 3), np.float32), "w")
    feed = {"x": np.ones((1, 2, 4, 4), np.float32)}
    for attrs in ({"pads": [-1, 0, 0, 0]}, {"kernel_shape": [3, 0]}, {"strides": [0, 1]}):
        graph = helper.make_graph(
            [helper.make_node("Conv", ["x", "w"], ["y"], **attrs)], "g",
            [helper.make_tensor_value_info("x", TP.FLOAT, [1, 2, 4, 4])],
            [helper.make_tensor_value_info("y", TP.FLOAT, None)], [w])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        _refused_as_onnxruntime_does(m, feed, "entries")


_DEFAULT_AXIS_CASES = [  # (op, opset, input shape, extra inputs): the default axis is out
    ("Softmax", 13, [], []), ("LogSoftmax", 13, [], []),  # -1 on a scalar
    ("Softmax", 11, [4], []), ("Hardmax", 11, [4], []),  # 1 on a rank-1 input
    ("Gather", 13, [], [_I(np.array(0, np.int64), "i")]),  # 0 on a scalar
    ("Flatten", 13, [], []), ("Split", 13, [], []), ("LpNormalization", 1, [], []),
    ("ArgMax", 13, [], [])]


@pytest.mark.parametrize("known_rank", [True, False], ids=["rank-known", "rank-unknown"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op,opset,shape,inits", _DEFAULT_AXIS_CASES,
                         ids=[f"{c[0]}-{c[1]}" for c in _DEFAULT_AXIS_CASES])
def test_an_absent_axis_whose_default_is_outside_the_rank_is_refused(op, opset, shape, inits,
                                                                    backend, known_rank):
    """The axis check read only a written attribute: Softmax-13 (default -1) and
    LpNormalization (default -1) ran on a scalar, which onnxruntime refuses."""
    m = _one(helper.make_node(op, ["x", *[t.name for t in inits]], ["y"]),
             shape if known_rank else None, opset, inits,
             out_type=TP.INT64 if op == "ArgMax" else TP.FLOAT)
    feed = {"x": np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)}
    if known_rank or op != "ArgMax":  # onnxruntime's ArgMax kernel takes a scalar's axis 0
        assert _ort_refuses(m, feed)
    if known_rank:
        with pytest.raises(kiln.errors.InvalidAttributeError, match=r"absent: its default"):
            kiln.load(m)
    for optimize in (True, False):  # at run time (rank unknown) some kernels name the dim
        with pytest.raises(kiln.KilnError, match=r"(?i)axis|0-dim"):
            _kiln(m, feed, backend, optimize)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_absent_axis_whose_default_fits_still_runs(backend):
    """The defaults are read per op version: Softmax-11's 1 on a rank-2 input, -1 at 13."""
    for opset in (11, 13):
        m = _one(helper.make_node("Softmax", ["x"], ["y"]), [2, 3], opset)
        feed = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
        np.testing.assert_allclose(_kiln(m, feed, backend)[0], _ort(m, feed)[0], rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scalar_onehot_indices_are_refused_as_onnxruntime_does(backend):
    """ONNX's shape inference takes OneHot's indices at rank 1 or more; Kiln ran a scalar."""
    inits = [_I(np.array(3, np.int64), "d"), _I(np.array([0, 1], np.float32), "v")]
    feed = {"x": np.array(1, np.int64)}
    for known_rank in (True, False):
        m = _one(helper.make_node("OneHot", ["x", "d", "v"], ["y"]),
                 [] if known_rank else None, 17, inits, x_type=TP.INT64)
        assert _ort_refuses(m, feed)
        with pytest.raises(kiln.KilnError, match="rank 1 or more"):
            _kiln(m, feed, backend)


@pytest.mark.parametrize("fed", [False, True], ids=["constant-weights", "fed-weights"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op", ["Conv", "ConvTranspose"])
def test_a_kernel_shape_other_than_the_weights_is_refused(op, backend, fed):
    """A Conv with kernel_shape [2, 2] and 3x3 weights ran from the weights' shape (fuzz
    campaign of 2026-11-28, two cases); onnxruntime refuses it, ``onnx.reference`` fails
    reshaping the weights. The weights' own kernel_shape still runs."""
    from onnx.reference import ReferenceEvaluator

    w = np.linspace(-1, 1, 36, dtype=np.float32).reshape(2, 2, 3, 3)
    feed = {"x": np.linspace(0, 1, 32, dtype=np.float32).reshape(1, 2, 4, 4)}
    if fed:
        feed["w"] = w
    for ks in ([2, 2], [3, 3]):
        graph = helper.make_graph(
            [helper.make_node(op, ["x", "w"], ["y"], kernel_shape=ks, pads=[1] * 4)], "g",
            [helper.make_tensor_value_info("x", TP.FLOAT, [1, 2, 4, 4])] +
            ([helper.make_tensor_value_info("w", TP.FLOAT, None)] if fed else []),
            [helper.make_tensor_value_info("y", TP.FLOAT, None)], [] if fed else [_I(w, "w")])
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        if ks == [3, 3]:
            np.testing.assert_allclose(_kiln(m, feed, backend)[0],
                                       ReferenceEvaluator(m).run(None, feed)[0], atol=1e-5)
            continue
        assert _ort_refuses(m, feed)
        with pytest.raises(kiln.KilnError, match=r"kernel_shape.*\[2, 2\].*\[3, 3\]"):
            _kiln(m, feed, backend)


def _normalizer(locale: str, action: str) -> onnx.ModelProto:
    node = helper.make_node("StringNormalizer", ["x"], ["y"], case_change_action=action,
                            locale=locale)
    return _one(node, [5], 17, x_type=TP.STRING, out_type=TP.STRING)


_WORDS = np.array(["HeLLo", "straße", "İstanbul", "ÀÉÎ àéî", "ǅ ᾳ ŉ ﬁ"], dtype=object)


@pytest.mark.parametrize("action", ["LOWER", "UPPER"])
@pytest.mark.parametrize("locale", ["C", "POSIX", "C.UTF-8"])
def test_string_normalizer_changes_case_as_onnxruntime_in_that_locale(locale, action):
    """Python's full case mapping made "ß" "SS" and "İ" two characters, and changed
    non-ASCII letters in the C locale; onnxruntime maps one character at a time (Unicode's
    simple mapping; ASCII only in C and POSIX)."""
    m = _normalizer(locale, action)
    feed = {"x": _WORDS}
    assert _kiln(m, feed, "numpy")[0].tolist() == _ort(m, feed)[0].tolist()


@pytest.mark.parametrize("locale", ["bogus", "xx_YY", "tr_TR"])
def test_a_string_normalizer_locale_kiln_cannot_follow_is_refused(locale):
    """An unknown locale ran with Python's mapping; onnxruntime refuses a locale its C
    library cannot build (here, every one but C, POSIX and C.UTF-8) when the case changes,
    and Turkish (its own dotless i) is one Kiln does not implement. Without a case change
    the locale is unused, and both run."""
    feed = {"x": _WORDS}
    m = _normalizer(locale, "LOWER")
    assert _ort_refuses(m, feed)
    with pytest.raises(kiln.errors.InvalidAttributeError, match="'locale'"):
        kiln.load(m)
    m = _normalizer(locale, "NONE")
    assert _kiln(m, feed, "numpy")[0].tolist() == _ort(m, feed)[0].tolist()


def test_a_constant_without_exactly_one_value_is_refused():
    """A Constant node with no value that nothing reads ran (fuzz case 11002581, and the
    campaign of 2026-11-28's two cases onnxruntime refused at graph.cc:1357): the spec asks
    for exactly one value attribute; onnxruntime refuses none whatever reads the node, and
    of two it takes the first written where ``onnx.reference`` takes ``value_float``."""
    from onnx.reference import ReferenceEvaluator

    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"]), helper.make_node("Relu", ["x"], ["y"])],
        "g", [helper.make_tensor_value_info("x", TP.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TP.FLOAT, None)])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    _refused_as_onnxruntime_does(m, {"x": np.ones(2, np.float32)}, "exactly one of value")
    node = helper.make_node("Constant", [], ["y"])
    node.attribute.extend([helper.make_attribute("value_int", 2),
                           helper.make_attribute("value_float", 1.0)])
    graph = helper.make_graph([node], "g", [], [onnx.ValueInfoProto(name="y")])
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert _ort(m, {})[0].dtype != ReferenceEvaluator(m).run(None, {})[0].dtype
    with pytest.raises(kiln.ModelLoadError, match="exactly one of value"):
        kiln.load(m)


def test_an_ir_version_past_the_installed_onnxs_is_refused():
    """IR version 122 (a flipped byte, fuzz case 12517373) ran; onnxruntime refuses any
    past the one it supports, as Kiln now refuses any past the installed onnx's."""
    m = _one(helper.make_node("Relu", ["x"], ["y"]), [2])
    feed = {"x": np.array([-1, 1], np.float32)}
    for version, refused in ((onnx.IR_VERSION, False), (onnx.IR_VERSION + 1, True),
                             (122, True)):
        m.ir_version = version
        if version != onnx.IR_VERSION + 1:  # onnxruntime's newest may be past onnx's
            assert _ort_refuses(m, feed) == refused
        if refused:
            with pytest.raises(kiln.ModelLoadError, match="IR version"):
                kiln.InferenceSession(m.SerializeToString())
        else:
            np.testing.assert_array_equal(_kiln(m, feed, "numpy")[0], _ort(m, feed)[0])


@pytest.mark.parametrize("used", [False, True])
def test_a_node_of_a_domain_the_model_does_not_import_is_refused(used):
    """Fuzz case 13936825: an Expand whose domain a flipped byte made 'x', a domain the
    model imports no opset of, ran when no output read it; onnxruntime refuses the model
    used or not (and the used one was called a missing kernel "at opset 17")."""
    m = _one(helper.make_node("Relu", ["x"], ["y"]), [2])
    feed = {"x": np.array([-1, 1], np.float32)}
    (want,) = _ort(m, feed)
    m.graph.node.append(helper.make_node("Neg", ["x"], ["z"], domain="x"))
    if used:
        m.graph.output.append(helper.make_tensor_value_info("z", TP.FLOAT, None))
    assert _ort_refuses(m, feed)
    with pytest.raises(kiln.ModelLoadError, match="domain 'x' has no entry in the model's "
                                                  "opset_import"):
        kiln.InferenceSession(m.SerializeToString())
    m.opset_import.append(helper.make_opsetid("x", 1))  # imported and unused: dropped
    if not used:
        np.testing.assert_array_equal(_kiln(m, feed, "numpy")[0], want)
