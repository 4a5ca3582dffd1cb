"""What one simulated step computes and what it costs, as plain data: `RowLoad` (one scheduled request), `StepLoad`
(the step's rows and swap bytes, read from a `cbnb.core.plan.StepWork`) and `StepCost` (the cost model's answer,
split by where the seconds go; see `cbnb.sim.cost` for the formulas)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = ["RowLoad", "StepLoad", "StepCost"]


@dataclass(frozen=True)
class RowLoad:
    """One scheduled request: `start` past tokens (its first position), `tokens` query tokens, `samples`, and
    `shared` of its past tokens in blocks an earlier row of the step also reads (`cbnb.core.plan.StepWork`)."""

    start: int
    tokens: int
    samples: bool
    shared: int = 0


@dataclass(frozen=True)
class StepLoad:
    """What one step computes: its rows and the bytes copied between host and device."""

    rows: tuple[RowLoad, ...]
    swap_bytes: int = 0

    @classmethod
    def from_work(cls, work: Any, layout: Any) -> "StepLoad":
        """Read a `cbnb.core.engine_core.StepWork`: scheduled requests, swap-outs and restores (bytes per block per
        group)."""
        shared = work.shared_tokens or [0] * len(work.plan.scheduled)
        rows = tuple(RowLoad(s.start, s.num_tokens, s.samples, sh) for s, sh in zip(work.plan.scheduled, shared))
        nbytes = 0
        for _, so in work.swap_outs:
            nbytes += sum(len(gp) * layout.bytes_per_block(g) for g, gp in enumerate(so.pairs))
        for _, pairs in work.restores:
            nbytes += sum(len(gp) * layout.bytes_per_block(g) for g, gp in enumerate(pairs))
        return cls(rows, nbytes)

    @classmethod
    def of(cls, rows: Iterable[tuple], swap_bytes: int = 0) -> "StepLoad":
        """From ``(start, tokens, samples)`` triples or ``(start, tokens, samples, shared)`` quadruples."""
        return cls(tuple(RowLoad(int(r[0]), int(r[1]), bool(r[2]), int(r[3]) if len(r) > 3 else 0) for r in rows),
                   int(swap_bytes))

    @property
    def num_tokens(self) -> int:
        return sum(r.tokens for r in self.rows)

    @property
    def num_samples(self) -> int:
        return sum(1 for r in self.rows if r.samples)

    @property
    def is_decode(self) -> bool:
        """Every request has one query token (the CUDA runner's decode graph shape)."""
        return bool(self.rows) and all(r.tokens == 1 for r in self.rows)


@dataclass
class StepCost:
    """Predicted seconds of one step, split by where they go.

    Attributes:
        host_s: host work (scheduling, packing, update).
        launch_s: eager kernel launches / operator dispatch (0 with a CUDA graph).
        compute_s: sum of the operator groups' roofline times.
        total_s: the step as the synchronous engine loop sees it (see the formula in `cbnb.sim.cost`).
        parts: seconds per group ("linear", "attention", "elementwise", "lm_head", "sample", "swap").
        flops, bytes: totals over the step.
        graph: whether the step ran as a CUDA graph replay.
        groups: seconds per group of the profile's `cost_factors` ("compute", "attention", "decode_attention",
            "fixed") and "swap", before the factors: on the CPU runner ``total_s = sum(factor_g * groups[g])``
            (swap unscaled), what `cbnb.measure.calibrate` fits the factors with.
    """

    host_s: float
    launch_s: float
    compute_s: float
    total_s: float
    parts: dict[str, float] = field(default_factory=dict)
    flops: float = 0.0
    bytes: float = 0.0
    graph: bool = False
    groups: dict[str, float] = field(default_factory=dict)

    @property
    def device_s(self) -> float:
        """What overlaps the next step's host work under async batching (launches and kernels)."""
        return self.total_s - self.host_s
