"""Telemetry: typed event records and the `EventLog` (torch-free).

Every scheduling, cache and runner decision becomes a small, plain-data record with the step id it belongs to and
a timestamp on the engine's clock (`time.perf_counter()` seconds; simulated seconds on a `SimEngine`). The
`cbnb.telemetry.recorder.Recorder` gathers a loop turn's events in its own pending list and appends them to the log in
one batch at the turn's end (`Recorder.flush`), so nothing that a later, overlapped step records can overwrite them.

`EventLog` is append-only, thread-safe and bounded (oldest records dropped first). Pollers read "everything since
cursor N"; subscribers get each step's batch of events on the engine thread (keep callbacks cheap). Export:
`to_dicts()`, `to_jsonl()`, `to_dataframe()` (needs pandas).
"""

from __future__ import annotations

import itertools
import json
import threading
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Iterator, TextIO

__all__ = [
    "Event", "StepPlanned", "BlocksAllocated", "BlocksFreed", "BlocksShared", "BlocksDemoted", "BlocksDeduplicated",
    "PrefixHit", "Offload", "Restore", "CudaGraph", "StateChange", "StepTiming", "RequestAdded", "RequestWarning",
    "RequestDone", "RunStarted", "EventLog", "EVENT_TYPES",
]


@dataclass
class Event:
    """Base record: `step` (0 = outside any step, e.g. a submission) and `t` (perf_counter seconds)."""

    kind: ClassVar[str] = "event"
    step: int
    t: float

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["kind"] = self.kind
        return d


@dataclass
class StepPlanned(Event):
    """The scheduler's plan for a step.

    `taken`: (request_id, phase "prefill"|"decode", query tokens, start position, prefix-hit tokens) per request.
    `skipped`: (reason, request_ids, detail numbers) per reason (see `cbnb.core.scheduler.SkipReason`); `request_ids`
    is a list, or a `cbnb.core.plan.QueueTail` (the rest of the waiting queue in compact form: it iterates, counts and
    compares like the list; `to_dict()` writes a list). `skipped_requests()` yields every (request_id, reason).
    `stalled`: (request_id, blocks needed per group, blocks obtainable per group).
    Budgets: tokens (`max_batch_tokens`), cache (tokens readable), request cap, and their use this step.
    `shared_tokens`: per taken request (same order), its past tokens in blocks an earlier request of the step also
    reads (a shared prefix: `cbnb.core.plan.StepWork.shared_tokens`); empty when nothing was shared or not measured.
    """

    kind: ClassVar[str] = "step_planned"
    scheduler: str = ""
    taken: list[tuple[str, str, int, int, int]] = field(default_factory=list)
    skipped: list[tuple[str, list[str], dict[str, Any]]] = field(default_factory=list)
    stalled: list[tuple[str, list[int], list[int]]] = field(default_factory=list)
    token_budget: int = 0
    tokens_used: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cache_budget_tokens: int = 0
    cache_read_tokens: int = 0
    request_cap: int = 0
    requests_used: int = 0
    free_fraction: float = 1.0
    safety_margin: float = 0.0
    shared_tokens: list[int] = field(default_factory=list)

    def skipped_requests(self) -> Iterator[tuple[str, str]]:
        """Every request not taken this step with its reason, as (request_id, reason), entry by entry."""
        for reason, ids, _detail in self.skipped:
            for rid in ids:
                yield rid, reason

    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        d["skipped"] = [(r, list(ids), dict(detail)) for r, ids, detail in self.skipped]
        return d


@dataclass
class BlocksAllocated(Event):
    """New blocks appended to a request's table (per layer group), and cached blocks demoted to make room."""

    kind: ClassVar[str] = "blocks_allocated"
    request_id: str = ""
    blocks: list[list[int]] = field(default_factory=list)
    demoted: list[list[int]] = field(default_factory=list)


@dataclass
class BlocksFreed(Event):
    """A request released its blocks: `freed` returned to the free list, `cached` kept for their content."""

    kind: ClassVar[str] = "blocks_freed"
    request_id: str = ""
    freed: list[list[int]] = field(default_factory=list)
    cached: list[list[int]] = field(default_factory=list)


