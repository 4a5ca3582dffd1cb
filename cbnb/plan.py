"""The plain data of one step, shared by the deciding side and the executing side (torch-free, no imports).

The scheduler and `EngineCore` *make* these records; the runner (real or simulated) *executes* them and returns a
`StepResult`; telemetry reads both. Nothing here decides anything, so a runner imports this module and never the
scheduler, the cache manager or the core.

- `BatchPlan`: the scheduler's decision for a step: the `ScheduledRequest`s that run, and for every request not
  taken the `SkipReason` with the numbers that decided it (`SkippedRequests`), plus the active requests that could
  not get their next blocks (`StalledRequest`).
- `StepWork`: the plan plus what the core decided around it (offloads, the swap-out and restore copies, requests
  failed while scheduling), i.e. everything the runner must do for the step.
- `StepResult`: what a runner hands back: the sampled token per request and where the time went.

Field types that belong to the deciding modules (`Request`, `Allocation`, `OffloadDecision`, `SwapOut`) are named
for type checkers only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # names only: importing them would tie this module to the deciding side
    from .cache.manager import Allocation, SwapOut
    from .offload import OffloadDecision
    from .requests import Request

__all__ = ["SkipReason", "ScheduledRequest", "SkippedRequests", "StalledRequest", "BatchPlan", "StepWork",
           "StepResult"]


class SkipReason(str, enum.Enum):
    """Why a candidate was not taken this step."""

    TOKEN_BUDGET = "token_budget"
    CACHE_BUDGET = "cache_budget"
    REQUEST_CAP = "request_cap"
    SAFETY_MARGIN = "safety_margin"
    NO_FREE_BLOCKS = "no_free_blocks"
    STALLED_AHEAD = "stalled_ahead"
    OFFLOAD_BACKOFF = "offload_backoff"
    FINISHING = "finishing"  # async only: its last token is in flight


@dataclass
class ScheduledRequest:
    """One request in the step.

    Attributes:
        request: the request (its `num_computed` already advanced past this chunk).
        start: first token position computed this step (the past length, in tokens).
        num_tokens: query tokens this step.
        phase: "decode" (one new token of a generating request) or "prefill" (a prompt chunk, or recomputation).
        samples: whether this step samples a token for the request (its last pending token is in the chunk).
        prefix_hit_tokens: tokens served from the prefix cache at this admission (0 otherwise).
        allocation: blocks allocated for this step (None when the table already covered the chunk).
    """

    request: Request
    start: int
    num_tokens: int
    phase: str
    samples: bool
    prefix_hit_tokens: int = 0
    allocation: Allocation | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class SkippedRequests:
    """Requests not taken for one reason; `detail` holds the numbers that decided it (tokens, blocks, fractions)."""

    reason: SkipReason
    request_ids: list[str]
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class StalledRequest:
    """An active request that could not get the blocks for its next chunk."""

    request_id: str
    tokens: int
    blocks_needed: list[int]
    blocks_available: list[int]


@dataclass
class BatchPlan:
    """The scheduler's decision for one step (plain data)."""

    step_id: int
    scheduler: str
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    skipped: list[SkippedRequests] = field(default_factory=list)
    stalled: list[StalledRequest] = field(default_factory=list)
    token_budget: int = 0
    cache_budget: int = 0
    cache_read_tokens: int = 0
    request_cap: int = 0
    free_fraction: float = 1.0
    safety_margin: float = 0.0

    @property
    def below_margin(self) -> bool:
        return self.free_fraction < self.safety_margin

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.phase == "prefill")

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.phase == "decode")

    @property
    def empty(self) -> bool:
        return not self.scheduled

    def skip_reason(self, request_id: str) -> SkippedRequests | None:
        for s in self.skipped:
            if request_id in s.request_ids:
                return s
        return None


@dataclass
class StepWork:
    """Everything the runner must do for one step, plus what was decided on the way.

    The runner copies `swap_outs` (device -> host) first, then `restores` (host -> device), then runs the forward
    of `plan` and samples (see `cbnb.core` for why that order is required).

    Attributes:
        step_id: monotonically increasing step number.
        plan: the scheduler's `BatchPlan` (the batch to run; may be empty).
        offloads: offload decisions applied before this step.
        swap_outs: (request, pairs) to copy device -> host *before* anything else.
        restores: (request, per-group (host, device) pairs) to copy host -> device before the forward.
        failed: requests ended while scheduling (prompt too long, or the cache exhausted).
        schedule_s: seconds spent scheduling (including offload decisions).
    """

    step_id: int
    plan: BatchPlan
    offloads: list[OffloadDecision] = field(default_factory=list)
    swap_outs: list[tuple[Request, SwapOut]] = field(default_factory=list)
    restores: list[tuple[Request, list[list[tuple[int, int]]]]] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    schedule_s: float = 0.0

    @property
    def empty(self) -> bool:
        return self.plan.empty


@dataclass
class StepResult:
    """What a runner returns for one step.

    Attributes:
        tokens: request_id -> sampled token id, for the requests that sampled.
        timings: seconds per phase ("offload_copy", "prepare", "forward", "sample"; a runner may add others).
        copied_bytes: bytes moved by the step's swap-out and restore copies.
        graph_counts: (CUDA graphs captured, graphs replayed[, failed captures]) in this step.
        graph_captured: the padded-shape keys captured in this step.
        graph_failed: (key, error message) of each capture that failed in this step (that shape runs eagerly).
        backend: how the step ran, e.g. "cpu-eager", "cuda-graph-async" ("" when the runner does not say).
    """

    tokens: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)
    copied_bytes: int = 0
    graph_counts: tuple[int, ...] = (0, 0)
    graph_captured: list[tuple] = field(default_factory=list)
    graph_failed: list[tuple[tuple, str]] = field(default_factory=list)
    backend: str = ""
