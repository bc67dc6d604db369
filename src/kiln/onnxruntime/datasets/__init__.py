"""``onnxruntime.datasets``: the example models onnxruntime ships, read from the installed
onnxruntime wheel (Kiln ships no copies of them)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path


def get_example(name: str) -> str:
    """The absolute path of onnxruntime's example model ``name`` (for instance
    ``logreg_iris.onnx``); FileNotFoundError when onnxruntime is not installed."""
    try:
        dist = metadata.distribution("onnxruntime")
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"Unable to find example '{name}': the examples come with "
                                "the onnxruntime package, which is not installed") from None
    path = Path(dist.locate_file(f"onnxruntime/datasets/{name}"))
    if not path.exists():
        raise FileNotFoundError(f"Unable to find example '{name}'")
    return str(path.resolve())
