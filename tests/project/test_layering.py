"""The stages import one way only: ``ir`` <- ``onnxio`` <- ``ops`` <- ``passes`` <-
``runtime`` <- ``tools`` <- ``cli``, no package reaches another's private names, and the
modules of a layer import each other without cycles.

Read from the source with ``ast``, so every import form counts: ``import kiln.x``,
``from kiln.x import y``, ``from kiln import x`` (a module, or a name of ``kiln``'s own
surface, which is the top layer), relative imports, ``importlib.import_module("kiln.x")``
with a constant name, and imports in function bodies. Private names count however they are
reached: imported, read as ``module._name``, or read on any object as ``obj._name`` (or
``getattr(obj, "_name")``) where only another package defines ``_name`` (set on ``self``,
or a private method or function).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kiln"

# Lower layers first; a module may import its own layer and any layer before it.
LAYERS = ["errors", "ir", "onnxio", "ops", "passes", "edit", "runtime", "session_api",
          "onnxruntime", "train", "quantize", "tools", "integrations", "zoo", "serving", "cli"]
# Top-level modules that belong to a layer.
MODULE_LAYER = {"optimize": "passes", "demo": "cli", "conformance": "cli", "__init__": "cli",
                "__main__": "cli", "model_names": "cli", "optimizer": "passes",
                "ort": "session_api"}


def _layer(parts: list[str]) -> str:
    """The layer of module ``kiln.<parts>``."""
    head = parts[0].removesuffix(".py") if parts else "__init__"
    return MODULE_LAYER.get(head, head)


def _module_parts(path: Path) -> list[str]:
    """``kiln.<parts>`` of the module at ``path`` (a package is its ``__init__``)."""
    rel = list(path.relative_to(SRC).with_suffix("").parts)
    return rel[:-1] if rel and rel[-1] == "__init__" else rel


def _is_module(parts: list[str]) -> bool:
    base = SRC.joinpath(*parts) if parts else SRC
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _imports(path: Path):
    """(line, imported module, imported names) for every kiln import in ``path``; the module
    is ``kiln.a.b`` (a name imported from a package that is itself a module is reported as
    that module)."""
    tree = ast.parse(path.read_text(), str(path))
    here = _module_parts(path)
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level > 1 else package
                parts = ["kiln", *base, *(node.module.split(".") if node.module else [])]
            elif node.module and node.module.split(".")[0] == "kiln":
                parts = node.module.split(".")
            else:
                continue
            plain = []
            for a in node.names:
                sub = parts[1:] + [a.name]
                if _is_module(sub):
                    yield node.lineno, ".".join(["kiln", *sub]), []
                else:
                    plain.append(a.name)
            if plain or not node.names:
                yield node.lineno, ".".join(parts), plain
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "kiln":
                    yield node.lineno, a.name, []
        elif isinstance(node, ast.Call) and node.args and \
                isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and \
                node.args[0].value.split(".")[0] == "kiln" and (
                    getattr(node.func, "attr", None) == "import_module" or
                    getattr(node.func, "id", None) in ("import_module", "__import__")):
            yield node.lineno, node.args[0].value, []


def _violations():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).parts
        here = _layer(list(rel))
        for line, module, names in _imports(path):
            target = module.split(".")[1:]
            if not target and not names:
                continue  # `import kiln`: the package itself, read as kiln.x below
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
    packages set on ``self`` (``Value._uses`` read by a pass, say), or a private method,
    function, class or variable only other packages define (``session._check_feed()``)."""
    trees = {path: ast.parse(path.read_text(), str(path)) for path in sorted(SRC.rglob("*.py"))}
    owners: dict[str, set[str]] = {}
    for path, tree in trees.items():
        here = _layer(list(path.relative_to(SRC).parts))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and _private(node.attr) and _on_self(node):
                owners.setdefault(node.attr, set()).add(here)
        # private methods, and private functions, classes and variables of a module
        # (reached as ``module._name`` after ``import kiln.x as module``)
        for holder in [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
            for node in holder.body:
                for name in _defined_names(node):
                    if _private(name):
                        owners.setdefault(name, set()).add(here)
    for path, tree in trees.items():
        rel = path.relative_to(SRC).parts
        here = _layer(list(rel))
        for node in ast.walk(tree):
            name = node.attr if isinstance(node, ast.Attribute) and not _on_self(node) \
                else _attribute_by_name(node)
            if name in owners and here not in owners[name]:
                yield (f"{'/'.join(rel)}:{node.lineno}: {here} reads {name} of "
                       f"{', '.join(sorted(owners[name]))}")


def _attribute_by_name(node: ast.AST) -> str | None:
    """The attribute ``getattr(obj, "_name")`` (or ``hasattr``, ``setattr``, ``delattr``)
    reaches with a constant name, else None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
            node.func.id in ("getattr", "hasattr", "setattr", "delattr") and \
            len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and \
            isinstance(node.args[1].value, str) and \
            not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls")):
        return node.args[1].value
    return None


def _defined_names(node: ast.stmt) -> list[str]:
    """The names a statement of a module or class body defines."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [node.name]
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]


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


