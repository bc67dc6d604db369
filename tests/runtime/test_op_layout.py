"""An op is found from its definition: every op Kiln defines is written ``op("Name"`` in
the module of its family (``kiln/ops/<family>.py``), every torch kernel is written
``kernel("Name"`` in the torch module of the same family (``kiln/ops/torch/<family>.py``),
and a kernel module is loaded because it exists in the backend's kernel package, not
because a list names it. Read from the registry and the source text."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import kiln  # noqa: F401 - registers every op
from kiln.ops import registry

OPS = Path(kiln.__file__).parent / "ops"


def _family(d: registry.OpDef) -> str:
    """The module (``kiln.ops.<family>``) that defines the op's reference kernel."""
    return d.kernel.__module__.rsplit(".", 1)[-1]


def _kiln_ops() -> list[registry.OpDef]:
    return [d for d in registry.registered() if d.kernel.__module__.startswith("kiln.ops.")]


def _written(path: Path, call: str, op_type: str) -> bool:
    return re.search(rf'\b{call}\(\s*"{re.escape(op_type)}"', path.read_text()) is not None


def test_every_op_is_written_op_name_in_its_family_module():
    missing = sorted(
        {
            f"{d.op_type} ({_family(d)}.py)"
            for d in _kiln_ops()
            if not _written(OPS / f"{_family(d)}.py", "op", d.op_type)
        }
    )
    assert not missing, 'ops registered without a greppable op("Name": ' + ", ".join(missing)


def test_torch_kernels_live_in_the_torch_module_of_their_family():
    pytest.importorskip("torch")
    registry.load_backend("torch")
    misplaced = []
    for d in _kiln_ops():
        if "torch" not in d.kernels:
            continue
        there = OPS / "torch" / f"{_family(d)}.py"
        if not there.is_file() or not _written(there, "kernel", d.op_type):
            misplaced.append(f"{d.op_type} (expected in ops/torch/{_family(d)}.py)")
    assert not misplaced, "torch kernels outside their family's module: " + ", ".join(
        sorted(set(misplaced))
    )


def test_torch_modules_are_named_after_op_families():
    """A torch module is a family of ``kiln/ops`` (or a helper: private, or the runtimes'
    settings), so the two trees read side by side."""
    families = {p.stem for p in OPS.glob("*.py")}
    extra = sorted(
        p.stem
        for p in (OPS / "torch").glob("*.py")
        if p.stem not in families
        and not p.stem.startswith("_")
        and p.stem not in ("arrays", "native")
    )
    assert not extra, f"torch modules with no op family of that name: {extra}"


def test_a_new_kernel_module_is_loaded_because_it_exists(tmp_path, monkeypatch):
    """A module dropped into a backend's kernel package registers its kernels when the
    backend is first asked about, with no list to edit."""
    pytest.importorskip("torch")
    import kiln.ops.torch as torch_kernels

    name = "zz_probe_kernels"
    (tmp_path / f"{name}.py").write_text(
        "from kiln.ops.registry import op\n"
        "from kiln.ops.torch import kernel\n\n\n"
        "@op('LayoutProbe', 1, domain='test.layout')\n"
        "def probe(x):\n    return x\n\n\n"
        "@kernel('LayoutProbe', 1, domain='test.layout')\n"
        "def probe_torch(x):\n    return x\n"
    )
    monkeypatch.setattr(torch_kernels, "__path__", [*torch_kernels.__path__, str(tmp_path)])
    monkeypatch.setattr(registry, "_loaded", set())
    monkeypatch.delitem(sys.modules, f"kiln.ops.torch.{name}", raising=False)
    try:
        assert registry.lookup("test.layout", "LayoutProbe", 1) is None
        registry.load_backend("torch")
        d = registry.lookup("test.layout", "LayoutProbe", 1)
        assert d is not None and d.runs_on("torch") and "torch" in d.kernels
    finally:
        registry._OPS.pop(("test.layout", "LayoutProbe"), None)
        sys.modules.pop(f"kiln.ops.torch.{name}", None)
