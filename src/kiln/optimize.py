"""``kiln.optimize``: make a model smaller and faster without changing what it computes.

    import kiln
    fast = kiln.optimize(kiln.load("model.onnx"))                # level 2: all passes
    fixed = kiln.optimize(model, input_shapes={"x": [1, 3, 224, 224]})
    kiln.save(fast, "model.opt.onnx")                            # reloads without re-optimizing

Levels: 0 ("none") runs nothing but ``input_shapes``; 1 ("basic") runs the rewrites whose
result is still standard ONNX (folding, freezing, simplification, BatchNorm folding, CSE,
DCE); 2 ("extended", the default) adds the fusions into Kiln's own ops (domain
``ai.kiln``). Any pass can be switched off by name with ``disable=[...]``; see
:data:`PASS_NAMES` and ``docs/optimizer.md``.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping, Sequence

import onnx

from kiln.errors import KilnError
from kiln.ir import Model
from kiln.ops import registry
from kiln.ops.registry import KILN_DOMAIN
from kiln.passes import (
    CommonSubexpressionElimination,
    DeadCodeElimination,
    FixInputShapes,
    FoldConstants,
    Freeze,
    FuseActivation,
    FuseAttention,
    FuseBatchNorm,
    FuseGelu,
    FuseLayerNorm,
    InferShapes,
    OptimizeReport,
    Pass,
    PassManager,
    PinHost,
    Simplify,
)
from kiln.passes.base import clone_model, count_nodes, op_histogram

LEVELS = {"none": 0, "basic": 1, "extended": 2, "all": 2}
DEFAULT_LEVEL = 2
MARK = "kiln.optimized"
"""Metadata key recording the level a saved model was optimized at."""


def _loop_passes() -> list[Pass]:
    """The pipeline repeated to a fixed point, in order."""
    return [InferShapes(), FoldConstants(), Freeze(), Simplify(), FuseBatchNorm(),
            CommonSubexpressionElimination(), DeadCodeElimination(),
            FuseGelu(), FuseLayerNorm(), FuseAttention(), FuseActivation()]


def _final_passes() -> list[Pass]:
    """Analyses run once at the end (they annotate, they do not rewrite)."""
    return [InferShapes(), PinHost()]


PASS_NAMES: tuple[str, ...] = tuple(dict.fromkeys(
    ["fix_input_shapes"] + [p.name for p in _loop_passes() + _final_passes()]))


def optimize(model: Model | str | os.PathLike | bytes | onnx.ModelProto,
             level: int | str = DEFAULT_LEVEL, disable: Iterable[str] = (),
             input_shapes: Mapping[str, Sequence[int | str | None]] | None = None, *,
             backend: str = "numpy", max_iterations: int = 8, inplace: bool = False) -> Model:
    """The optimized model (a copy unless ``inplace``); see the module docstring."""
    return optimize_with_report(model, level, disable, input_shapes, backend=backend,
                                max_iterations=max_iterations, inplace=inplace)[0]


def optimize_with_report(model, level: int | str = DEFAULT_LEVEL, disable: Iterable[str] = (),
                         input_shapes=None, *, backend: str = "numpy",
                         max_iterations: int = 8, inplace: bool = False
                         ) -> tuple[Model, OptimizeReport]:
    """Like :func:`optimize`, also returning the report of what every pass did."""
    if not isinstance(model, Model):
        from kiln.onnxio import load

        model = load(model)
        inplace = True
    lvl = _level(level)
    disable = set(disable)
    unknown = disable - set(PASS_NAMES)
    if unknown:
        raise ValueError(f"unknown pass name(s) {sorted(unknown)} in disable=; the passes are "
                         f"{list(PASS_NAMES)}")
    if not inplace:
        model = clone_model(model)
    report = OptimizeReport(nodes_before=count_nodes(model.graph),
                            ops_before=op_histogram(model.graph))
    if input_shapes and "fix_input_shapes" not in disable:
        model, rec = FixInputShapes(input_shapes)(model)
        report.records.append((0, rec))
    done = _done_level(model)
    if lvl > 0:
        if done < lvl or input_shapes:
            loop = [p for p in _loop_passes() if p.level <= lvl and _supported(p, backend)]
            PassManager(loop, max_iterations, disable).run(model, report)
        PassManager(_final_passes(), 1, disable).run(model, report)
        if any(n.domain == KILN_DOMAIN for _, n in model.graph.walk()):
            model.opset_imports.setdefault(KILN_DOMAIN, 1)
        model.metadata[MARK] = str(max(lvl, done))
        if model.ir_version < 4 and any(not v.meta.get("overridable")
                                        for v in model.graph.initializers.values()):
            model.ir_version = 4  # IR 3 wants every initializer listed as an input too
    report.nodes_after = count_nodes(model.graph)
    report.ops_after = op_histogram(model.graph)
    return model, report


def _level(level: int | str) -> int:
    if isinstance(level, str):
        if level.lower() not in LEVELS:
            raise ValueError(f"unknown optimization level {level!r}; use 0-2 or one of "
                             f"{list(LEVELS)}")
        return LEVELS[level.lower()]
    if not 0 <= int(level) <= 2:
        raise ValueError(f"optimization level must be 0, 1 or 2 (got {level})")
    return int(level)


def _done_level(model: Model) -> int:
    try:
        return int(model.metadata.get(MARK, -1))
    except ValueError:
        return -1


def _supported(p: Pass, backend: str) -> bool:
    """A fusion runs only for backends that have kernels for the ops it creates (NumPy has
    them all; others get a fused op once they register a kernel or it is generic)."""
    if backend == "numpy" or not p.creates:
        return True
    for op_type in p.creates:
        d = registry.lookup(KILN_DOMAIN, op_type, 1)
        if d is None or not d.runs_on(backend):
            return False
    return True


def optimize_for_session(model: Model, enabled: bool, input_shapes, backend: str) -> Model:
    """What ``InferenceSession`` runs: the optimized copy of ``model`` (only the fixed
    shapes when ``enabled`` is False). A bug in a pass must not stop a model from running:
    anything but a KilnError (a bad ``input_shapes``, say) warns and keeps the model."""
    try:
        return optimize(model, level=DEFAULT_LEVEL if enabled else 0,
                        input_shapes=input_shapes, backend=backend)
    except KilnError:
        raise
    except Exception as e:  # noqa: BLE001 - fall back to the model as given
        warnings.warn(f"kiln.optimize failed ({type(e).__name__}: {e}); the model runs "
                      "unoptimized. Please report this.", RuntimeWarning, stacklevel=3)
        return model
