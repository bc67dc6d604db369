"""The stages import one way only: ``ir`` <- ``onnxio`` <- ``ops`` <- ``passes`` <-
``runtime`` <- ``tools`` <- ``cli``, and no package reaches another's private names.

Read from the source with ``ast``, so imports hidden in function bodies count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kiln"

# Lower layers first; a module may import its own layer and any layer before it.
LAYERS = ["errors", "ir", "onnxio", "ops", "passes", "edit", "runtime", "ort", "train", "quantize",
          "tools", "integrations", "zoo", "cli"]
# Top-level modules that belong to a layer.
MODULE_LAYER = {"optimize": "passes", "demo": "cli", "conformance": "cli", "__init__": "cli",
                "__main__": "cli"}


def _layer(parts: list[str]) -> str:
    """The layer of module ``kiln.<parts>``."""
    head = parts[0].removesuffix(".py") if parts else "__init__"
    return MODULE_LAYER.get(head, head)


def _imports(path: Path):
    """(line, imported module, imported names) for every kiln import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 \
                and node.module.split(".")[0] == "kiln":
            yield node.lineno, node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kiln":
                    yield node.lineno, a.name, []


def _violations():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).parts
        here = _layer(list(rel))
        for line, module, names in _imports(path):
            target = module.split(".")[1:]
            if not target:
                continue  # `import kiln` (the package's public surface)
            there = _layer(target)
            where = f"{'/'.join(rel)}:{line}"
            if there in LAYERS and here in LAYERS and LAYERS.index(there) > LAYERS.index(here):
                yield f"{where}: {here} imports upward from {module}"
            if there != here:
                private = [p for p in target[1:] if p.startswith("_") and not p.startswith("__")]
                private += [n for n in names if n.startswith("_")]
                if private:
                    yield f"{where}: {here} reaches private {private} of {module}"


def test_imports_run_one_way_and_never_reach_private_names():
    found = list(_violations())
    assert not found, "layering violations:\n" + "\n".join(found)


def test_the_checker_sees_upward_and_private_imports(tmp_path, monkeypatch):
    """The test above must be able to fail: a planted upward import is found."""
    pkg = tmp_path / "kiln"
    (pkg / "ir").mkdir(parents=True)
    (pkg / "ir" / "bad.py").write_text(
        "def f():\n    from kiln.runtime.plan import _Compiler\n    return _Compiler\n")
    monkeypatch.setattr(__import__(__name__), "SRC", pkg)
    found = list(_violations())
    assert any("imports upward" in f for f in found)
    assert any("private" in f for f in found)
