"""The plain data of one step, shared by the deciding side and the executing side (torch-free, no imports).

The scheduler and `EngineCore` *make* these records; the runner (real or simulated) *executes* them and returns a
`StepResult`; telemetry reads both. Nothing here decides anything, so a runner imports this module and never the
scheduler, the cache manager or the core.

- `BatchPlan`: the scheduler's decision for a step: the `ScheduledRequest`s that run, and for every request not
  taken the `SkipReason` with the numbers that decided it (`SkippedRequests`), plus the active requests that could
  not get their next blocks (`StalledRequest`). `BatchPlan.skipped_requests()` yields every (request id, reason).
- `QueueTail`: the compact form of a skip entry's request ids when a reason covers the whole rest of the waiting
  queue (a sequence of ids that expands on demand), so that recording a step's skips costs O(distinct reasons), not
  O(waiting requests).
- `StepWork`: the plan plus what the core decided around it (offloads, the swap-out and restore copies, requests
  failed while scheduling) and where the step's KV lives (`StepKV`: per scheduled row and layer group, the block
  table and the write slots), i.e. everything the runner must do for the step: a runner reads the step's
  `StepWork`, never the cache manager. A runner is built from the cache's fixed `KVGeometry` (page size, layer
  groups, capacity), plain data too.
- `StepResult`: what a runner hands back: the sampled token per request and where the time went.

Field types that belong to the deciding modules (`Request`, `Allocation`, `OffloadDecision`, `SwapOut`) are named
for type checkers only.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator

if TYPE_CHECKING:  # names only: importing them would tie this module to the deciding side
    from .cache.manager import Allocation, SwapOut
    from .offload import OffloadDecision
    from .requests import Request

__all__ = ["SkipReason", "ScheduledRequest", "SkippedRequests", "QueueTail", "StalledRequest", "BatchPlan",
           "KVGroup", "KVGeometry", "RowKV", "StepKV", "decode_slot",
           "StepWork", "StepResult"]


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


class QueueTail(Sequence):
    """Request ids in compact form: `head` (explicit ids), then the waiting queue as it stood at one step from one
    position on.

    A scheduler keeps `log`, an append-only list of the request ids it queued, one entry per queueing (a request
    re-queued by an offload appears again); the waiting queue is the entries of the log not yet taken out, in log
    order. The tail is the log's entries ``lo .. hi - 1`` except the positions in `holes` (entries taken out of the
    queue before that step), so it costs O(1) to record, whatever the length of the queue, and it expands on
    iteration to exactly the ids the scheduler would have listed one by one. It compares equal to any sequence of
    the same ids (a list, a tuple, another `QueueTail`); `to_dict()` of events writes it as a list.

    Args:
        head: ids listed before the tail (e.g. active requests refused for the same reason first).
        log: the scheduler's queue log (never modified in the range the tail covers).
        lo, hi: the tail's range of log positions.
        holes: positions in [lo, hi) that are not part of the tail.
    """

    __slots__ = ("head", "log", "lo", "hi", "holes", "_n")

    def __init__(self, head: Sequence[str], log: list[str], lo: int, hi: int, holes: Sequence[int] = ()) -> None:
        self.head = tuple(head)
        self.log = log
        self.lo, self.hi = lo, hi
        self.holes = frozenset(holes)
        self._n = len(self.head) + hi - lo - len(self.holes)

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[str]:
        yield from self.head
        tail = self.log[self.lo:self.hi]
        if not self.holes:
            yield from tail
        else:
            holes, lo = self.holes, self.lo
            yield from (rid for i, rid in enumerate(tail, lo) if i not in holes)

    def __getitem__(self, i: Any) -> Any:
        return list(self)[i]

    def __contains__(self, rid: object) -> bool:
        return any(r == rid for r in self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (str, bytes)) or not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        ids = list(self)
        shown = ", ".join(map(repr, ids[:4])) + (", ..." if len(ids) > 4 else "")
        return f"QueueTail([{shown}], {len(ids)} ids)"

    def __deepcopy__(self, memo: dict) -> "QueueTail":
        return self  # immutable (its log range never changes)


@dataclass
class SkippedRequests:
    """Requests not taken for one reason; `detail` holds the numbers that decided it (tokens, blocks, fractions).

    `request_ids` is a list, or a `QueueTail` when the reason covered the rest of the waiting queue (it iterates,
    counts and compares as the list would)."""

    reason: SkipReason
    request_ids: list[str] | QueueTail
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
    #: running requests preempted while planning (a policy that preempts by itself, as vLLM's does), as
    #: `OffloadDecision`s (soft resets: blocks freed, re-queued, recomputed); the core moves them to `StepWork.offloads`
    preempted: list[OffloadDecision] = field(default_factory=list)
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

    def skipped_requests(self) -> Iterator[tuple[str, SkipReason]]:
        """Every request not taken this step with its reason, as (request_id, reason): entry by entry, each entry's
        ids in candidate order (compact `QueueTail` entries expanded)."""
        for s in self.skipped:
            for rid in s.request_ids:
                yield rid, s.reason


@dataclass(frozen=True)
class KVGroup:
    """One layer group's fixed KV geometry: `window` in tokens (0: full attention), the padding blocks (`read`: a
    block of zeros padded tables point to; `write`: where the K/V of a dropped position goes)."""

    window: int
    read_padding_block: int | None
    write_padding_block: int | None


@dataclass(frozen=True)
class KVGeometry:
    """The KV cache's fixed geometry, all a runner is built from (`CacheManager.geometry()`; plain data, so that
    no runner reads the cache manager): `page_size` in tokens, `groups` (a `KVGroup` per layer group, in layer-group
    order) and `capacity_tokens` (tokens the largest layer group can hold)."""

    page_size: int
    groups: tuple[KVGroup, ...]
    capacity_tokens: int


@dataclass(slots=True)
class RowKV:
    """Where one scheduled row's KV lives, per layer group (block ids and slots are ints; slot = block * page_size
    + offset).

    Attributes:
        tables: per group, the request's block table as of planning (the allocator's own list, shared and not
            copied: valid for the step's launch, which follows its planning; read it then).
        write_slots: per group, the slot receiving the K/V of each of the row's positions (-1: the write-padding
            block); None for a one-token row (a decode), whose slot is `decode_slot` of its table.
        window_slots: per group, for a chunk that starts past 0 in a sliding group, the slots of the window's earlier
            positions it attends to (oldest first); None elsewhere.
    """

    tables: list[list[int]]
    write_slots: list[list[int]] | None = None
    window_slots: list[list[int] | None] | None = None


@dataclass
class StepKV:
    """The step's KV data for the runner: the geometry (`page_size`, `groups`) and a `RowKV` per scheduled request id."""

    page_size: int
    groups: list[KVGroup]
    rows: dict[str, RowKV] = field(default_factory=dict)


