"""A session switches the process's malloc to keep freed memory, so a run's big
activations reuse the last run's pages instead of faulting in fresh ones: counted with
the kernel's own page-fault counter, in fresh processes (the setting is process-wide)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="glibc's malloc and /proc-style fault counts: Linux only")

_CHILD = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from onnx import TensorProto, helper
    import kiln

    backend, how = sys.argv[1], sys.argv[2]
    # 64 MB activations: far over malloc's largest mmap threshold (32 MB)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4096, 4096])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Neg", ["a"], ["b"]),
             helper.make_node("ReduceMax", ["b"], ["y"], keepdims=0)]
    model = helper.make_model(helper.make_graph(nodes, "big", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)])
    if how == "arena-off":
        so = kiln.SessionOptions()
        so.enable_cpu_mem_arena = False
        sess = kiln.InferenceSession(model, so, backend=backend)
    else:
        sess = kiln.InferenceSession(model, backend=backend)
    feed = {"x": np.random.default_rng(0).standard_normal((4096, 4096), np.float32)}
    want = (-np.maximum(feed["x"], 0)).max()
    # torch allocates 64-byte aligned: malloc's free blocks fit its requests only once
    # neighbouring free blocks have merged, which takes a few runs
    for _ in range(6):
        sess.run(None, feed)
    faults, ok = [], True
    for _ in range(5):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        ok = ok and bool(np.allclose(sess.run(None, feed)[0], want))
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    # the median run: now and then a run still finds no free block that fits
    print(json.dumps({"faults": sorted(faults)[2], "ok": ok}))
""")


def _runs(backend: str, how: str, **env: str) -> dict:
    """Page faults of the median of five runs after six, in a fresh process, and whether
    the runs were right."""
    out = subprocess.run([sys.executable, "-c", _CHILD, backend, how], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **env}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("backend", ["numpy", "torch"])
def test_big_activations_reuse_freed_memory_unless_the_arena_is_off(backend):
    if backend == "torch":
        pytest.importorskip("torch")
    kept = _runs(backend, "default")
    fresh = _runs(backend, "arena-off")
    assert kept["ok"] and fresh["ok"]
    # Two 64 MB activations a run: 32,768 fresh 4 KB pages a run without the arena (fewer
    # where NumPy gets transparent huge pages), none with it.
    assert kept["faults"] < 200, kept
    assert fresh["faults"] > 10 * max(kept["faults"], 10), (kept, fresh)


def test_malloc_tunables_set_by_the_user_are_left_alone():
    """MALLOC_MMAP_MAX_=65536 is glibc's default: set by the user, it is kept, so the big
    activations fault in fresh pages as without the arena."""
    kept = _runs("numpy", "default")
    user = _runs("numpy", "default", MALLOC_MMAP_MAX_="65536")
    assert user["ok"] and user["faults"] > 10 * max(kept["faults"], 10), (kept, user)
