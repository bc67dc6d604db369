"""Control flow, sequences, optionals and the other ops of that family (strings, signal,
ai.onnx.ml) on small models built with onnx.helper, checked against onnxruntime."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import kiln
from conftest import make_model, ort_run

F = T.FLOAT


def vi(name, elem=F, shape=None):
    return h.make_tensor_value_info(name, elem, shape)


def seq_vi(name, elem=F):
    return h.make_value_info(name, h.make_sequence_type_proto(h.make_tensor_type_proto(elem, None)))


def const(name, value, dtype=np.int64):
    return h.make_node("Constant", [], [name], value=onnx.numpy_helper.from_array(
        np.asarray(value, dtype=dtype), name))


def check(model, feeds, rtol=1e-5, atol=1e-6):
    """Kiln's outputs equal onnxruntime's: same types, shapes and values."""
    got = kiln.InferenceSession(model.SerializeToString()).run(None, feeds)
    want = ort_run(model, feeds)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        if isinstance(w, list):
            assert isinstance(g, list) and len(g) == len(w)
            pairs = list(zip(g, w))
        else:
            pairs = [(g, w)]
        for a, b in pairs:
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, a.shape, b.dtype, b.shape)
            if a.dtype == object:
                assert a.tolist() == b.tolist()
            else:
                np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
    return got


# -- If ---------------------------------------------------------------------------------


def _if_model():
    """y = x * x in the outer graph; the branches read it from the enclosing scope."""
    then_g = h.make_graph([h.make_node("Add", ["x", "y"], ["t"])], "then", [], [vi("t")])
    else_g = h.make_graph([h.make_node("Sub", ["x", "y"], ["e"])], "else", [], [vi("e")])
    nodes = [h.make_node("Mul", ["x", "x"], ["y"]),
             h.make_node("If", ["c"], ["out"], then_branch=then_g, else_branch=else_g)]
    return make_model(nodes, [vi("x", F, [3]), vi("c", T.BOOL, [])], [vi("out")])


@pytest.mark.parametrize("cond", [True, False])
def test_if_branch_reads_outer_scope(cond):
    x = np.array([1.0, -2.0, 3.5], np.float32)
    check(_if_model(), {"x": x, "c": np.array(cond)})


def test_if_branches_output_sequences():
    then_g = h.make_graph([h.make_node("SequenceConstruct", ["x", "x"], ["s"])], "then", [],
                          [seq_vi("s")])
    else_g = h.make_graph([h.make_node("SequenceConstruct", ["x"], ["s2"])], "else", [],
                          [seq_vi("s2")])
    model = make_model([h.make_node("If", ["c"], ["out"], then_branch=then_g,
                                    else_branch=else_g)],
                       [vi("x", F, [2]), vi("c", T.BOOL, [])], [seq_vi("out")])
    for c in (True, False):
        got = check(model, {"x": np.array([1, 2], np.float32), "c": np.array(c)})
        assert len(got[0]) == (2 if c else 1)


# -- Loop -------------------------------------------------------------------------------


def _running_sum_loop(with_cond: bool):
    """s += x per iteration (x from the outer scope); scan output: s after each step, and
    with ``with_cond`` the loop also stops once the sum reaches ``limit``."""
    body_nodes = [h.make_node("Add", ["s_in", "x"], ["s_out"]),
                  h.make_node("Identity", ["s_out"], ["scan"]),
                  h.make_node("Cast", ["i"], ["i_f"], to=F),
                  h.make_node("Mul", ["i_f", "x"], ["i_x"])]
    if with_cond:
        body_nodes += [h.make_node("ReduceSum", ["s_out"], ["tot"], keepdims=0),
                       h.make_node("Less", ["tot", "limit"], ["c_out"])]
    else:
        body_nodes += [h.make_node("Identity", ["c_in"], ["c_out"])]
    body = h.make_graph(body_nodes, "body",
                        [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("s_in", F, [2])],
                        [vi("c_out", T.BOOL, []), vi("s_out", F, [2]), vi("scan", F, [2]),
                         vi("i_x", F, [2])])
    inputs = [vi("M", T.INT64, []), vi("c", T.BOOL, []), vi("x", F, [2]), vi("s0", F, [2])]
    if with_cond:
        inputs.append(vi("limit", F, []))
    node = h.make_node("Loop", ["M", "c", "s0"], ["s_final", "sums", "ixs"], body=body)
    return make_model([node], inputs, [vi("s_final"), vi("sums"), vi("ixs")])


@pytest.mark.parametrize("trips", [1, 4])
def test_loop_running_sum_with_scan_outputs(trips):
    feeds = {"M": np.array(trips, np.int64), "c": np.array(True),
             "x": np.array([1.0, 0.5], np.float32), "s0": np.array([0.0, 10.0], np.float32)}
    got = check(_running_sum_loop(False), feeds)
    assert got[1].shape == (trips, 2)


def test_loop_stops_on_condition():
    feeds = {"M": np.array(100, np.int64), "c": np.array(True),
             "x": np.array([1.0, 2.0], np.float32), "s0": np.zeros(2, np.float32),
             "limit": np.array(10.0, np.float32)}
    got = check(_running_sum_loop(True), feeds)
    assert got[1].shape[0] == 4  # sums 3, 6, 9, 12: stops after the fourth


def test_loop_with_false_condition_runs_zero_times():
    feeds = {"M": np.array(5, np.int64), "c": np.array(False),
             "x": np.array([1.0, 2.0], np.float32), "s0": np.array([3.0, 4.0], np.float32)}
    got = kiln.InferenceSession(_running_sum_loop(False).SerializeToString()).run(None, feeds)
    np.testing.assert_array_equal(got[0], feeds["s0"])
    assert got[1].shape == (0, 2) and got[1].dtype == np.float32


def test_loop_carries_a_sequence():
    """A loop whose carried value is a sequence, built up one tensor per iteration."""
    body = h.make_graph(
        [h.make_node("Identity", ["c_in"], ["c_out"]),
         h.make_node("Cast", ["i"], ["i_f"], to=F),
         h.make_node("Add", ["x", "i_f"], ["item"]),
         h.make_node("SequenceInsert", ["seq_in", "item"], ["seq_out"])],
        "body", [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), seq_vi("seq_in")],
        [vi("c_out", T.BOOL, []), seq_vi("seq_out")])
    nodes = [h.make_node("SequenceEmpty", [], ["empty"], dtype=F),
             h.make_node("Loop", ["M", "", "empty"], ["seq"], body=body),
             h.make_node("ConcatFromSequence", ["seq"], ["cat"], axis=0, new_axis=1)]
    model = make_model(nodes, [vi("M", T.INT64, []), vi("x", F, [3])], [vi("cat")])
    got = check(model, {"M": np.array(3, np.int64), "x": np.arange(3, dtype=np.float32)})
    assert got[0].shape == (3, 3)


# -- Scan -------------------------------------------------------------------------------


def _cumsum_scan(opset=11, **attrs):
    body = h.make_graph([h.make_node("Add", ["acc", "row"], ["acc_out"]),
                         h.make_node("Identity", ["acc_out"], ["y"])],
                        "body", [vi("acc", F, [2]), vi("row", F, [2])],
                        [vi("acc_out", F, [2]), vi("y", F, [2])])
    node = h.make_node("Scan", ["init", "xs"], ["final", "ys"], body=body, num_scan_inputs=1,
                       **attrs)
    return make_model([node], [vi("init", F, [2]), vi("xs", F, None)],
                      [vi("final"), vi("ys")], opset=opset)


@pytest.mark.parametrize("attrs", [
    {},
    {"scan_input_directions": [1]},
    {"scan_output_directions": [1]},
    {"scan_input_axes": [1], "scan_output_axes": [1]},
    {"scan_input_axes": [-1], "scan_output_axes": [-1], "scan_input_directions": [1]},
])
def test_scan_cumulative_sum(attrs):
    xs = np.arange(10, dtype=np.float32).reshape(5, 2)
    if attrs.get("scan_input_axes"):
        xs = np.ascontiguousarray(xs.T)
    feeds = {"init": np.array([1.0, -1.0], np.float32), "xs": xs}
    check(_cumsum_scan(**attrs), feeds)


def test_scan_opset8_batched_with_sequence_lengths():
    body = h.make_graph([h.make_node("Add", ["acc", "row"], ["acc_out"]),
                         h.make_node("Identity", ["acc_out"], ["y"])],
                        "body", [vi("acc", F, [2]), vi("row", F, [2])],
                        [vi("acc_out", F, [2]), vi("y", F, [2])])
    node = h.make_node("Scan", ["lens", "init", "xs"], ["final", "ys"], body=body,
                       num_scan_inputs=1, directions=[0])
    model = make_model([node], [vi("lens", T.INT64, [2]), vi("init", F, [2, 2]),
                                vi("xs", F, [2, 4, 2])], [vi("final"), vi("ys")], opset=8)
    model.ir_version = 3
    feeds = {"lens": np.array([4, 2], np.int64), "init": np.zeros((2, 2), np.float32),
             "xs": np.arange(16, dtype=np.float32).reshape(2, 4, 2)}
    check(model, feeds)


# -- Nested control flow ----------------------------------------------------------------


def test_loop_nested_in_if():
    """The then-branch runs a Loop that doubles x M times; M and x live two scopes up."""
    body = h.make_graph([h.make_node("Identity", ["c_in"], ["c_out"]),
                         h.make_node("Add", ["v_in", "v_in"], ["v_out"])],
                        "body", [vi("i", T.INT64, []), vi("c_in", T.BOOL, []), vi("v_in", F, [2])],
                        [vi("c_out", T.BOOL, []), vi("v_out", F, [2])])
    then_g = h.make_graph([h.make_node("Loop", ["M", "", "x"], ["looped"], body=body)],
                          "then", [], [vi("looped", F, [2])])
    else_g = h.make_graph([h.make_node("Neg", ["x"], ["neg"])], "else", [], [vi("neg", F, [2])])
    model = make_model([h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)],
                       [vi("c", T.BOOL, []), vi("M", T.INT64, []), vi("x", F, [2])], [vi("y")])
    for c in (True, False):
        check(model, {"c": np.array(c), "M": np.array(3, np.int64),
                      "x": np.array([1.0, -0.5], np.float32)})


# -- Sequences and optionals ------------------------------------------------------------


def test_sequence_pipeline():
    """Split -> insert -> erase -> map (+1 per item) -> length, at, concat."""
    map_body = h.make_graph([h.make_node("Add", ["item", "one"], ["out"])], "map",
                            [vi("item", F, None)], [vi("out", F, None)])
    nodes = [h.make_node("SplitToSequence", ["x"], ["parts"], axis=0, keepdims=1),
             const("pos", 1),
             h.make_node("SequenceInsert", ["parts", "extra", "pos"], ["with_extra"]),
             const("last", -1),
             h.make_node("SequenceErase", ["with_extra", "last"], ["erased"]),
             const("one", 1.0, np.float32),
             h.make_node("SequenceMap", ["erased"], ["mapped"], body=map_body),
             h.make_node("SequenceLength", ["mapped"], ["n"]),
             h.make_node("SequenceAt", ["mapped", "pos"], ["second"]),
             h.make_node("ConcatFromSequence", ["mapped"], ["cat"], axis=0),
             h.make_node("ConcatFromSequence", ["mapped"], ["stacked"], axis=-1, new_axis=1)]
    model = make_model(nodes, [vi("x", F, [3, 2]), vi("extra", F, [1, 2])],
                       [vi("n", T.INT64, []), vi("second"), vi("cat"), vi("stacked"),
                        seq_vi("mapped")])
    check(model, {"x": np.arange(6, dtype=np.float32).reshape(3, 2),
                  "extra": np.array([[9.0, 8.0]], np.float32)})


@pytest.mark.parametrize("split", [None, np.array(2, np.int64), np.array([1, 4], np.int64)])
def test_split_to_sequence(split):
    inputs = ["x"] if split is None else ["x", "split"]
    # keepdims only applies without split (onnxruntime also drops the axis with a split)
    node = h.make_node("SplitToSequence", inputs, ["s"], axis=1, keepdims=int(split is not None))
    model = make_model([node], [vi("x", F, [2, 5])] + ([vi("split", T.INT64, None)]
                                                       if split is not None else []),
                       [seq_vi("s")])
    feeds = {"x": np.arange(10, dtype=np.float32).reshape(2, 5)}
    if split is not None:
        feeds["split"] = split
    check(model, feeds)


def test_optional_round_trip():
    nodes = [h.make_node("Optional", ["x"], ["opt"]),
             h.make_node("OptionalHasElement", ["opt"], ["has"]),
             h.make_node("OptionalGetElement", ["opt"], ["back"]),
             h.make_node("Optional", [], ["none"], type=h.make_tensor_type_proto(F, None)),
             h.make_node("OptionalHasElement", ["none"], ["has_none"])]
    model = make_model(nodes, [vi("x", F, [2])],
                       [vi("has", T.BOOL, []), vi("back"), vi("has_none", T.BOOL, [])],
                       opset=18)
    got = check(model, {"x": np.array([1.0, 2.0], np.float32)})
    assert bool(got[0]) and not bool(got[2])


# -- Strings ----------------------------------------------------------------------------


def _strings(*values):
    return np.array(values, dtype=object)


@pytest.mark.parametrize("attrs", [
    {"case_change_action": "UPPER", "stopwords": ["monday"]},
    {"case_change_action": "LOWER", "is_case_sensitive": 1, "stopwords": ["Monday"]},
    {"stopwords": ["MONDAY", "tuesday"]},
])
def test_string_normalizer(attrs):
    # onnxruntime's default locale (en_US.UTF-8) may not be installed; C.UTF-8 always is
    node = h.make_node("StringNormalizer", ["x"], ["y"], locale="C.UTF-8", **attrs)
    model = make_model([node], [vi("x", T.STRING, [1, 4])], [vi("y", T.STRING, None)])
    check(model, {"x": _strings(["Monday", "tuesday", "Wednesday", "monday"])})


def test_string_concat_split_and_regex():
    nodes = [h.make_node("StringConcat", ["a", "b"], ["ab"]),
             h.make_node("StringSplit", ["ab"], ["parts", "counts"], delimiter="-"),
             h.make_node("RegexFullMatch", ["ab"], ["match"], pattern=r"[a-z]+-\d+")]
    model = make_model(nodes, [vi("a", T.STRING, [3]), vi("b", T.STRING, [])],
                       [vi("parts", T.STRING, None), vi("counts", T.INT64, None),
                        vi("match", T.BOOL, None)], opset=20)
    check(model, {"a": _strings("abc-1", "x--", "Q"), "b": np.array("-42", dtype=object)})


@pytest.mark.parametrize("attrs", [{"maxsplit": 1}, {"delimiter": "ab", "maxsplit": 1},
                                   {"delimiter": ","}])
def test_string_split(attrs):
    model = make_model([h.make_node("StringSplit", ["x"], ["y", "z"], **attrs)],
                       [vi("x", T.STRING, None)],
                       [vi("y", T.STRING, None), vi("z", T.INT64, None)], opset=20)
    x = np.array([["  a  b  c ", ""], ["xabyabz", "ab,,c"]], dtype=object)
    check(model, {"x": x})


@pytest.mark.parametrize("mode", ["TF", "IDF", "TFIDF"])
@pytest.mark.parametrize("strings", [False, True])
def test_tfidf_vectorizer(mode, strings):
    pool = [2, 3, 5, 4, 5, 6, 7, 8, 6, 7]
    attrs = dict(mode=mode, min_gram_length=1, max_gram_length=2, max_skip_count=2,
                 ngram_counts=[0, 4], ngram_indexes=[6, 5, 4, 3, 2, 1, 0],
                 weights=[0.5, 1, 2, 3, 4, 5, 6])
    x = np.array([[1, 1, 3, 3, 3, 7], [8, 6, 7, 5, 6, 8]], np.int64)
    if strings:
        attrs["pool_strings"] = [f"w{v}" for v in pool]
        x = np.vectorize(lambda v: f"w{v}", otypes=[object])(x)
        elem = T.STRING
    else:
        attrs["pool_int64s"] = pool
        elem = T.INT64
    model = make_model([h.make_node("TfIdfVectorizer", ["x"], ["y"], **attrs)],
                       [vi("x", elem, [2, 6])], [vi("y", F, None)], opset=9)
    check(model, {"x": x})


# -- Signal -----------------------------------------------------------------------------


@pytest.mark.parametrize("inverse,onesided,complex_in", [
    (0, 0, False), (0, 1, False), (1, 0, True), (0, 0, True), (1, 1, True)])
def test_dft(inverse, onesided, complex_in):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 3, 2 if complex_in else 1)).astype(np.float32)
    if inverse and onesided:
        x = x[:, :5]
    node = h.make_node("DFT", ["x", "", "axis"], ["y"], inverse=inverse, onesided=onesided)
    model = make_model([const("axis", 1), node], [vi("x", F, None)], [vi("y")], opset=20)
    check(model, {"x": x}, rtol=1e-4, atol=1e-4)


def test_stft_and_windows():
    nodes = [h.make_node("HannWindow", ["n"], ["hann"]),
             h.make_node("HammingWindow", ["n"], ["hamming"], periodic=0),
             h.make_node("BlackmanWindow", ["n"], ["blackman"], output_datatype=T.DOUBLE),
             h.make_node("STFT", ["signal", "step", "hann"], ["spec"])]
    model = make_model(nodes, [vi("n", T.INT64, []), vi("signal", F, [2, 64, 1]),
                               vi("step", T.INT64, [])],
                       [vi("hann"), vi("hamming"), vi("blackman", T.DOUBLE, None), vi("spec")])
    sig = np.random.default_rng(1).standard_normal((2, 64, 1)).astype(np.float32)
    check(model, {"n": np.array(16, np.int64), "signal": sig, "step": np.array(8, np.int64)},
          rtol=1e-4, atol=1e-4)


def test_mel_weight_matrix():
    ins = ["bins", "dft", "rate", "lo", "hi"]
    model = make_model([h.make_node("MelWeightMatrix", ins, ["w"])],
                       [vi("bins", T.INT64, []), vi("dft", T.INT64, []), vi("rate", T.INT64, []),
                        vi("lo", F, []), vi("hi", F, [])], [vi("w")])
    check(model, {"bins": np.array(10, np.int64), "dft": np.array(64, np.int64),
                  "rate": np.array(16000, np.int64), "lo": np.array(100.0, np.float32),
                  "hi": np.array(7000.0, np.float32)})


# -- ai.onnx.ml ------------------------------------------------------------------------


def _ml_model(node, inputs, outputs, ml_opset):
    graph = h.make_graph([node], "ml", inputs, outputs)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 19),
                                               h.make_opsetid("ai.onnx.ml", ml_opset)])
    model.ir_version = 9
    return model


@pytest.mark.parametrize("case", ["str_to_int", "int_to_str", "float_to_float", "tensors"])
def test_label_encoder(case):
    if case == "str_to_int":
        attrs = dict(keys_strings=["a", "b", "c"], values_int64s=[5, 6, 7], default_int64=-9)
        x, ex, ey = _strings("a", "z", "c"), T.STRING, T.INT64
    elif case == "int_to_str":
        attrs = dict(keys_int64s=[3, 1, 2], values_strings=["x", "y", "z"], default_string="?")
        x, ex, ey = np.array([1, 2, 3, 4], np.int64), T.INT64, T.STRING
    elif case == "float_to_float":
        attrs = dict(keys_floats=[0.5, 1.5, float("nan")], values_floats=[1.0, 2.0, 3.0])
        x, ex, ey = np.array([0.5, np.nan, 2.0, 1.5], np.float32), F, F
    else:
        attrs = dict(keys_tensor=onnx.numpy_helper.from_array(np.array([1, 2], np.int64)),
                     values_tensor=onnx.numpy_helper.from_array(np.array([10, 20], np.float64)),
                     default_tensor=onnx.numpy_helper.from_array(np.array([-1], np.float64)))
        x, ex, ey = np.array([[1, 2], [3, 1]], np.int64), T.INT64, T.DOUBLE
    node = h.make_node("LabelEncoder", ["x"], ["y"], domain="ai.onnx.ml", **attrs)
    check(_ml_model(node, [vi("x", ex, None)], [vi("y", ey, None)], 4), {"x": x})


def _random_forest(rng, n_trees, depth, n_features, n_targets, modes):
    """Complete binary trees of the given depth, in TreeEnsemble v5's encoding."""
    nodes = {k: [] for k in ("feat", "split", "mode", "t", "f", "tl", "fl", "nan")}
    leaves_t, leaves_w, roots = [], [], []

    def build(level):
        i = len(nodes["feat"])
        for k in nodes:
            nodes[k].append(0)
        nodes["feat"][i] = int(rng.integers(n_features))
        nodes["split"][i] = float(np.round(rng.standard_normal(), 2))
        nodes["mode"][i] = int(rng.choice(modes))
        nodes["nan"][i] = int(rng.integers(2))
        for side, leaf in (("t", "tl"), ("f", "fl")):
            if level + 1 == depth:
                nodes[side][i] = len(leaves_t)
                nodes[leaf][i] = 1
                leaves_t.append(int(rng.integers(n_targets)))
                leaves_w.append(float(np.round(rng.standard_normal(), 3)))
            else:
                nodes[side][i] = build(level + 1)
        return i

    for _ in range(n_trees):
        roots.append(build(0))
    return dict(
        tree_roots=roots, nodes_featureids=nodes["feat"],
        nodes_splits=onnx.numpy_helper.from_array(np.array(nodes["split"], np.float32)),
        nodes_modes=onnx.numpy_helper.from_array(np.array(nodes["mode"], np.uint8)),
        nodes_truenodeids=nodes["t"], nodes_falsenodeids=nodes["f"],
        nodes_trueleafs=nodes["tl"], nodes_falseleafs=nodes["fl"],
        nodes_missing_value_tracks_true=nodes["nan"], leaf_targetids=leaves_t,
        leaf_weights=onnx.numpy_helper.from_array(np.array(leaves_w, np.float32)),
        n_targets=n_targets)


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
def test_tree_ensemble(aggregate):
    rng = np.random.default_rng(aggregate)
    attrs = _random_forest(rng, n_trees=5, depth=4, n_features=3, n_targets=3,
                           modes=[0, 1, 2, 3, 4, 5])
    node = h.make_node("TreeEnsemble", ["x"], ["y"], domain="ai.onnx.ml",
                       aggregate_function=aggregate, **attrs)
    x = np.round(rng.standard_normal((64, 3)), 2).astype(np.float32)
    x[::7, 1] = np.nan
    check(_ml_model(node, [vi("x", F, None)], [vi("y", F, None)], 5), {"x": x}, atol=1e-5)


