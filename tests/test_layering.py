"""The stages import one way only: ``ir`` <- ``onnxio`` <- ``ops`` <- ``passes`` <-
``runtime`` <- ``tools`` <- ``cli``, and no package reaches another's private names: no
import of one, and no read of an attribute that only another package's classes set.

Read from the source with ``ast``, so imports hidden in function bodies count too.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "kiln"

# Lower layers first; a module may import its own layer and any layer before it.
LAYERS = ["errors", "ir", "onnxio", "ops", "passes", "edit", "runtime", "ort", "onnxruntime",
          "train", "quantize", "tools", "integrations", "zoo", "cli"]
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


def _private_attribute_uses():
    """``obj._name`` read in one package where ``_name`` is an attribute that only other
    packages' classes set on ``self`` (``Value._uses`` read by a pass, say)."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(SRC.rglob("*.py"))}
    owners: dict[str, set[str]] = {}
    for path, tree in trees.items():
        here = _layer(list(path.relative_to(SRC).parts))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and _private(node.attr) and _on_self(node):
                owners.setdefault(node.attr, set()).add(here)
    for path, tree in trees.items():
        rel = path.relative_to(SRC).parts
        here = _layer(list(rel))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in owners \
                    and here not in owners[node.attr] and not _on_self(node):
                yield (f"{'/'.join(rel)}:{node.lineno}: {here} reads {node.attr} of "
                       f"{', '.join(sorted(owners[node.attr]))}")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _on_self(node: ast.Attribute) -> bool:
    return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")


def test_imports_run_one_way_and_never_reach_private_names():
    found = list(_violations()) + list(_private_attribute_uses())
    assert not found, "layering violations:\n" + "\n".join(found)


def test_the_checker_sees_upward_and_private_imports(tmp_path, monkeypatch):
    """The test above must be able to fail: a planted upward import is found."""
    pkg = tmp_path / "kiln"
    (pkg / "ir").mkdir(parents=True)
    (pkg / "ir" / "bad.py").write_text(
        "def f():\n    from kiln.runtime.plan import _Compiler\n    return _Compiler\n")
    (pkg / "ir" / "value.py").write_text(
        "class Value:\n    def __init__(self):\n        self._uses = {}\n")
    (pkg / "passes").mkdir()
    (pkg / "passes" / "bad.py").write_text("def f(v):\n    return len(v._uses)\n")
    monkeypatch.setattr(__import__(__name__), "SRC", pkg)
    found = list(_violations())
    assert any("imports upward" in f for f in found)
    assert any("private" in f for f in found)
    assert [f.split(": ", 1)[1] for f in _private_attribute_uses()] == \
        ["passes reads _uses of ir"]
