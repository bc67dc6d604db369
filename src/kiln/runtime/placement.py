"""What ``session.placement()`` reports: where each layer runs and why, and what the last
run moved between host and device. Torch-free, so every backend can report."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunStats:
    """What one run moved between host and device, and how many fallback calls it made."""

    transfers: int = 0  # values copied host<->device for fallback / control-flow nodes
    fallback_calls: int = 0  # NumPy-kernel calls (planned fallbacks and per-call ones)
    compiled: bool = False  # this run used the torch.compile program


@dataclass
class LayerPlacement:
    """Where one layer runs and why."""

    name: str
    op_type: str
    where: str  # "cpu", "cuda:0", "host"
    how: str  # "torch", "torch-generic", "cpu-fallback", "numpy", "function"
    why: str = ""

    @classmethod
    def of(cls, node, where: str, how: str, why: str = "") -> LayerPlacement:
        """The placement of ``node`` (unnamed nodes are shown by their op type)."""
        return cls(node.name or f"({node.op_type})", node.op_type, where, how, why)


@dataclass
class PlacementReport:
    """Each layer's placement, and the last run's host<->device traffic."""

    backend: str
    device: str
    layers: list[LayerPlacement] = field(default_factory=list)
    last_run: RunStats | None = None
    compiled: str = ""  # whether the session runs a compiled program, and why (not)
    chosen: str = ""  # why this backend: asked for, stored by kiln tune, or the default

    @property
    def fallbacks(self) -> list[LayerPlacement]:
        """Layers that run on the NumPy kernel behind host<->device copies."""
        return [lp for lp in self.layers if lp.how == "cpu-fallback"]

    @property
    def transfers_last_run(self) -> int | None:
        return None if self.last_run is None else self.last_run.transfers

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for lp in self.layers:
            out[lp.how] = out.get(lp.how, 0) + 1
        return out

    def __str__(self) -> str:
        why = f" ({self.chosen})" if self.chosen else ""
        rows = [f"{self.backend} backend on {self.device}{why}: "
                + ", ".join(f"{n} {k}" for k, n in sorted(self.counts().items()))]
        if self.compiled:
            rows.append(f"compiled: {self.compiled}")
        if self.last_run is not None:
            r = self.last_run
            rows.append(f"last run: {r.transfers} host<->device transfers, "
                        f"{r.fallback_calls} fallback calls"
                        + (", compiled program" if r.compiled else ""))
        w = max([len(lp.name) for lp in self.layers] + [4])
        for lp in self.layers:
            rows.append(f"  {lp.name:<{w}}  {lp.op_type:<20} {lp.where:<7} {lp.how:<14} {lp.why}")
        return "\n".join(rows)
