"""A fuzzer for Kiln's load -> session -> run path on both backends.

Each case is a small ONNX model with structured mutations (dims, dtypes, attributes,
names, opsets, graph structure, feeds, and now and then flipped bytes of the serialized
file), run in a forked worker (one per up to 200 cases, a fresh one after any failure)
under a memory limit (``resource.setrlimit``) and a per-case time limit. Outcome classes:

- ``correct``: a result equal to onnxruntime's (or onnxruntime refused the model too and
  Kiln raised a KilnError, counted as ``kiln_error``)
- ``kiln_error``: Kiln raised one of its own exceptions
- ``unchecked``: Kiln returned a result where onnxruntime refused the model (no oracle)
- ``unvalidated``: Kiln returned a result where onnxruntime refused a node as failing its
  op's schema (counts, attribute names and types), which Kiln checks at load too
- ``wrong``: a result that differs from onnxruntime's
- ``nan_propagated``: Kiln's result differs only by NaNs where a constant or feed holds a
  NaN or an infinity: IEEE arithmetic carries it (NaN or inf times a zero pad is NaN, as
  in PyTorch), while onnxruntime's kernels skip some products (a convolution's padded
  taps); not a failure
- ``optimizer_failed``: the optimizer raised and the session ran the model unoptimized
- ``other``: any other exception, ``crash``: the worker died, ``timeout``, ``memory``
- ``oracle_crash``: onnxruntime crashed or hung on the case (not Kiln's failure); Kiln then
  runs it again without the oracle, and its own failure, if any, is the class instead

Usage: ``python fuzz/fuzz_kiln.py --seed 0 --cases 2000`` (a seeded, deterministic
campaign; exits 1 on any outcome outside correct / kiln_error / unchecked), or
``--atheris`` to let atheris (coverage-guided, in-process under libFuzzer's own -timeout and
-rss_limit_mb) choose the mutations from its byte stream.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import json
import os
import random
import resource
import select
import signal
import sys
import time
import traceback
import warnings

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper, numpy_helper

OK_CLASSES = frozenset({"correct", "kiln_error", "unchecked", "invalid", "oracle_crash",
                        "nan_propagated", "reference_checked", "ort_differs"})
MEMORY_LIMIT = 2 << 30
TIME_LIMIT_S = 20
DTYPES = [TP.FLOAT, TP.DOUBLE, TP.INT64, TP.INT32, TP.BOOL, TP.FLOAT16, TP.UINT8, TP.STRING,
          999, 0]


# -- seed models ---------------------------------------------------------------------------

def _vi(name, dtype, shape):
    return helper.make_tensor_value_info(name, dtype, shape)


def _seed(rng: random.Random) -> onnx.ModelProto:
    """One of a few small valid models, picked by ``rng``."""
    f = TP.FLOAT
    kind = rng.randrange(9)
    inits: list = []
    if kind == 0:
        nodes = [helper.make_node("Relu", ["x"], ["y"])]
    elif kind == 1:
        nodes = [helper.make_node("Add", ["x", "b"], ["y"])]
        inits = [helper.make_tensor("b", f, [4], [1, 2, 3, 4])]
    elif kind == 2:
        nodes = [helper.make_node("Conv", ["x4", "w"], ["y"], kernel_shape=[3, 3], pads=[1] * 4,
                                  group=1, strides=[1, 1])]
        inits = [helper.make_tensor("w", f, [2, 2, 3, 3], np.linspace(-1, 1, 36).tolist())]
    elif kind == 3:
        nodes = [helper.make_node("Gather", ["x", "idx"], ["y"], axis=1)]
        inits = [helper.make_tensor("idx", TP.INT64, [2], [0, 3])]
    elif kind == 4:
        nodes = [helper.make_node("Reshape", ["x", "shape"], ["r"]),
                 helper.make_node("Transpose", ["r"], ["y"], perm=[1, 0])]
        inits = [helper.make_tensor("shape", TP.INT64, [2], [4, 3])]
    elif kind == 5:
        nodes = [helper.make_node("Softmax", ["x"], ["s"], axis=-1),
                 helper.make_node("ReduceSum", ["s", "axes"], ["y"], keepdims=1)]
        inits = [helper.make_tensor("axes", TP.INT64, [1], [1])]
    elif kind == 6:
        nodes = [helper.make_node("MatMul", ["x", "m"], ["y"])]
        inits = [helper.make_tensor("m", f, [4, 2], np.linspace(-2, 2, 8).tolist())]
    elif kind == 7:
        nodes = [helper.make_node("Slice", ["x", "st", "en"], ["c"]),
                 helper.make_node("Concat", ["c", "c"], ["y"], axis=0)]
        inits = [helper.make_tensor("st", TP.INT64, [2], [0, 1]),
                 helper.make_tensor("en", TP.INT64, [2], [2, 3])]
    else:
        then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"])], "then", [],
                                 [_vi("t", f, None)])
        other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                                  [_vi("e", f, None)])
        nodes = [helper.make_node("ReduceMax", ["x"], ["mx"], keepdims=0),
                 helper.make_node("Greater", ["mx", "zero"], ["c"]),
                 helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
        inits = [helper.make_tensor("zero", f, [], [0.0])]
    x = ("x4", f, [1, 2, 4, 4]) if kind == 2 else ("x", f, [3, 4])
    graph = helper.make_graph(nodes, "fuzz", [_vi(*x)], [_vi("y", f, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


# -- mutations -----------------------------------------------------------------------------

def _pick_dim(rng: random.Random):
    return rng.choice([0, 1, 2, 3, 4, 5, -1, 2**31, 2**62, "N", ""])


def _misspell(name: str, rng: random.Random) -> str:
    """``name`` with one letter dropped, doubled, swapped with the next or changed."""
    i = rng.randrange(len(name))
    how = rng.randrange(4)
    if how == 0:
        return name[:i] + name[i + 1:]
    if how == 1:
        return name[:i] + name[i] + name[i:]
    if how == 2 and i + 1 < len(name):
        return name[:i] + name[i + 1] + name[i] + name[i + 2:]
    return name[:i] + rng.choice("aeiouxs_") + name[i + 1:]


def _mutate(m: onnx.ModelProto, rng: random.Random) -> None:
    g = m.graph
    what = rng.randrange(12)
    if not g.node:
        return
    node = rng.choice(list(g.node))
    if what == 0 and g.input:  # a dim of an input
        dims = g.input[0].type.tensor_type.shape.dim
        if dims:
            d = rng.choice(list(dims))
            v = _pick_dim(rng)
            if isinstance(v, str):
                d.dim_param = v
            else:
                d.dim_value = v
    elif what == 1:  # an element type
        target = rng.choice([vi.type.tensor_type for vi in list(g.input) + list(g.output)]
                            + list(g.initializer))
        if isinstance(target, onnx.TensorProto):
            target.data_type = rng.choice(DTYPES)
        else:
            target.elem_type = rng.choice(DTYPES)
    elif what == 2 and node.attribute:  # an attribute's value or type
        a = rng.choice(list(node.attribute))
        choice = rng.randrange(4)
        if choice == 0 and a.type == onnx.AttributeProto.INT:
            a.i = rng.choice([-(2**62), -5, -1, 0, 7, 2**40])
        elif choice == 1 and a.type == onnx.AttributeProto.INTS:
            del a.ints[:]
            a.ints.extend(rng.choice([-3, 0, 1, 5, 2**40]) for _ in range(rng.randrange(6)))
        elif choice == 2:
            a.type = rng.choice([onnx.AttributeProto.INT, onnx.AttributeProto.INTS,
                                 onnx.AttributeProto.FLOAT, onnx.AttributeProto.STRING,
                                 onnx.AttributeProto.GRAPH, 99])
        else:
            node.attribute.remove(a)
    elif what == 3:  # an attribute misplaced, misspelt, unknown, internal ("__"), repeated
        names = ["axis", "perm", "zz", "alpha", "__origin", ""]
        if node.attribute:
            name = rng.choice(list(node.attribute)).name
            names += [name, _misspell(name, rng)]
        node.attribute.append(helper.make_attribute(rng.choice(names),
                                                    rng.choice([1, [1, 2], 0.5, "x"])))
    elif what == 4:  # the opset
        m.opset_import[0].version = rng.choice([1, 5, 7, 9, 11, 13, 16, 21, 22, 23, 99])
    elif what == 5:  # an extra or missing input / output
        if rng.random() < 0.5:
            node.input.append(rng.choice(["x", "y", "", "nope"]))
        elif node.input:
            del node.input[rng.randrange(len(node.input))]
        else:
            node.output.append("extra")
    elif what == 6:  # names: duplicates, empty, unknown, invalid UTF-8 after serializing
        if node.output:
            node.output[0] = rng.choice(["x", "", "y", "dup", "\ufffd"])
    elif what == 7:  # op type
        node.op_type = rng.choice(["Relu", "Add", "Identity", "NotAnOp", "Loop", "Split",
                                   "Concat", "Constant"])
    elif what == 8 and g.initializer:  # an initializer's dims or data
        t = rng.choice(list(g.initializer))
        if rng.random() < 0.5:
            del t.dims[:]
            for _ in range(rng.randrange(4)):
                d = _pick_dim(rng)
                t.dims.append(d if isinstance(d, int) else 2)
        else:
            t.raw_data = bytes(rng.randrange(256) for _ in range(rng.randrange(40)))
            del t.float_data[:]
            del t.int64_data[:]
    elif what == 9 and len(g.node) > 1 and g.node[-1].output:  # node order / a cycle
        if rng.random() < 0.5:
            nodes = list(g.node)
            rng.shuffle(nodes)
            del g.node[:]
            g.node.extend(nodes)
        else:
            g.node[0].input.append(g.node[-1].output[0])
    elif what == 10:  # a ConstantOfShape or Expand to something big
        g.initializer.append(helper.make_tensor("big", TP.INT64, [2],
                                                [rng.choice([10, 10**5, 10**9]), 10**5]))
        g.node.append(helper.make_node(rng.choice(["ConstantOfShape", "Expand"]),
                                       ["big"] if rng.random() < 0.5 else ["x", "big"],
                                       ["z"]))
    elif g.output:  # drop or rename the graph output
        if rng.random() < 0.5:
            g.output[0].name = rng.choice(["x", "nope", ""])
        else:
            del g.output[:]


def _feed(m: onnx.ModelProto, rng: random.Random) -> dict:
    """A feed that mostly fits the declared input; sometimes it does not."""
    feeds = {}
    for vi in m.graph.input:
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") and 0 <= d.dim_value < 8 else 2
                 for d in t.shape.dim]
        x = np.random.default_rng(rng.randrange(2**32)).standard_normal(shape).astype(np.float32)
        r = rng.random()
        if r < 0.05:
            x = x.astype(">f4")
        elif r < 0.1:
            x = x.astype(np.float64)
        elif r < 0.13:
            x = x.reshape(-1)
        elif r < 0.15:
            x = rng.choice([None, "3.5", [[1.0], [1.0, 2.0]], {"a": 1}])
        feeds[vi.name] = x
    return feeds


def make_case(seed: int) -> tuple[bytes, dict]:
    """The serialized model and the feed of case ``seed`` (deterministic)."""
    rng = random.Random(seed)
    m = _seed(rng)
    for _ in range(rng.choice([0, 1, 1, 2, 3])):
        _mutate(m, rng)
    feeds = _feed(m, rng)
    data = m.SerializeToString()
    if rng.random() < 0.1:  # flip bytes: names turn to invalid UTF-8, fields to garbage
        b = bytearray(data)
        for _ in range(rng.randrange(1, 4)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        data = bytes(b)
    return data, feeds


# -- running one case ----------------------------------------------------------------------

# onnxruntime's words when a node fails its op's schema: Kiln checks the same at load, so a
# model refused with one of these that Kiln runs is a failure (``unvalidated``).
SCHEMA_REFUSALS = ("Unrecognized attribute", "Required attribute", "appeared multiple times",
                   "Mismatched attribute type", "has input size", "has output size")


# "onnxruntime refuses, the spec allows": onnxruntime's refusals of cases Kiln runs, by the
# words of its message, each with the reason Kiln's result stands. A refusal matching none
# of these, where onnx.reference does not give Kiln's result either, is ``unexplained``.
ORT_REFUSES_SPEC_ALLOWS: list[tuple[tuple[str, ...], str]] = [
    (("NOT_IMPLEMENTED", "Could not find an implementation"),
     "onnxruntime has no kernel for this op at this opset and element type; the schema "
     "allows it, and Kiln runs it"),
    (("At least one output should be requested",),
     "the graph has no outputs: onnxruntime will not run a model asked for nothing; Kiln "
     "returns the empty list of outputs the graph defines"),
    (("does not match expected type",),
     "a graph output's declared element type contradicts what its node computes: a "
     "declaration is a claim Kiln checks nothing against (issue 39, item 1), and its result "
     "is what the ops compute"),
]
UNUSED_NODE = ("the node onnxruntime fails on is one no graph output needs (checked on the "
               "graph, not the message): onnxruntime checks and runs every node; Kiln drops "
               "the nodes no output needs, and the outputs it returns do not depend on them")


def _failing_op_unused(data: bytes, message: str) -> bool:
    """Whether the graph has no outputs (no output needs any node, whatever onnxruntime's
    message names: a kernel's constructor failing, case 10501377), or onnxruntime's message
    names the op it failed on and no node a graph output needs is of that op."""
    import re

    g = onnx.load_from_string(data).graph
    if not g.output:
        return True
    hit = re.search(r"Op \((\w+)\)|running (\w+) node|of operator \((\w+)\)|"
                    r"of Optype \((\w+)\)", message)
    if hit is None:
        return False
    op = next(g for g in hit.groups() if g)
    made = {o: n for n in g.node for o in n.output}
    stack, seen = [o.name for o in g.output], set()
    while stack:
        name = stack.pop()
        n = made.get(name)
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        inner = list(_subgraph_nodes(n))
        if n.op_type == op or any(m.op_type == op for m in inner):
            return False
        stack += list(n.input) + [i for m in inner for i in m.input]  # outer names read
    return True


def _subgraph_nodes(n: onnx.NodeProto):
    """Every node of ``n``'s subgraphs, nested ones included."""
    for a in n.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else \
                list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []:
            for m in g.node:
                yield m
                yield from _subgraph_nodes(m)


def _reference(data: bytes, feeds: dict):
    """onnxruntime's outputs, or the message it refused the case with."""
    import onnxruntime as ort

    # onnxruntime reads big-endian arrays' bytes as little-endian; Kiln converts them, so
    # the oracle gets the same values in native order.
    feeds = {k: v.astype(v.dtype.newbyteorder("=")) if isinstance(v, np.ndarray) else v
             for k, v in feeds.items()}
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = opts.inter_op_num_threads = 1  # a third of the session cost
    try:
        s = ort.InferenceSession(data, opts, providers=["CPUExecutionProvider"])
        return s.run(None, feeds)
    except Exception as e:  # noqa: BLE001 - onnxruntime refusing is an answer, not a failure
        return str(e)


def _stage(name: str) -> None:
    """Which side of a case is running; a worker reports it so that a crash is put down to
    onnxruntime or to Kiln."""


def _spec_reference(data: bytes, feeds: dict):
    """``onnx.reference``'s outputs for the case, None where it cannot run it: the second
    oracle, asked where onnxruntime refuses the case or disagrees with Kiln."""
    from onnx.reference import ReferenceEvaluator

    _stage("oracle")  # a crash or hang in the reference is no failure of Kiln's
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            return ReferenceEvaluator(onnx.load_from_string(data)).run(None, feeds)
    except Exception:  # noqa: BLE001 - the reference lacks many ops and checks little
        return None
    finally:
        _stage("kiln")


def _same(got: list, want: list) -> bool:
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        if g.shape != w.shape:
            return False
        if w.dtype == object or g.dtype == object:
            if not np.array_equal(g.astype(object), w.astype(object)):
                return False
            continue
        try:
            if not np.isclose(g.astype(w.dtype), w, rtol=1e-4, atol=1e-5, equal_nan=True).all():
                return False
        except (TypeError, ValueError):
            return False
    return True


def explained(message: str) -> str | None:
    """The documented reason onnxruntime refuses a case Kiln runs, None where there is
    none (:data:`ORT_REFUSES_SPEC_ALLOWS`)."""
    for words, reason in ORT_REFUSES_SPEC_ALLOWS:
        if all(w in message for w in words):
            return reason
    return None


def check(data: bytes, feeds: dict, oracle: bool = True) -> str:
    """Run one case in this process; its outcome class (raises on other exceptions)."""
    return classify(data, feeds, oracle)[0]


def classify(data: bytes, feeds: dict, oracle: bool = True) -> tuple[str, str]:
    """One case's (class, detail). Kiln's results are compared with onnxruntime's and,
    where the two disagree or onnxruntime refuses the case, with ``onnx.reference``'s.
    ``oracle=False`` skips onnxruntime (which crashed on the case)."""
    import kiln

    _stage("oracle")
    want = _reference(data, feeds) if oracle else "onnxruntime crashed on this case"
    _stage("kiln")
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for backend in ("numpy", "torch"):
                results.append(kiln.InferenceSession(data, backend=backend).run(None, feeds))
        except kiln.KilnError:
            return "kiln_error", ""
    if any("Please report this" in str(w.message) for w in caught):
        return "optimizer_failed", ""  # the session fell back to the unoptimized model
    if isinstance(want, str):
        if any(w in want for w in SCHEMA_REFUSALS):
            return "unvalidated", want[:300]
        if not oracle:
            return "unchecked", want
        spec = _spec_reference(data, feeds)
        if spec is not None and all(_same(got, spec) for got in results):
            return "reference_checked", ""
        reason = explained(want) or (UNUSED_NODE if _failing_op_unused(data, want) else None)
        if reason is None:  # Kiln runs what onnxruntime refuses, and no reason is known
            return "unexplained", want[:300]
        return "unchecked", reason
    cls = "correct"
    for got in results:
        for g, w in zip(got, want):
            g, w = np.asarray(g), np.asarray(w)
            if g.shape != w.shape:
                return _second_opinion(data, feeds, results, "shape differs")
            if w.dtype == object:
                continue
            g = g.astype(w.dtype)
            close = np.isclose(g, w, rtol=1e-4, atol=1e-5, equal_nan=True)
            if close.all():
                continue
            if _holds_nonfinite(data, feeds) and np.isnan(g[~close]).all():
                cls = "nan_propagated"
            else:
                return _second_opinion(data, feeds, results, "values differ")
    return cls, ""


def _second_opinion(data: bytes, feeds: dict, results: list, what: str) -> tuple[str, str]:
    """Kiln and onnxruntime disagree: ``ort_differs`` where ``onnx.reference`` gives
    Kiln's result on both backends, ``wrong`` otherwise."""
    spec = _spec_reference(data, feeds)
    if spec is not None and all(_same(got, spec) for got in results):
        return "ort_differs", what
    return "wrong", what


def _holds_nonfinite(data: bytes, feeds: dict) -> bool:
    """Whether a feed or a constant of the model holds a NaN or an infinity (inf * 0 is
    NaN as well)."""
    arrays = [np.asarray(v) for v in feeds.values() if isinstance(v, np.ndarray)]
    try:
        arrays += [numpy_helper.to_array(t) for t in onnx.load_from_string(data).graph.initializer]
    except Exception:  # noqa: BLE001 - a constant onnx cannot read holds no value we can see
        pass
    return any(a.dtype.kind in "fc" and not np.isfinite(a).all() for a in arrays)


def _run_case(seed: int, oracle: bool = True) -> tuple[str, str]:
    """Case ``seed`` in this (worker) process: (class, detail)."""
    try:
        data, feeds = make_case(seed)
    except Exception:  # noqa: BLE001 - a mutation protobuf refuses: no case
        return "invalid", ""
    try:
        return classify(data, feeds, oracle)
    except MemoryError:
        return "memory", "MemoryError"
    except BaseException as e:  # noqa: BLE001 - the class the fuzzer is looking for
        tb = traceback.extract_tb(e.__traceback__)[-1]
        return "other", f"{type(e).__name__}: {str(e)[:200]} at {tb.filename}:{tb.lineno}"


class Worker:
    """A forked process that runs cases one after another under ``RLIMIT_AS`` and a
    per-case alarm. Forking a process that has torch and onnxruntime loaded costs about
    70 ms here, several times a case's own work, so a worker is forked once for up to
    ``RECYCLE`` cases and replaced after any failure (a fresh one for the next case: a
    failure's state never leaks into later cases)."""

    RECYCLE = 200

    def __init__(self, time_limit: float = TIME_LIMIT_S):
        self.time_limit = time_limit
        requests, self._to_worker = os.pipe()
        self._from_worker, replies = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(self._to_worker)
            os.close(self._from_worker)
            self._serve(requests, replies)
        os.close(requests)
        os.close(replies)
        self.cases = 0

    def _serve(self, requests: int, replies: int) -> None:
        global _stage
        try:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
            # onnxruntime prints its provider fallbacks to stdout; results go through a pipe
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            # A crash here is a finding the parent classes from the worker's status
            # (oracle_crash, crash) and reruns by seed; the fault handler pytest or
            # -X faulthandler enabled would print a 40-line stack into the test log.
            faulthandler.disable()
            _stage = lambda name: os.write(replies, f"@{name}\n".encode())  # noqa: E731
            while True:
                b = os.read(requests, 9)
                if len(b) < 9:
                    break
                signal.alarm(int(self.time_limit) + 1)  # the default action ends the worker
                out = _run_case(int.from_bytes(b[:8], "little", signed=True), bool(b[8]))
                signal.alarm(0)
                os.write(replies, json.dumps(out).encode() + b"\n")
                if out[0] not in OK_CLASSES:
                    break
        finally:
            os._exit(0)

    def run(self, seed: int, oracle: bool = True) -> tuple[str, str]:
        """Case ``seed`` in this worker: (class, detail). A crash or timeout while
        onnxruntime runs is ``oracle_crash``, not Kiln's (rerun it with ``oracle=False``)."""
        self.cases += 1
        os.write(self._to_worker, seed.to_bytes(8, "little", signed=True) + bytes([oracle]))
        buf, stage = b"", None
        deadline = time.monotonic() + self.time_limit + 10
        while True:
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                if line.startswith(b"@"):
                    stage = line[1:].decode()
                    continue
                cls, detail = json.loads(line)
                if cls not in OK_CLASSES:  # the worker exits after a failure: reap it
                    self.close()
                return cls, detail
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._from_worker], [], [], left)[0]:
                os.kill(self.pid, signal.SIGKILL)  # hung with its alarm blocked
                status, cls, detail = self.close(), "timeout", f"over {self.time_limit}s (killed)"
                break
            b = os.read(self._from_worker, 65536)
            if not b:
                status = self.close()
                if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
                    cls, detail = "timeout", f"over {self.time_limit}s"
                else:
                    cls, detail = "crash", f"worker status {status}"
                break
            buf += b
        if stage == "oracle":
            return "oracle_crash", f"onnxruntime: {cls}, {detail}"
        return cls, detail

    @property
    def alive(self) -> bool:
        return self.pid is not None

    def close(self) -> int:
        """End the worker (it exits when its request pipe closes); its wait status."""
        os.close(self._to_worker)
        os.close(self._from_worker)
        _, status = os.waitpid(self.pid, 0)
        self.pid = None
        return status