@pytest.mark.parametrize("post", [1, 2])
def test_tree_ensemble_post_transform(post):
    """SOFTMAX (1) and LOGISTIC (2) as the spec numbers them; onnxruntime reads the numbers
    in its own older enum order (and skips LOGISTIC for one target), so the reference is
    its untransformed scores, transformed here."""
    rng = np.random.default_rng(7)
    attrs = _random_forest(rng, n_trees=3, depth=3, n_features=2, n_targets=3, modes=[0, 3])
    x = rng.standard_normal((16, 2)).astype(np.float32)
    models = [_ml_model(h.make_node("TreeEnsemble", ["x"], ["y"], domain="ai.onnx.ml",
                                    post_transform=p, **attrs),
                        [vi("x", F, None)], [vi("y", F, None)], 5) for p in (0, post)]
    raw = ort_run(models[0], {"x": x})[0].astype(np.float64)
    if post == 1:
        e = np.exp(raw - raw.max(axis=1, keepdims=True))
        want = e / e.sum(axis=1, keepdims=True)
    else:
        want = 1 / (1 + np.exp(-raw))
    got = kiln.InferenceSession(models[1].SerializeToString()).run(None, {"x": x})[0]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_array_feature_extractor_and_binarizer():
    nodes = [h.make_node("ArrayFeatureExtractor", ["x", "idx"], ["picked"], domain="ai.onnx.ml"),
             h.make_node("Binarizer", ["picked"], ["bin"], domain="ai.onnx.ml", threshold=0.5)]
    graph = h.make_graph(nodes, "ml", [vi("x", F, None), vi("idx", T.INT64, None)],
                         [vi("picked", F, None), vi("bin", F, None)])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 19),
                                               h.make_opsetid("ai.onnx.ml", 3)])
    model.ir_version = 9
    x = np.random.default_rng(2).random((3, 5)).astype(np.float32)
    check(model, {"x": x, "idx": np.array([4, 0, 2], np.int64)})


