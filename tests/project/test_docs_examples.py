"""Every code block in README.md and docs/*.md runs, as written (issue 47, item 6).

A block runs in a fresh folder where the clone's ``src``, ``examples``, ``benchmarks`` and
``scripts`` are linked, so paths in the docs (``src/kiln/data/digits_cnn.onnx``) resolve as
they do in a fresh clone; what a block writes stays in that folder.

- ``python`` blocks of one file run in order in one namespace (later blocks use earlier
  names), in-process.
- ``console`` blocks: each ``$ `` line runs as a command and must exit 0; the lines after it
  are its expected output, compared line by line after masking what changes from run to
  run (decimals and timings; whitespace): every expected line must appear in the output.
- ``bash``/``sh`` blocks: every line (continuations joined, comments dropped) runs and must
  exit 0.
- ``text`` blocks are not code (output, grammar, diagrams). A block with no language fails
  this test: say which it is.

The line right before a block may mark it: ``<!-- doc-test: slow -->`` (runs only with
``-m slow``: it builds zoo models, starts Ray or runs for minutes) or ``<!-- doc-test: skip:
REASON -->`` (cannot run here; the reason is reported). Commands that install packages or
run this test suite are not run (``NOT_RUN``, with the reason).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = ("src", "examples", "benchmarks", "scripts")
RUNNABLE = {"python", "console", "bash", "sh"}
# Files whose blocks rebuild zoo models with --force: they get a zoo folder of their own (the
# shared cache's files hard-linked into it, so only what is forced is built), so the shared
# cache other runs read is never rewritten under them.
OWN_ZOO = {"docs/zoo.md"}
NOT_RUN = {  # command prefix -> why the test does not run it
    "pip install": "installs packages: the test runs in the environment it would make",
    "bash scripts/test.sh": "runs the whole test suite, this test included",
}
_MARK = re.compile(r"<!--\s*doc-test:\s*(slow|skip)\s*(?::\s*(.*?))?\s*-->")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    mark: str | None  # "slow", "skip" or None
    reason: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file, with the doc-test mark before each."""
    lines = path.read_text().split("\n")
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^\s*```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        j = i + 1
        while not re.match(r"^\s*```\s*$", lines[j]):
            j += 1
        mark = _MARK.search(lines[i - 1]) if i else None
        out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:j]),
                         mark.group(1) if mark else None,
                         (mark.group(2) or "") if mark else ""))
        i = j + 1
    return out


ALL = [b for p in DOCS for b in blocks(p)]


def test_every_block_says_what_it_is():
    unlabeled = [b.where for b in ALL if b.lang not in RUNNABLE | {"text"}]
    assert not unlabeled, f"blocks without a known language (python/console/bash/text): {unlabeled}"
    unexplained = [b.where for b in ALL if b.mark == "skip" and not b.reason]
    assert not unexplained, f"skipped blocks must say why: {unexplained}"


@pytest.fixture()
def clone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in LINKED:
        (tmp_path / name).symlink_to(ROOT / name)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _command(cmd: str) -> str | None:
    """The shell command to run for a documented one, or None when it is not run."""
    parts = [p.strip() for p in cmd.split("&&")]
    parts = [p for p in parts if not any(p.startswith(k) for k in NOT_RUN)]
    if not parts:
        return None
    py = shlex.quote(sys.executable)
    fixed = [re.sub(r"^kiln\b", f"{py} -m kiln", re.sub(r"^python\b", py, p)) for p in parts]
    return " && ".join(fixed)