def run_isolated(seed: int, time_limit: float = TIME_LIMIT_S) -> tuple[str, str]:
    """Case ``seed`` alone in a fresh worker (to reproduce one case): (class, detail)."""
    (_, cls, detail), = outcomes([seed], time_limit)
    return cls, detail


_warmed = False


def _warm() -> None:
    """Import and first-use everything a case needs (onnxruntime, Kiln on both backends,
    the torch kernels loaded on the first torch session) once, before forking workers."""
    global _warmed
    if _warmed:
        return
    import onnxruntime
    import torch

    onnxruntime.set_default_logger_severity(4)
    torch.set_num_threads(1)  # forked workers must not inherit a busy thread pool
    check(_seed(random.Random(0)).SerializeToString(), {"x": np.ones((3, 4), np.float32)})
    _warmed = True


def outcomes(seeds, time_limit: float = TIME_LIMIT_S):
    """``(seed, class, detail)`` for each of ``seeds``, run in workers (a new one every
    ``Worker.RECYCLE`` cases and after each failure)."""
    _warm()
    worker = None
    try:
        for s in seeds:
            if worker is None or not worker.alive or worker.cases >= Worker.RECYCLE:
                if worker is not None and worker.alive:
                    worker.close()
                worker = Worker(time_limit)
            cls, detail = worker.run(s)
            if cls == "oracle_crash":  # Kiln still runs the case, in a fresh worker
                worker = Worker(time_limit)
                kiln_cls, kiln_detail = worker.run(s, oracle=False)
                if kiln_cls not in OK_CLASSES:
                    cls, detail = kiln_cls, kiln_detail
            yield s, cls, detail
    finally:
        if worker is not None and worker.alive:
            worker.close()


