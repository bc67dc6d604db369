"""``python -m kiln.onnxruntime script.py [args]`` / ``... -m module [args]`` / ``... -c
CODE``: run a program with ``import onnxruntime`` giving Kiln (kiln.onnxruntime.install)."""

from __future__ import annotations

import runpy
import sys


def main(argv: list[str]) -> None:
    """Install the alias, then run ``argv`` as Python itself would."""
    from kiln.onnxruntime import install
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        raise SystemExit(0 if argv else 2)
    install()
    if argv[0] == "-c":
        if len(argv) < 2:
            raise SystemExit("python -m kiln.onnxruntime -c CODE: give the code")
        sys.argv = ["-c", *argv[2:]]
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    elif argv[0] == "-m":
        if len(argv) < 2:
            raise SystemExit("python -m kiln.onnxruntime -m MODULE [ARGS]: name a module")
        sys.argv = argv[1:]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path.insert(0, __import__("os").path.dirname(argv[0]) or ".")
        runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
