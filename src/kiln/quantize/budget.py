"""An accuracy budget: how much worse than the float model a converted one may be, on
given data (``kiln.quantize``'s accuracy-aware mode and ``convert_float16``'s check)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.errors import OptionError

__all__ = ["Budget"]


@dataclass(frozen=True)
class Budget:
    """How much worse than the float model a quantized one may be, on the given data:
    ``max_rel`` bounds every output's max |error| / max |float output|, ``min_top1`` the
    fraction of rows whose argmax agrees with the float model's (0.995 bounds a top-1
    accuracy drop at 0.5 points). ``agreement`` with ``min_agreement``: the task's own
    measure, ``agreement(float_runs, quantized_runs) -> fraction`` where each run is one
    feed's list of outputs in the model's output order (the same string read, the same
    mask block, the same speech decision); 0.99 is a 1-point budget in the task's terms."""

    max_rel: float | None = None
    min_top1: float | None = None
    agreement: Callable[[list[list[np.ndarray]], list[list[np.ndarray]]], float] | None = None
    min_agreement: float | None = None

    @classmethod
    def parse(cls, text: str) -> Budget:
        """``rel=0.01``, ``top1=0.995`` or both, comma-separated."""
        kw: dict[str, float] = {}
        for part in text.split(","):
            key, _, val = part.partition("=")
            names = {"rel": "max_rel", "top1": "min_top1"}
            try:
                kw[names[key.strip()]] = float(val)
            except (KeyError, ValueError):
                raise OptionError(f"accuracy budget {text!r}: expected rel=R and/or top1=F, "
                                  "e.g. rel=0.01 or top1=0.995") from None
        return cls(**kw)

    def shortfall(self, outputs: dict, runs: tuple[list, list] | None = None) -> float:
        """How far ``outputs`` (name -> OutputError) are outside the budget; 0 inside.
        ``runs``: (float runs, quantized runs), each a list of per-feed output lists,
        for ``agreement``."""
        gap = 0.0
        if self.agreement is not None and self.min_agreement is not None:
            if runs is None:
                raise OptionError("a task-agreement budget needs the runs to compare")
            gap += max(0.0, self.min_agreement - float(self.agreement(*runs))) * 100
        worst_rel = max((e.rel for e in outputs.values()), default=0.0)
        tops = [e.top1 for e in outputs.values() if e.top1 is not None]
        if self.max_rel is not None:
            gap += max(0.0, worst_rel - self.max_rel) / max(self.max_rel, 1e-12)
        if self.min_top1 is not None and tops:
            gap += max(0.0, self.min_top1 - min(tops)) * 100
        return gap

    def __str__(self) -> str:
        parts = []
        if self.max_rel is not None:
            parts.append(f"relative error <= {self.max_rel:g}")
        if self.min_top1 is not None:
            parts.append(f"top-1 agreement >= {self.min_top1:.2%}")
        if self.agreement is not None and self.min_agreement is not None:
            parts.append(f"task agreement >= {self.min_agreement:.2%}")
        return " and ".join(parts) or "none"