@dataclass
class BlocksShared(Event):
    """Blocks referenced by one more request (prefix hit); `refcounts` after the share."""

    kind: ClassVar[str] = "blocks_shared"
    request_id: str = ""
    blocks: list[int] = field(default_factory=list)
    refcounts: list[int] = field(default_factory=list)


@dataclass
class BlocksDemoted(Event):
    """Cached prefix blocks whose hash was dropped so the blocks could be reused."""

    kind: ClassVar[str] = "blocks_demoted"
    group: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass
class BlocksDeduplicated(Event):
    """Completed blocks found already cached: (table position, duplicate freed, block kept)."""

    kind: ClassVar[str] = "blocks_deduplicated"
    request_id: str = ""
    pairs: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class PrefixHit(Event):
    """Prompt tokens served from the prefix cache at admission."""

    kind: ClassVar[str] = "prefix_hit"
    request_id: str = ""
    tokens: int = 0
    blocks: list[int] = field(default_factory=list)
    prompt_tokens: int = 0


@dataclass
class Offload(Event):
    """A request gave up its blocks: `path` "swap" (copied to host) or "soft_reset" (recomputed later)."""

    kind: ClassVar[str] = "offload"
    request_id: str = ""
    path: str = ""
    reason: str = ""
    blocks_freed: int = 0
    tokens_to_recompute: int = 0


@dataclass
class Restore(Event):
    """A swapped request's blocks were copied back to the device."""

    kind: ClassVar[str] = "restore"
    request_id: str = ""
    blocks: int = 0


@dataclass
class CudaGraph(Event):
    """A CUDA graph captured, replayed, or whose capture failed, for a padded shape `key` (IO pair, kind, query tokens,
    KV tokens). A failed capture carries the original `error`; that shape then runs eagerly."""

    kind: ClassVar[str] = "cuda_graph"
    action: str = ""  # "capture" | "replay" | "capture_failed"
    key: tuple = ()
    error: str = ""


@dataclass
class StateChange(Event):
    """A request moved between lifecycle states at time `at` (perf_counter seconds)."""

    kind: ClassVar[str] = "state_change"
    request_id: str = ""
    old: str = ""
    new: str = ""
    at: float = 0.0


@dataclass
class StepTiming(Event):
    """Where a step's time went (seconds), with its size."""

    kind: ClassVar[str] = "step_timing"
    schedule_s: float = 0.0
    offload_copy_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    num_tokens: int = 0
    num_requests: int = 0
    backend: str = ""  # e.g. "cpu-eager", "cuda-graph"


@dataclass
class RequestAdded(Event):
    """A request was submitted; `processors`: what it applies to its logits, in order
    (`SamplingParams.describe`, e.g. ("repetition_penalty=1.2", "temperature=0.7", "top_p=0.9"))."""

    kind: ClassVar[str] = "request_added"
    request_id: str = ""
    prompt_tokens: int = 0
    max_new_tokens: int | None = None
    processors: tuple[str, ...] = ()


@dataclass
class RequestWarning(Event):
    """A request was admitted although it can never finish as asked: `code` "exceeds_cache" (its prompt +
    max_new_tokens is more than the KV cache holds for one request; it may end "cache_exhausted")."""

    kind: ClassVar[str] = "request_warning"
    request_id: str = ""
    code: str = ""
    message: str = ""


@dataclass
class RequestDone(Event):
    """A request reached a terminal state, with its figures (seconds; None when not reached)."""

    kind: ClassVar[str] = "request_done"
    request_id: str = ""
    state: str = ""
    output_tokens: int = 0
    error: str | None = None
    finish_reason: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    queue_s: float | None = None
    prefix_cached_tokens: int = 0
    num_offloads: int = 0
    num_soft_resets: int = 0


@dataclass
class RunStarted(Event):
    """A new run begins after step `step`: `cause` "reconfigure" (the config changed; `label` names the changed
    fields, e.g. "page_size=16, safety_margin=0.3"), "reset_stats" (`engine.reset_stats()`) or "workload" (a standard
    workload was submitted). The live plots start a new segment here.

    A reconfigure also records the resolved config's values before and after it (`config_before`, `config_after`:
    field name -> value; empty for the other causes), so that a request's story can quote the config in force at
    each step rather than today's."""

    kind: ClassVar[str] = "run_started"
    cause: str = ""
    label: str = ""
    config_before: dict[str, Any] = field(default_factory=dict)
    config_after: dict[str, Any] = field(default_factory=dict)