# -- Random -----------------------------------------------------------------------------


def test_random_ops_shapes_dtypes_and_seeded_replay():
    """Random values cannot be compared with another engine: check types, ranges and
    that a seeded node replays its sequence in a new session."""
    nodes = [h.make_node("RandomUniform", [], ["u"], shape=[3, 4], low=2.0, high=3.0, seed=1.0),
             h.make_node("RandomNormalLike", ["x"], ["n"], dtype=T.DOUBLE),
             h.make_node("Bernoulli", ["p"], ["b"]),
             h.make_node("Multinomial", ["logits"], ["m"], sample_size=7, dtype=T.INT64)]
    model = make_model(nodes, [vi("x", F, [2, 2]), vi("p", F, [5]), vi("logits", F, [2, 3])],
                       [vi("u"), vi("n", T.DOUBLE, None), vi("b"), vi("m", T.INT64, None)])
    feeds = {"x": np.zeros((2, 2), np.float32), "p": np.array([0, 1, 0, 1, 1], np.float32),
             "logits": np.log(np.array([[1, 0, 0], [0, 0, 1]], np.float32) + 1e-30)}
    u, n, b, m = kiln.InferenceSession(model.SerializeToString()).run(None, feeds)
    assert u.shape == (3, 4) and u.dtype == np.float32 and ((u >= 2) & (u < 3)).all()
    assert n.shape == (2, 2) and n.dtype == np.float64
    np.testing.assert_array_equal(b, feeds["p"])  # p in {0, 1} leaves nothing to chance
    assert m.dtype == np.int64 and (m == np.array([[0], [2]])).all()
    again = kiln.InferenceSession(model.SerializeToString()).run(["u"], feeds)[0]
    np.testing.assert_array_equal(u, again)


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_plans_with_subgraphs_run_as_programs(backend):
    """A plan holding If/Loop, and the branch and body plans reading values of enclosing
    scopes (an input, an initializer, a value computed from the input's shape, a count two
    scopes up), run as straight-line programs, and give onnxruntime's results for both
    branches, input lengths that change, and runs that reuse the shape-only values."""
    pytest.importorskip(backend)
    body = h.make_graph([h.make_node("Identity", ["c_in"], ["c_out"]),
                         h.make_node("Add", ["v_in", "n_f"], ["v_out"])],
                        "body", [vi("i", T.INT64, []), vi("c_in", T.BOOL, []),
                                 vi("v_in", F, ["n"])],
                        [vi("c_out", T.BOOL, []), vi("v_out", F, ["n"])])
    then_g = h.make_graph([h.make_node("Add", ["x", "n_f"], ["t0"]),
                           h.make_node("Mul", ["t0", "w"], ["t"])], "then", [], [vi("t", F)])
    else_g = h.make_graph([h.make_node("Loop", ["M", "", "x"], ["e"], body=body)],
                          "else", [], [vi("e", F)])
    nodes = [h.make_node("Shape", ["x"], ["s"]), h.make_node("Cast", ["s"], ["n_f"], to=F),
             h.make_node("If", ["c"], ["y"], then_branch=then_g, else_branch=else_g)]
    model = make_model(nodes, [vi("x", F, ["n"]), vi("c", T.BOOL, []), vi("M", T.INT64, [])],
                       [vi("y", F)], [onnx.numpy_helper.from_array(np.float32(1.5), "w")])
    sess = kiln.InferenceSession(model.SerializeToString(), backend=backend)
    plans = [sess.plan] + [p for s in sess.plan.walk() for p in s.subplans]
    assert len(plans) == 4 and all(p.program is not None for p in plans)
    assert sess.plan.program.once  # Shape and Cast: once per input length
    for n, c in ((3, True), (3, False), (3, True), (5, False), (5, True), (3, False)):
        feeds = {"x": np.arange(n, dtype=np.float32) - 1, "c": np.array(c),
                 "M": np.array(2, np.int64)}
        np.testing.assert_allclose(sess.run(None, feeds)[0], ort_run(model, feeds)[0],
                                   rtol=1e-6)
