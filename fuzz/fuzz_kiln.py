"""A fuzzer for Kiln's load -> session -> run path on both backends.

Each case is a small ONNX model with structured mutations (dims, dtypes, attributes,
names, opsets, graph structure, feeds, and now and then flipped bytes of the serialized
file), run in a forked worker under a memory limit (``resource.setrlimit``) and a time
limit. Outcome classes:

- ``correct``: a result equal to onnxruntime's (or onnxruntime refused the model too and
  Kiln raised a KilnError, counted as ``kiln_error``)
- ``kiln_error``: Kiln raised one of its own exceptions
- ``unchecked``: Kiln returned a result where onnxruntime refused the model (no oracle)
- ``wrong``: a result that differs from onnxruntime's
- ``optimizer_failed``: the optimizer raised and the session ran the model unoptimized
- ``other``: any other exception, ``crash``: the worker died, ``timeout``, ``memory``

Usage: ``python fuzz/fuzz_kiln.py --seed 0 --cases 2000`` (a seeded, deterministic
campaign; exits 1 on any outcome outside correct / kiln_error / unchecked), or
``--atheris`` to let atheris (coverage-guided, in-process under libFuzzer's own -timeout and
-rss_limit_mb) choose the mutations from its byte stream.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import resource
import signal
import sys
import time
import traceback
import warnings

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper

OK_CLASSES = frozenset({"correct", "kiln_error", "unchecked", "invalid"})
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
    elif what == 3:  # an unknown or misplaced attribute
        node.attribute.append(helper.make_attribute(rng.choice(["axis", "perm", "zz", "alpha"]),
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

def _reference(data: bytes, feeds: dict):
    import onnxruntime as ort

    # onnxruntime reads big-endian arrays' bytes as little-endian; Kiln converts them, so
    # the oracle gets the same values in native order.
    feeds = {k: v.astype(v.dtype.newbyteorder("=")) if isinstance(v, np.ndarray) else v
             for k, v in feeds.items()}
    try:
        s = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        return s.run(None, feeds)
    except Exception:  # noqa: BLE001 - onnxruntime refusing is an answer, not a failure
        return None


def check(data: bytes, feeds: dict) -> str:
    """Run one case in this process; its outcome class (raises on other exceptions)."""
    import kiln

    want = _reference(data, feeds)
    results = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for backend in ("numpy", "torch"):
                results.append(kiln.InferenceSession(data, backend=backend).run(None, feeds))
        except kiln.KilnError:
            return "kiln_error"
    if any("Please report this" in str(w.message) for w in caught):
        return "optimizer_failed"  # the session fell back to the unoptimized model
    if want is None:
        return "unchecked"
    for got in results:
        for g, w in zip(got, want):
            g, w = np.asarray(g), np.asarray(w)
            if g.shape != w.shape or (w.dtype != object and not np.allclose(
                    g.astype(w.dtype), w, rtol=1e-4, atol=1e-5, equal_nan=True)):
                return "wrong"
    return "correct"


def run_isolated(seed: int, time_limit: float = TIME_LIMIT_S) -> tuple[str, str]:
    """Case ``seed`` in a forked worker with memory and time limits: (class, detail)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the worker
        os.close(r)
        try:
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
            signal.alarm(int(time_limit) + 1)
            try:
                data, feeds = make_case(seed)
            except Exception:  # noqa: BLE001 - a mutation protobuf refuses: no case
                data = None
            try:
                out = ("invalid", "") if data is None else (check(data, feeds), "")
            except MemoryError:
                out = ("memory", "MemoryError")
            except BaseException as e:  # noqa: BLE001 - the class the fuzzer is looking for
                tb = traceback.extract_tb(e.__traceback__)[-1]
                out = ("other", f"{type(e).__name__}: {str(e)[:200]} at "
                                f"{tb.filename}:{tb.lineno}")
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 65536)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    if chunks:
        cls, detail = json.loads(b"".join(chunks))
        return cls, detail
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
        return "timeout", f"over {time_limit}s"
    return "crash", f"worker status {status}"


def campaign(seed: int, cases: int, log=None, time_limit: float = TIME_LIMIT_S,
             deadline: float | None = None) -> collections.Counter:
    """Cases ``seed`` .. ``seed + cases - 1``; outcome counts (and failures in ``log``)."""
    import onnxruntime
    import torch

    import kiln  # noqa: F401 - imported once here so each fork starts warm

    onnxruntime.set_default_logger_severity(4)
    torch.set_num_threads(1)  # forked workers must not inherit a busy thread pool
    counts: collections.Counter = collections.Counter()
    for s in range(seed, seed + cases):
        if deadline is not None and time.time() > deadline:
            break
        cls, detail = run_isolated(s, time_limit)
        counts[cls] += 1
        if cls not in OK_CLASSES and log is not None:
            print(f"case {s}: {cls}: {detail}", file=log, flush=True)
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