def decode_slot(table: list[int], position: int, window: int, page_size: int) -> int:
    """The slot of `position` in a request's block `table` (a sliding group keeps position p at ring slot
    ``p % window``; `cbnb.core.cache.allocators`)."""
    r = position % window if window else position
    return table[r // page_size] * page_size + r % page_size


@dataclass
class StepWork:
    """Everything the runner must do for one step, plus what was decided on the way.

    The runner copies `swap_outs` (device -> host) first, then `restores` (host -> device), then runs the forward
    of `plan` and samples (see `cbnb.core.engine_core` for why that order is required).

    Attributes:
        step_id: monotonically increasing step number.
        plan: the scheduler's `BatchPlan` (the batch to run; may be empty).
        offloads: offload decisions applied before this step.
        swap_outs: (request, pairs) to copy device -> host *before* anything else.
        restores: (request, per-group (host, device) pairs) to copy host -> device before the forward.
        failed: requests ended while scheduling (prompt too long, or the cache exhausted).
        schedule_s: seconds spent scheduling (including offload decisions).
        t0: the core's clock when planning began (seconds: perf_counter, or simulated).
        kv: where the scheduled rows' KV lives (`StepKV`; None for a plan nobody will execute, e.g. in tests).
        shared_tokens: per scheduled row, its past tokens in blocks an earlier row of the step reads too
            (`cbnb.core.cache.manager.CacheManager.shared_reads`); [] when nothing is shared or the core does not
            measure it (`EngineCore.measure_shared_reads`).
    """

    step_id: int
    plan: BatchPlan
    offloads: list[OffloadDecision] = field(default_factory=list)
    swap_outs: list[tuple[Request, SwapOut]] = field(default_factory=list)
    restores: list[tuple[Request, list[list[tuple[int, int]]]]] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)
    schedule_s: float = 0.0
    t0: float = 0.0
    kv: StepKV | None = None
    shared_tokens: list[int] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return self.plan.empty


@dataclass
class StepResult:
    """What a runner returns for one step.

    Attributes:
        tokens: request_id -> sampled token id, for the requests that sampled (and whose logits were finite).
        logprobs: request_id -> the token's `TokenLogprob`, for the requests that want logprobs.
        invalid: request_id -> error, for the requests whose logits were not finite this step (they fail; the
            others go on).
        timings: seconds per phase ("offload_copy", "prepare", "forward", "sample"; a runner may add others).
        copied_bytes: bytes moved by the step's swap-out and restore copies.
        graph_counts: (CUDA graphs captured, graphs replayed[, failed captures]) in this step.
        graph_captured: the padded-shape keys captured in this step.
        graph_failed: (key, error message) of each capture that failed in this step (that shape runs eagerly).
        backend: how the step ran, e.g. "cpu-eager", "cuda-graph-async" ("" when the runner does not say).
        prompt_logprobs: request_id -> [(position, `TokenLogprob` of the prompt token at that position)], for the
            prefill rows of requests that asked for prompt logprobs.
    """

    tokens: dict[str, int]
    timings: dict[str, float] = field(default_factory=dict)
    copied_bytes: int = 0
    graph_counts: tuple[int, ...] = (0, 0)
    graph_captured: list[tuple] = field(default_factory=list)
    graph_failed: list[tuple[tuple, str]] = field(default_factory=list)
    backend: str = ""
    logprobs: dict[str, Any] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)
    prompt_logprobs: dict[str, list] = field(default_factory=dict)