def campaign(seed: int, cases: int, log=None, time_limit: float = TIME_LIMIT_S,
             deadline: float | None = None) -> collections.Counter:
    """Cases ``seed`` .. ``seed + cases - 1``; outcome counts (and failures in ``log``)."""
    counts: collections.Counter = collections.Counter()
    runs = outcomes(range(seed, seed + cases), time_limit)
    t0 = time.time()
    for s, cls, detail in runs:
        counts[cls] += 1
        if log is not None:
            if cls not in OK_CLASSES:
                print(f"case {s}: {cls}: {detail}", file=log, flush=True)
            if (s - seed + 1) % 10_000 == 0:  # a long campaign's progress, should it be cut
                print(json.dumps({"cases": s - seed + 1, "seconds": round(time.time() - t0),
                                  "outcomes": counts}), file=log, flush=True)
        if deadline is not None and time.time() > deadline:
            runs.close()
            break
    return counts


def _atheris_main(argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports():
        import kiln  # noqa: F401

    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        model, feeds = make_case(fdp.ConsumeIntInRange(0, 2**62))
        try:
            check(model, feeds)
        except MemoryError:
            pass

    atheris.Setup(argv, one)
    atheris.Fuzz()


def main(argv: list[str] | None = None) -> int:
    """Run a seeded campaign and print its outcome counts as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=500)
    ap.add_argument("--minutes", type=float, default=None, help="stop after this long")
    ap.add_argument("--atheris", action="store_true", help="coverage-guided, in-process")
    args, rest = ap.parse_known_args(argv)
    if args.atheris:
        _atheris_main([sys.argv[0], *rest])
        return 0
    t0 = time.time()
    deadline = None if args.minutes is None else t0 + 60 * args.minutes
    counts = campaign(args.seed, args.cases, sys.stderr, deadline=deadline)
    seconds = time.time() - t0
    total = sum(counts.values())
    print(json.dumps({"seed": args.seed, "cases": total, "seconds": round(seconds, 1),
                      "cases_per_s": round(total / seconds, 2), "outcomes": counts}))
    return 0 if set(counts) <= OK_CLASSES else 1


if __name__ == "__main__":
    sys.exit(main())