def _run(cmd: str, cwd: Path, timeout: float) -> str:
    proc = subprocess.run(cmd, shell=True, cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"`{cmd}` exited {proc.returncode}:\n{out[-3000:]}"
    return out


_NUMBER = re.compile(r"-?\d[\d,]*\.\d+|\d+(?:\.\d+)?\s*(?:ms|s|us|µs)\b")


def _masked(line: str) -> str:
    return " ".join(_NUMBER.sub("#", line).split())


def _commands(block: Block) -> list[tuple[str, list[str]]]:
    """(command, expected output lines) pairs of a console or bash block."""
    if block.lang == "console":
        pairs: list[tuple[str, list[str]]] = []
        for line in block.text.split("\n"):
            if line.startswith("$ "):
                pairs.append((line[2:], []))
            elif pairs and line.strip():
                pairs[-1][1].append(line)
        return pairs
    joined = block.text.replace("\\\n", " ")
    return [(line, []) for line in joined.split("\n") if line.strip()]


def _strip_comment(cmd: str) -> str:
    return re.sub(r"\s+#.*$", "", cmd).strip()


def run_shell_block(block: Block, cwd: Path, timeout: float = 600) -> None:
    for cmd, expected in _commands(block):
        shell = _command(_strip_comment(cmd))
        if shell is None:
            continue
        out = _run(shell, cwd, timeout)
        got = {_masked(line) for line in out.split("\n")}
        missing = [e for e in expected if _masked(e) not in got]
        assert not missing, (f"{block.where}: `{cmd}` did not print these documented lines "
                             f"(numbers with decimals and timings masked):\n"
                             + "\n".join(missing) + f"\n--- it printed:\n{out[-3000:]}")


def _python_files() -> dict[Path, list[Block]]:
    files: dict[Path, list[Block]] = {}
    for b in ALL:
        files.setdefault(b.path, []).append(b)
    return files


def _file_cases(slow: bool):
    for path, bs in _python_files().items():
        if any(b.lang in RUNNABLE and b.mark != "skip" and (b.mark == "slow") == slow
               for b in bs):
            yield pytest.param(path, id=str(path.relative_to(ROOT)),
                               marks=[pytest.mark.slow] if slow else [])


def _run_file(path: Path, cwd: Path, slow: bool) -> None:
    """Runs a file's blocks in order; with slow, the slow ones too (and the rest again,
    since later blocks use names the earlier ones define)."""
    namespace: dict = {"__name__": "__doc_example__"}
    for b in _python_files()[path]:
        if b.lang not in RUNNABLE or b.mark == "skip" or (b.mark == "slow" and not slow):
            continue
        if b.lang == "python":
            try:
                exec(compile(b.text, b.where, "exec"), namespace)
            except Exception as e:  # noqa: BLE001 - report which block, then fail
                raise AssertionError(f"{b.where} raised {type(e).__name__}: {e}") from e
        else:
            run_shell_block(b, cwd)


def _not_ignored(clone: Path) -> list[str]:
    """What the blocks left in the folder they ran in that the repository's .gitignore
    does not cover: run from a clone's root, `git status` would offer to commit it."""
    left = [str(p.relative_to(clone)) for p in clone.rglob("*")
            if p.is_file() and p.parts[len(clone.parts)] not in (*LINKED, "zoo")]
    if not left or shutil.which("git") is None or not (ROOT / ".git").exists():
        return []
    ignored = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "--no-index", *left],
                             capture_output=True, text=True).stdout.split()
    return sorted(set(left) - set(ignored))


@pytest.mark.parametrize("path", list(_file_cases(slow=False)))
def test_doc_blocks_run(path: Path, clone: Path):
    _run_file(path, clone, slow=False)
    left = _not_ignored(clone)
    assert not left, f"{path.name}'s commands leave files .gitignore does not cover: {left}"


@pytest.mark.parametrize("path", list(_file_cases(slow=True)))
def test_slow_doc_blocks_run(path: Path, clone: Path, monkeypatch: pytest.MonkeyPatch,
                             capfd: pytest.CaptureFixture):
    if str(path.relative_to(ROOT)) in OWN_ZOO:
        from kiln.zoo import cache_dir

        shared, own = cache_dir(), clone / "zoo"
        if shared.is_dir():
            shutil.copytree(shared, own, copy_function=_link_or_copy,
                            ignore=shutil.ignore_patterns(".*"))
        monkeypatch.setenv("KILN_ZOO_DIR", str(own))
    _run_file(path, clone, slow=True)
    left = _not_ignored(clone)
    assert not left, f"{path.name}'s commands leave files .gitignore does not cover: {left}"
    if path.name == "scale-out.md":  # its first example once walked into Ray's deprecation
        out, err = capfd.readouterr()
        assert "deprecated" not in (out + err).lower(), (out + err)[-3000:]


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another file system
        shutil.copy2(src, dst)


def test_skipped_blocks_are_few_and_say_why():
    skipped = {b.where: b.reason for b in ALL if b.mark == "skip"}
    for where, reason in skipped.items():
        print(f"not run: {where}: {reason}")
    assert len(skipped) <= 6, skipped


def test_zoo_md_table_is_what_kiln_zoo_table_prints():
    """docs/zoo.md's table quotes `kiln zoo table` (sizes, node counts, op histograms,
    tolerances) for every model whose cached build is current; build times vary."""
    zoo = pytest.importorskip("kiln.zoo")
    from kiln.zoo.__main__ import markdown_table
    from kiln.zoo.build import stale_reason

    def rows(text: str) -> dict[str, str]:
        table = text.split("| name | family |", 1)[1].split("\n\n", 1)[0]
        return {r.split("|")[1].strip(): r.rsplit("|", 2)[0] for r in table.splitlines()[2:]
                if r.startswith("|")}

    doc = rows((ROOT / "docs" / "zoo.md").read_text())
    assert set(doc) == {e.name for e in zoo.list_models()}, sorted(doc)
    current = {n: r for n, r in rows(markdown_table()).items() if stale_reason(n) is None}
    if not current:
        pytest.skip("no current zoo build in the cache to compare with")
    wrong = {n: (r, doc[n]) for n, r in current.items() if doc[n] != r}
    assert not wrong, wrong
