"""Source comments and docstrings carry no benchmark figures: a time (``12 us``, ``3.5 ms``)
or a speed ratio (``2.4x faster``, ``0.6x the time``) goes stale as the code and the
machine change, so figures live in docs (docs/performance.md, with date, machine and
load) and in benchmarks/results/. Read from the source with ``tokenize`` and ``ast``."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kiln"

FIGURE = re.compile(
    r"\b\d+(\.\d+)?\s?(us|µs|ms)\b"  # a time
    r"|\b\d+(\.\d+)?(-\d+(\.\d+)?)?x (faster|slower|as long|the time|the cost)"  # a ratio
    r"|\b\d+(\.\d+)?%(-\d+%)? (faster|slower)"
)


def _prose(path: Path):
    """(line, text) of every comment and docstring in ``path``."""
    text = path.read_text()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                yield node.body[0].lineno, doc
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):  # attribute docstrings
            yield node.lineno, node.value.value


def _figures(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, text in _prose(path):
            m = FIGURE.search(" ".join(text.split()))
            if m:
                found.append(f"{path.relative_to(root)}:{line}: {m.group(0)!r}")
    return sorted(set(found))


def test_source_comments_carry_no_benchmark_figures():
    found = _figures(SRC)
    assert not found, "benchmark figures in comments (move them to docs):\n" + "\n".join(found)


def test_the_checker_sees_figures_in_comments_and_docstrings(tmp_path):
    (tmp_path / "a.py").write_text(
        '"""Module: 2.5x faster than before."""\n\n'
        "X = 1  # costs ~20 us a call\n\n\n"
        'def f():\n    """Took 3.5\n    ms."""\n\n\n'
        "MSG = 'a string with 5 ms is not prose'\n"
    )
    assert [f.split(": ", 1)[1] for f in _figures(tmp_path)] == [
        "'2.5x faster'",
        "'20 us'",
        "'3.5 ms'",
    ]
