"""Hops from ``Session.run`` to a kernel: the Python frames between the call to
``Session.run`` and the kernel that computes a layer, on each backend (a kernel of the
torch backend's own, a shared array-API kernel on torch tensors, and the NumPy kernel).

    python benchmarks/run_hops.py

Prints the frames, innermost last, for Relu on NumPy; on torch for Relu and Neg (torch
kernels), Exp (the shared array-API kernel on tensors) and EyeLike (the NumPy kernel, its
values moved to the host and back).
"""

from __future__ import annotations

import sys

import numpy as np
from onnx import TensorProto, helper


def _model(op: str):
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _in_program(frame) -> bool:
    """Whether ``frame`` runs inside a plan's generated program (a step, not feeds)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<kiln plan"):
            return True
        frame = frame.f_back
    return False


def hops(backend: str, op: str, module_of_kernel: str) -> list[str]:
    """The frames from Session.run (exclusive) to the first call into a function of a
    module under ``module_of_kernel`` (inclusive): the kernel, or its wrapper."""
    import kiln

    sess = kiln.Session(_model(op), backend=backend, optimize=False)
    x = np.ones((4, 4), np.float32)
    sess.run(None, {"x": x})
    frames: list[str] = []

    def prof(frame, event, arg):
        if event != "call" or frames:
            return
        name = frame.f_globals.get("__name__") or ""
        if name.startswith(module_of_kernel) and name != "kiln.ops.torch.arrays" and \
                _in_program(frame):
            stack = []
            f = frame
            while f is not None and f.f_code.co_name != "run" or \
                    (f is not None and "session" not in f.f_code.co_filename):
                stack.append(f"{f.f_globals.get('__name__')}.{f.f_code.co_name}")
                f = f.f_back
            frames.extend(reversed(stack))
    sys.setprofile(prof)
    try:
        sess.run(None, {"x": x})
    finally:
        sys.setprofile(None)
    return frames


def main() -> None:
    for backend, op, mod in (("numpy", "Relu", "kiln.ops"),
                             ("torch", "Relu", "kiln.ops"),
                             ("torch", "Neg", "kiln.ops"), ("torch", "Exp", "kiln.ops"),
                             ("torch", "EyeLike", "kiln.ops")):
        fr = hops(backend, op, mod)
        print(f"{backend} {op}: {len(fr)} hops: " + " -> ".join(fr))


if __name__ == "__main__":
    main()
