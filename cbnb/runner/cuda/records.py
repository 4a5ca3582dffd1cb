"""What a launched CUDA-runner step carries until `collect` (`_Launched`) and what `collect` returns
(`CudaStepResult`: a `cbnb.core.plan.StepResult` with graph telemetry)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...core.plan import StepResult, StepWork
from .graphs import IOPair, StepShape

__all__ = ["CudaStepResult"]


@dataclass
class CudaStepResult(StepResult):
    """`StepResult` plus graph telemetry: this step's (captures, replays, failed captures), the backend name,
    captured keys, failed captures as (key, error message), and (when profiling) the GPU time of the step."""

    graph_counts: tuple[int, int, int] = (0, 0, 0)
    gpu_ms: float | None = None


@dataclass
class _Launched:
    work: StepWork
    pair: IOPair | None
    entries: list[Any]
    timings: dict[str, float]
    copied: int
    shape: StepShape | None = None
    graph: bool = False
    captured: tuple | None = None
    failed: list[Any] = field(default_factory=list)
    events: tuple | None = None
    kv_bytes: int = 0
    t_launch: float = 0.0
    report_columns: int = 1
    max_logprobs: int = 0
