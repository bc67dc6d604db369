"""ONNX's own backend tests against both of Kiln's backends: every node test and light
model must pass on each unless it is listed, with its reason, in docs/conformance.md."""

import os
import re

import pytest

from kiln.conformance.runner import collect, run_case

_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "conformance.md")


def _known_failures() -> dict[str, str | None]:
    """Listed test -> the one backend it fails on (a kind of `light (torch only)`), or None."""
    if not os.path.exists(_DOC):
        return {}
    rows = re.findall(r"^\| `(test_\w+)` \| ([^|]*) \|", open(_DOC).read(), re.M)
    return {name: (m.group(1) if (m := re.search(r"\((\w+) only\)", kind)) else None)
            for name, kind in rows}


_KNOWN = _known_failures()
_CASES = collect(("node", "light", "simple", "pytorch-operator"))


@pytest.mark.parametrize("backend", ["numpy", "torch"])
@pytest.mark.parametrize("case", _CASES, ids=[f"{c.kind}:{c.name}" for c in _CASES])
def test_onnx_backend_case(case, backend):
    outcome = run_case(case, backend, timeout=300)
    if case.name in _KNOWN and _KNOWN[case.name] in (None, backend):
        if outcome.passed:
            pytest.skip("listed as failing in docs/conformance.md but passes now: update the doc")
        pytest.xfail(outcome.reason)
    assert outcome.passed, outcome.reason


def test_node_pass_rate_at_least_90_percent():
    node = [c for c in _CASES if c.kind == "node"]
    failing = [c for c in node if c.name in _KNOWN and _KNOWN[c.name] is None]
    assert len(node) > 1800
    assert 1 - len(failing) / len(node) >= 0.90, f"{len(failing)} of {len(node)} node tests fail"