EVENT_TYPES: dict[str, type[Event]] = {
    cls.kind: cls for cls in (StepPlanned, BlocksAllocated, BlocksFreed, BlocksShared, BlocksDemoted,
                              BlocksDeduplicated, PrefixHit, Offload, Restore, CudaGraph, StateChange, StepTiming,
                              RequestAdded, RequestWarning, RequestDone, RunStarted)
}


class EventLog:
    """Append-only, thread-safe, bounded log of events with cursor reads and subscriptions.

    Args:
        maxlen: records kept (oldest dropped first); must be >= 1.

    Every appended record gets a sequence number; `cursor` is the next one. `since(n)` returns what is retained
    from sequence number n on, and how many records between n and the oldest retained were dropped.
    """

    def __init__(self, maxlen: int = 100_000) -> None:
        if not isinstance(maxlen, int) or maxlen < 1:
            raise ValueError(f"maxlen must be an integer >= 1; got {maxlen!r}")
        self.maxlen = maxlen
        self._buf: deque[Event] = deque(maxlen=maxlen)
        self._next = 0
        self._lock = threading.Lock()
        self._subs: list[Callable[[list[Event]], None]] = []

    @property
    def cursor(self) -> int:
        """Sequence number the next record will get."""
        return self._next

    def __len__(self) -> int:
        return len(self._buf)

    def extend(self, events: list[Event]) -> None:
        """Append a step's records, then notify subscribers (on the caller's thread)."""
        if not events:
            return
        with self._lock:
            self._buf.extend(events)
            self._next += len(events)
            subs = list(self._subs)
        for cb in subs:
            try:
                cb(events)
            except Exception:  # a broken subscriber must not break the engine loop
                pass

    def append(self, event: Event) -> None:
        self.extend([event])

    def since(self, cursor: int = 0) -> tuple[list[Event], int, int]:
        """Records with sequence number >= `cursor`.

        Returns:
            (records, new cursor, records dropped before the caller could read them).
        """
        with self._lock:
            oldest = self._next - len(self._buf)
            start = max(cursor, oldest)
            dropped = max(0, oldest - cursor)
            n = self._next - start
            # Copy only the tail the caller has not read (the log may hold 100,000 records).
            items = list(itertools.islice(reversed(self._buf), n))[::-1] if n > 0 else []
            return items, self._next, dropped

    def subscribe(self, callback: Callable[[list[Event]], None]) -> Callable[[], None]:
        """Call `callback(events)` for each appended batch. Returns a function that unsubscribes."""
        with self._lock:
            self._subs.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subs:
                    self._subs.remove(callback)

        return unsubscribe

    def clear(self) -> None:
        """Drop retained records (sequence numbers keep counting)."""
        with self._lock:
            self._buf.clear()

    def events(self, kind: str | type[Event] | None = None) -> list[Event]:
        """Retained records, optionally of one kind."""
        items, _, _ = self.since(0)
        if kind is None:
            return items
        k = kind if isinstance(kind, str) else kind.kind
        return [e for e in items if e.kind == k]

    def to_dicts(self, kind: str | type[Event] | None = None) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.events(kind)]

    def to_jsonl(self, target: str | TextIO | None = None) -> str | None:
        """JSON lines: written to `target` (a path or file object), or returned as a string when None."""
        lines = "".join(json.dumps(d, default=_json_default) + "\n" for d in self.to_dicts())
        if target is None:
            return lines
        if isinstance(target, str):
            with open(target, "w") as f:
                f.write(lines)
        else:
            target.write(lines)
        return None

    def to_dataframe(self, kind: str | type[Event] | None = None):
        """A pandas DataFrame of the retained records (one row each, columns = fields + "kind").

        Raises:
            ImportError: when pandas is not installed.
        """
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError("EventLog.to_dataframe needs pandas: pip install pandas") from e
        return pd.DataFrame(self.to_dicts(kind))


def _json_default(o: Any) -> Any:
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)
