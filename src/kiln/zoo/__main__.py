"""Command line: ``python -m kiln.zoo list`` / ``python -m kiln.zoo build [NAMES...]``."""

from __future__ import annotations

import argparse
import json
import sys

from kiln import zoo
from kiln.errors import KilnError


def markdown_table(top: int = 5) -> str:
    """Markdown table (one row per built model) of the facts recorded in each meta.json."""
    head = ("| name | family | exporter | opset | params | file MB | nodes | top ops | atol / rtol "
            "| build s |\n|---|---|---|---|---|---|---|---|---|---|")
    rows = [head]
    for e in zoo.list_models():
        if not zoo.is_built(e.name):
            continue
        m = json.loads((zoo.path(e.name).parent / "meta.json").read_text())
        ops = ", ".join(f"{k} {v}" for k, v in list(m["op_histogram"].items())[:top])
        tol = m["tolerance"]
        rows.append(
            f"| {e.name} | {e.family} | {m['exporter']} | {m['opset']} | {m['params'] / 1e6:.2f}M "
            f"| {m['file_size_bytes'] / 1e6:.1f} | {m['node_count']} | {ops} "
            f"| {tol['atol']:g} / {tol['rtol']:g} | {m['build_time_s']:.1f} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Run the zoo CLI; returns a process exit code (0 ok, 1 build failure, 2 usage error)."""
    ap = argparse.ArgumentParser(prog="kiln zoo", description="Build the offline ONNX model zoo.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="list zoo models and whether they are built")
    ls.add_argument("--json", action="store_true", help="machine-readable output")
    b = sub.add_parser("build", help="build models (all by default) into the cache")
    b.add_argument("names", nargs="*", help="models to build (default: all)")
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    b.add_argument("-q", "--quiet", action="store_true",
                   help="no progress output (a bar is drawn only when stderr is a terminal; "
                        "one line per model otherwise)")
    sub.add_parser("dir", help="print the cache folder")
    sub.add_parser("table", help="markdown summary of the built models (from meta.json)")
    args = ap.parse_args(argv)

    if args.cmd == "dir":
        print(zoo.cache_dir())
        return 0
    if args.cmd == "table":
        print(markdown_table())
        return 0
    if args.cmd == "list":
        rows = [
            {"name": e.name, "family": e.family, "task": e.task, "exporter": e.exporter,
             "built": zoo.is_built(e.name), "description": e.description}
            for e in zoo.list_models()
        ]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            for r in rows:
                mark = "*" if r["built"] else " "
                print(f"{mark} {r['name']:<22} {r['family']:<11} {r['exporter']:<12} "
                      f"{r['task']:<21} {r['description']}")
            print(f"(* = built in {zoo.cache_dir()})")
        return 0
    known = [e.name for e in zoo.list_models()]
    unknown = [n for n in args.names if n not in known]
    if unknown:
        hints = [f"{n} (did you mean {' or '.join(close)}?)" if close else n
                 for n in unknown for close in [zoo.close_names(n)]]
        print(f"unknown model(s): {', '.join(hints)}; see `kiln zoo list`", file=sys.stderr)
        return 2
    try:
        paths = zoo.build(args.names or None, force=args.force,
                          progress=False if args.quiet else None)
    except KilnError as exc:  # a missing dependency: one line naming what to install
        print(f"kiln zoo: error: {exc}", file=sys.stderr)
        return 1
    except RuntimeError as exc:
        print(exc, file=sys.stderr)
        return 1
    for p in paths:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
