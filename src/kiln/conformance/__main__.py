"""``python -m kiln.conformance [--backend numpy|torch] [--device cpu|cuda] [--kind K] [-k P]``

Runs the installed onnx package's backend tests against Kiln: one line per failure, then
a last line ``N passed, M failed``. Exits 1 when a test fails and ``--strict`` is given.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
from collections import Counter
from functools import partial

from kiln.conformance.runner import KINDS, collect, run_case
from kiln.runtime.backends import backend_names, backends_where, reference_backend_name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kiln.conformance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default=reference_backend_name(), choices=backend_names())
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="where the backend runs (cuda: a backend that runs there, and a GPU)")
    ap.add_argument("--kind", action="append", choices=KINDS,
                    help="test kinds to run (repeatable; default: all)")
    ap.add_argument("-k", dest="pattern", help="only tests whose name contains this")
    ap.add_argument("-j", "--jobs", type=int, default=min(2, mp.cpu_count()))
    ap.add_argument("--timeout", type=int, default=120, help="seconds per test")
    ap.add_argument("--json", help="write every outcome to this JSON file")
    ap.add_argument("--strict", action="store_true", help="exit 1 if any test fails")
    args = ap.parse_args(argv)
    cases = collect(tuple(args.kind or KINDS), args.pattern)
    gpu = backends_where(lambda e: "cuda" in e.devices)
    if args.device == "cuda" and args.backend not in gpu:
        ap.error(f"--device cuda runs the {' or '.join(gpu)} backend: add --backend "
                 f"{gpu[0] if gpu else '...'}")
    work = partial(run_case, backend=args.backend, timeout=args.timeout, device=args.device)
    if args.jobs > 1 and len(cases) > 1:
        with mp.get_context("fork").Pool(args.jobs, maxtasksperchild=200) as pool:
            outcomes = list(pool.imap(work, cases, chunksize=4))
    else:
        outcomes = [work(c) for c in cases]
    for o in outcomes:
        if not o.passed:
            print(f"FAILED [{o.kind}] {o.name}: {o.reason}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([o.__dict__ for o in outcomes], f, indent=1)
    by_kind = Counter((o.kind, o.passed) for o in outcomes)
    for kind in args.kind or KINDS:
        p, f = by_kind[(kind, True)], by_kind[(kind, False)]
        if p or f:
            print(f"# {kind}: {p} passed, {f} failed ({100 * p / max(p + f, 1):.1f}%)")
    passed = sum(o.passed for o in outcomes)
    print(f"{passed} passed, {len(outcomes) - passed} failed")
    return 1 if args.strict and passed != len(outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
