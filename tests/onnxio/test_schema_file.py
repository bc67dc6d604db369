"""Load-time validation reads ONNX's schema facts from a per-onnx-version file once a
process has derived them: a later process validates models, and refuses malformed ones,
without building ONNX's schema registry; a file others can write is not trusted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import json, sys
    import onnx, onnx.defs
    from onnx import TensorProto, helper
    calls = []
    real = onnx.defs.get_schema
    onnx.defs.get_schema = lambda *a, **k: (calls.append(a[0]), real(*a, **k))[1]
    from kiln.errors import ModelLoadError
    from kiln.onnxio import load

    def model(**relu_attrs):
        g = helper.make_graph(
            [helper.make_node("Relu", ["x"], ["r"], **relu_attrs),
             helper.make_node("MaxPool", ["r"], ["y"], kernel_shape=[2, 2])], "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])

    load(model().SerializeToString())
    try:
        load(model(alpha=1.0).SerializeToString())  # Relu has no attribute alpha
        refused = False
    except ModelLoadError:
        refused = True
    print(json.dumps({"schema_calls": calls, "refused": refused}))
""")


def _child(cache: str) -> dict:
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                         timeout=120, check=True,
                         env={**os.environ, "KILN_SCHEMA_CACHE": cache})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_validates_from_the_file(tmp_path):
    cache = str(tmp_path / "schemas.json")
    first = _child(cache)
    assert first["refused"] and sorted(set(first["schema_calls"])) == ["MaxPool", "Relu"]
    facts = json.load(open(cache))
    assert set(facts) == {"|Relu|17", "|MaxPool|17"}
    second = _child(cache)
    assert second == {"schema_calls": [], "refused": True}


@pytest.mark.skipif(not hasattr(os, "getuid"), reason="file ownership: POSIX only")
def test_a_file_others_can_write_is_not_trusted(tmp_path):
    cache = tmp_path / "schemas.json"
    _child(str(cache))
    facts = json.load(open(cache))
    facts["|Relu|17"][3]["alpha"] = 1  # a loosened entry would let alpha through
    cache.write_text(json.dumps(facts))
    os.chmod(cache, 0o666)
    run = _child(str(cache))
    assert run["refused"] and "Relu" in run["schema_calls"]


def test_the_cache_can_be_turned_off(tmp_path):
    run = _child("0")
    assert run["refused"] and "Relu" in run["schema_calls"]


def test_entries_of_another_format_are_derived_again(tmp_path):
    cache = tmp_path / "schemas.json"
    cache.write_text(json.dumps({"|Relu|17": [14, "junk"], "|MaxPool|17": None}))
    os.chmod(cache, 0o600)
    run = _child(str(cache))
    assert run["refused"] and "Relu" in run["schema_calls"]


def test_caches_share_one_root_that_follows_xdg(tmp_path, monkeypatch):
    """The schema file, the compile cache and the zoo live under one root, which honours
    $XDG_CACHE_HOME; each variable moves its cache, and the two that can be turned off
    take the same words for it."""
    from kiln import zoo
    from kiln.onnxio import schema_file
    from kiln.runtime import compile_cache

    for var in ("KILN_SCHEMA_CACHE", "KILN_COMPILE_CACHE", "KILN_ZOO_DIR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    root = tmp_path / "xdg" / "kiln"
    assert schema_file.path().parent == root
    assert compile_cache.folder() == root / "compiled"
    assert zoo.cache_dir() == root / "zoo"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/dir")  # not absolute: ignored, per XDG
    assert zoo.cache_dir() == root.home() / ".cache" / "kiln" / "zoo"
    for word in ("0", "off", "OFF"):
        monkeypatch.setenv("KILN_SCHEMA_CACHE", word)
        monkeypatch.setenv("KILN_COMPILE_CACHE", word)
        assert schema_file.path() is None and compile_cache.folder() is None
    monkeypatch.setenv("KILN_SCHEMA_CACHE", str(tmp_path / "s.json"))
    monkeypatch.setenv("KILN_ZOO_DIR", "~/zoo-here")
    assert schema_file.path() == tmp_path / "s.json"
    assert zoo.cache_dir() == root.home() / "zoo-here"
