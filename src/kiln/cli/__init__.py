"""The ``kiln`` command line (``kiln --help``); a thin layer over :mod:`kiln.tools`."""

from kiln.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