def _module_cycles() -> list[list[str]]:
    """Import cycles between modules of one layer (every import form, function bodies
    included), each as its modules in a cycle order."""
    mods = {".".join(["kiln", *_module_parts(p)]): p for p in sorted(SRC.rglob("*.py"))}
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        for _, target, _names in _imports(path):
            while target not in mods and "." in target:
                target = target.rsplit(".", 1)[0]  # a name inside a module
            if target in mods and target != m and \
                    _layer(target.split(".")[1:]) == _layer(m.split(".")[1:]):
                edges[m].add(target)
    return [c for c in _strongly_connected(edges) if len(c) > 1]


def _strongly_connected(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
    return out


def test_modules_of_a_layer_import_each_other_without_cycles():
    cycles = _module_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checker_sees_every_import_form_private_methods_and_cycles(tmp_path, monkeypatch):
    """Planted: ``from kiln import zoo`` and a relative import upward, ``import_module`` of
    an upper layer, a private method called from another package, and a cycle between two
    modules of one layer through function bodies: each is found."""
    pkg = tmp_path / "kiln"
    for d in ("tools", "zoo", "runtime", "passes"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "zoo" / "models.py").write_text("X = 1\n")
    (pkg / "tools" / "a.py").write_text("def f():\n    from kiln import zoo\n    return zoo\n")
    (pkg / "tools" / "b.py").write_text("from ..zoo import models\n")
    (pkg / "tools" / "c.py").write_text(
        "import importlib\n\ndef f():\n    return importlib.import_module('kiln.zoo.models')\n")
    (pkg / "runtime" / "session.py").write_text(
        "class Session:\n    def _check_feed(self, feed):\n        return feed\n")
    (pkg / "tools" / "d.py").write_text("def f(sess):\n    return sess._check_feed({})\n")
    (pkg / "tools" / "e.py").write_text(
        "def f(sess):\n    return getattr(sess, '_check_feed', None)\n")
    (pkg / "passes" / "base.py").write_text("def f():\n    from kiln.passes import rewrite\n")
    (pkg / "passes" / "rewrite.py").write_text("from kiln.passes.base import f\n")
    monkeypatch.setattr(__import__(__name__), "SRC", pkg)
    found = "\n".join(_violations())
    for where in ("tools/a.py:2", "tools/b.py:1", "tools/c.py:4"):
        assert f"{where}: tools imports upward from kiln.zoo" in found
    assert [f.split(": ", 1)[1] for f in _private_attribute_uses()] == \
        ["tools reads _check_feed of runtime"] * 2
    assert _module_cycles() == [["kiln.passes.base", "kiln.passes.rewrite"]]
