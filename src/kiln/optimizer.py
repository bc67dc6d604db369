"""The optimizer (``kiln.optimize(model)``, this module's :func:`optimize`): make a model
smaller and faster without changing what it computes.

    import kiln
    fast = kiln.optimize(kiln.load("model.onnx"))                # level 2: all passes
    fixed = kiln.optimize(model, input_shapes={"x": [1, 3, 224, 224]})
    kiln.save(fast, "model.opt.onnx")                            # reloads without re-optimizing

Levels: 0 ("none") runs nothing but ``input_shapes``; 1 ("basic") runs the rewrites whose
result is still standard ONNX (folding, freezing, simplification, BatchNorm folding, CSE,
DCE); 2 ("extended", the default) adds the fusions into Kiln's own ops (domain
``ai.kiln``). Any pass can be switched off by name with ``disable=[...]``; see
:data:`PASS_NAMES` and ``docs/optimizer.md``.

The rewrites are rules (:mod:`kiln.passes.rewrite`) pooled into one worklist engine, run in
stages: 0, before shape inference, the rules that need no types (Identity/Dropout removal,
Constant nodes, DCE, CSE), so a long chain of no-ops is gone before inference looks at it;
then shape inference once; then 1 the cleanup rules, 2 plus the pattern fusions, 3 plus the
activation fusion, 4 plus the merging of products that share an input. Each stage visits
every node once and then only the neighbourhoods of changes; types of touched nodes are
re-inferred on the way.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence

import onnx

from kiln.errors import KilnError
from kiln.ir import Model, collector_paused
from kiln.ops import registry
from kiln.ops.registry import KILN_DOMAIN, REFERENCE
from kiln.passes import (
    CommonSubexpressionElimination,
    DeadCodeElimination,
    FixInputShapes,
    FoldConstants,
    FoldPad,
    Freeze,
    FuseActivation,
    FuseAttention,
    FuseBatchNorm,
    FuseChannelShuffle,
    FuseGelu,
    FuseIntegerOps,
    FuseLayerNorm,
    FuseQuant,
    FuseRoPE,
    Identities,
    InferShapes,
    MergeMatMuls,
    OptimizeReport,
    Pass,
    PassRecord,
    PinHost,
    RoundTrips,
    RulePass,
    Simplify,
)
from kiln.passes.base import clone_model, count_nodes, op_histogram
from kiln.passes.rewrite import run_rules

LEVELS = {"none": 0, "basic": 1, "extended": 2, "all": 2}
DEFAULT_LEVEL = 2
MARK = "kiln.optimized"
"""Metadata key recording the level a saved model was optimized at."""
STAGES = (1, 2, 3, 4)


def _rule_passes() -> list[RulePass]:
    """The rewriting passes, in the order their rules are tried on a node."""
    return [FoldConstants(), Freeze(), Identities(), Simplify(), FuseBatchNorm(), FoldPad(),
            CommonSubexpressionElimination(), DeadCodeElimination(),
            FuseGelu(), FuseLayerNorm(), FuseAttention(), FuseQuant(), FuseIntegerOps(),
            FuseChannelShuffle(), FuseRoPE(), FuseActivation(), RoundTrips(), MergeMatMuls()]


PASS_NAMES: tuple[str, ...] = tuple(dict.fromkeys(
    ["fix_input_shapes", "infer_shapes"] + [p.name for p in _rule_passes()] + ["pin_host"]))


def optimize(model: Model | str | os.PathLike | bytes | onnx.ModelProto,
             level: int | str = DEFAULT_LEVEL, disable: Iterable[str] = (),
             input_shapes: Mapping[str, Sequence[int | str | None]] | None = None, *,
             backend: str = REFERENCE, max_iterations: int = 8, inplace: bool = False) -> Model:
    """The optimized model (a copy unless ``inplace``); see the module docstring."""
    return optimize_with_report(model, level, disable, input_shapes, backend=backend,
                                max_iterations=max_iterations, inplace=inplace)[0]


def optimize_with_report(model, level: int | str = DEFAULT_LEVEL, disable: Iterable[str] = (),
                         input_shapes=None, *, backend: str = REFERENCE,
                         max_iterations: int = 8, inplace: bool = False
                         ) -> tuple[Model, OptimizeReport]:
    """Like :func:`optimize`, also returning the report of what every pass did.
    ``max_iterations`` bounds the rewrites of each stage to ``max_iterations`` times the
    node count (a safety net: rules that undo each other cannot loop forever)."""
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
        t0 = time.perf_counter()
        infer = "infer_shapes" not in disable
        if done < lvl or input_shapes:
            active = [p for p in _rule_passes() if p.level <= lvl and p.name not in disable
                      and _supported(p, backend)]
            with collector_paused():
                _rewrite(model, active, report, infer, max_iterations)
        elif infer:
            _analysis(InferShapes(), model, report)
        if "pin_host" not in disable:
            _analysis(PinHost(), model, report)
        report.seconds = time.perf_counter() - t0
        model.metadata[MARK] = str(max(lvl, done))
        if model.ir_version < 4 and any(not v.meta.get("overridable")
                                        for v in model.graph.initializers.values()):
            model.ir_version = 4  # IR 3 wants every initializer listed as an input too
    report.nodes_after = count_nodes(model.graph)
    report.ops_after = op_histogram(model.graph)
    return model, report


def _analysis(p: Pass, model: Model, report: OptimizeReport) -> None:
    _, rec = p(model)
    report.records.append((report.iterations, rec))


def _rewrite(model: Model, passes: list[RulePass], report: OptimizeReport, infer: bool,
             max_iterations: int) -> None:
    """Stage 0 (untyped rules), shape inference, then stages 1-4 through the engine."""
    budget = max(1, max_iterations) * (count_nodes(model.graph) + 16)
    stages = [(0, [r for p in passes for r in p.owned_rules() if not r.needs_types], False)]
    if infer:
        stages += [(s, [r for p in passes if p.stage <= s for r in p.owned_rules()], True)
                   for s in STAGES]
    else:
        stages += [(1, [r for p in passes for r in p.owned_rules() if not r.needs_types],
                    False)]
    done: set[tuple[str, str]] = set()
    state: dict = {}  # rules' tables (CSE's constant fingerprints) outlive a stage
    for stage, rules, typed in stages:
        if stage == 1 and infer:
            _analysis(InferShapes(), model, report)
        records = {p.name: PassRecord(p.name) for p in passes}
        t0 = time.perf_counter()
        # rules that ran to a fixed point in an earlier stage only need the changes
        sweep = [r for r in rules if (r.owner, r.name) not in done]
        rw = run_rules(model, rules, records, infer=typed, budget=budget, sweep=sweep,
                       state=state)
        done |= {(r.owner, r.name) for r in rules}
        report.rewrites += rw.applied
        report.converged &= rw.converged
        if stage == stages[-1][0]:
            for p in passes:
                p.finish(model, records[p.name])
        dt = time.perf_counter() - t0
        for p in passes:
            records[p.name].seconds = dt / max(1, len(passes))
            report.records.append((stage, records[p.name]))
        report.iterations += 1


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
    if backend == REFERENCE or not p.creates:
        return True
    for op_type in p.creates:
        d = registry.lookup(KILN_DOMAIN, op_type, 1)
        if d is None or not d.runs_on(backend):
            return False
    return True


def optimize_for_session(model: Model, enabled: bool | int | str, input_shapes,
                         backend: str, *, fallback: Callable[[], Model] | None = None
                         ) -> Model:
    """What ``InferenceSession`` runs: ``model`` optimized (at the default level when
    ``enabled`` is True, at that level when it is one, only the fixed shapes when False),
    on a copy unless ``fallback`` is given: then in place, and ``fallback()`` makes the
    unoptimized model anew. A bug in a pass must not stop a model from running: anything
    but a KilnError (a bad ``input_shapes``, say) warns and runs the model as given."""
    try:
        return optimize(model, level=DEFAULT_LEVEL if enabled is True else (enabled or 0),
                        input_shapes=input_shapes, backend=backend,
                        inplace=fallback is not None)
    except KilnError:
        raise
    except Exception as e:  # noqa: BLE001 - fall back to the model as given
        warnings.warn(f"kiln.optimize failed ({type(e).__name__}: {e}); the model runs "
                      "unoptimized. Please report this.", RuntimeWarning, stacklevel=3)
        return model if fallback is None else fallback()
