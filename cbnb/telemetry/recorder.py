"""`Recorder`: turns the core's decisions and a runner's step results into events and run statistics (torch-free).

Every driver of `EngineCore` records through one `Recorder`: the threaded `cbnb.Engine` (a model runner) and the
simulator (a cost model), so the same plans give the same events and the same figures. It owns

- `events`, the `EventLog` (typed records of `cbnb.telemetry.events`; only when `enabled`);
- `run` and `total`, two `RunStats`: this run (since `reset_run()`) and cumulative (always kept).

Telemetry observes; it never decides. The loop calls the core (`core.add`, `core.schedule`, `core.apply`); the
recorder hears what the core decided, and never calls back into it:

- as the core's observer (`attach` subscribes it: ``core.observer``): `request_added` (RequestAdded, before
  anything the admission caused), `request_warned` (RequestWarning: the request can never fit the cache),
  `schedule_started` / `step_planned` (the StepPlanned record, placed before the cache events the scheduling
  produced);
- as the cache manager's `sink` (None when telemetry is off, which costs nothing): block events, each carrying what
  it records (the shared blocks' refcounts included);
- from the loop, with what a step produced: `step_done(...)` once a step's tokens are applied (stats, prefix hits,
  offloads, restores, transitions, CUDA-graph captures, StepTiming, KV usage samples), `request_done(req)` from the
  core's terminal callback;
- `flush()` once per loop turn: the turn's events go to the log in one batch. Per-step records travel in that batch,
  never in shared fields that an overlapped step could overwrite.

Times come from `clock` (`time.perf_counter` seconds by default; a simulator passes its virtual clock).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from ..core.cache.snapshot import kv_usage
from .events import (BlocksAllocated, BlocksDeduplicated, BlocksDemoted, BlocksFreed, BlocksShared, CudaGraph, Event,
                     EventLog, Offload, PrefixHit, RequestAdded, RequestDone, RequestWarning, Restore, RunStarted,
                     StateChange, StepPlanned, StepTiming)
from ..core.plan import QueueTail, StepResult, StepWork
from ..core.requests import Request
from .stats import RunStats

__all__ = ["Recorder", "KV_SAMPLE_S"]

#: Seconds between two KV usage samples taken after steps.
KV_SAMPLE_S = 0.2


def _ids(ids):
    # A `QueueTail` is immutable and O(1) to keep; a list is copied (the plan's own list stays the scheduler's).
    return ids if isinstance(ids, QueueTail) else list(ids)


class Recorder:
    """Events and statistics of one engine (see the module docstring).

    Args:
        enabled: record typed events and KV usage samples; off, only the counters and latencies of the stats.
        event_log_size: events retained by `events` (oldest dropped first).
        clock: the time source (seconds).
    """

    def __init__(self, enabled: bool = True, event_log_size: int = 100_000,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.enabled = bool(enabled)
        self.events = EventLog(event_log_size)
        self.run = RunStats()
        self.total = RunStats()
        self.clock = clock
        self.pending: list[Event] = []
        self.core: Any = None
        self.cache: Any = None
        self.step = 0  # the step number events are stamped with (the last planned)
        self._mark = 0  # where this step's StepPlanned goes in `pending`
        self._emitted: dict[str, int] = {}  # request id -> transitions already announced
        self._kv_sample_t = float("-inf")

    def attach(self, core: Any, cache: Any) -> None:
        """Subscribe to this core's decisions (after every (re)build; the cache's events come through `sink`);
        `detach()` unsubscribes."""
        if self.core is not None and self.core.observer is self:
            self.core.observer = None
        self.core, self.cache = core, cache
        core.observer = self
        self.step = core.step_id

    def detach(self) -> None:
        if self.core is not None and self.core.observer is self:
            self.core.observer = None
        self.core = self.cache = None

    @property
    def sink(self) -> Callable[..., None] | None:
        """The `CacheManager` sink: its cache events become records (None when telemetry is off)."""
        return self._cache_event if self.enabled else None

    def flush(self) -> None:
        """Append this turn's records to the log in one batch."""
        if self.pending:
            batch, self.pending = self.pending, []
            self.events.extend(batch)

    def reset_run(self) -> None:
        """Start a new run for `run` (the cumulative figures keep counting). The run's KV samples start with its own
        first step (so two runs of one workload sample at the same offsets, e.g. a simulation's repeats)."""
        self.run = RunStats()
        self._kv_sample_t = float("-inf")

    def mark_run(self, cause: str, label: str = "", *, before: dict[str, Any] | None = None,
                 after: dict[str, Any] | None = None) -> None:
        """Record a `RunStarted` marker (any thread: it goes to the log at once, after the steps already there);
        `before` / `after`: a reconfigure's config values (field name -> value)."""
        if self.enabled:
            self.events.append(RunStarted(self._step_id(), self.clock(), cause, label, dict(before or {}),
                                          dict(after or {})))

    def _step_id(self) -> int:
        return self.step

    # ------------------------------------------------------------------------------------------ requests
    def request_added(self, req: Request, resume: bool) -> None:
        """The core took a request (a resumed one, carried over a reconfigure, was announced already)."""
        if self.enabled and not resume:
            self.pending.append(RequestAdded(self.step, self.clock(), req.request_id, len(req.prompt_ids),
                                             req.max_new_tokens, tuple(req.sampling.describe())))

    def request_warned(self, req: Request) -> None:
        """The core gave a request a warning at admission (it can never fit the cache)."""
        if self.enabled:
            self.pending.append(RequestWarning(self.step, self.clock(), req.request_id, "exceeds_cache",
                                               req.warning))

    def request_done(self, req: Request) -> None:
        """A request reached a terminal state (the core's `on_terminal`)."""
        self.run.on_done(req)
        self.total.on_done(req)
        if self.enabled:
            self._transitions(req, final=True)
            tm = req.timings
            self.pending.append(RequestDone(
                self._step_id(), self.clock(), req.request_id, req.state.name, len(req.output_ids), req.error,
                finish_reason=req.finish_reason, ttft_s=tm.ttft_s, e2e_s=tm.e2e_s, queue_s=tm.queue_s,
                prefix_cached_tokens=req.prefix_cached_tokens, num_offloads=req.num_offloads,
                num_soft_resets=req.num_soft_resets))
        self._emitted.pop(req.request_id, None)

    def requests_refused(self, n: int) -> None:
        """`n` submissions ended CANCELLED before they were admitted (the engine stopped): counted, not logged
        (the log never announced them)."""
        for stats in (self.run, self.total):
            stats.done["CANCELLED"] += n

    def _transitions(self, req: Request, final: bool = False) -> None:
        if req.is_terminal and not final:
            return  # `request_done` announced all of its transitions already
        n = self._emitted.get(req.request_id, 1)  # the initial PENDING is announced by RequestAdded
        tr = req.transitions
        if len(tr) <= n:
            return
        step, now = self._step_id(), self.clock()
        for i in range(n, len(tr)):
            self.pending.append(StateChange(step, now, req.request_id, tr[i - 1][0].name, tr[i][0].name, tr[i][1]))
        self._emitted[req.request_id] = len(tr)

    # ------------------------------------------------------------------------------------------ steps
    def schedule_started(self, step_id: int) -> None:
        """The core began planning step `step_id`: its StepPlanned goes before the cache events that follow."""
        self.step = step_id
        self._mark = len(self.pending)

    def step_planned(self, work: StepWork) -> None:
        """The core planned a step: its StepPlanned record."""
        if self.enabled:
            p = work.plan
            self.pending.insert(self._mark, StepPlanned(
                work.step_id, work.t0, p.scheduler,
                [(s.request_id, s.phase, s.num_tokens, s.start, s.prefix_hit_tokens) for s in p.scheduled],
                [(k.reason.value, _ids(k.request_ids), dict(k.detail)) for k in p.skipped],
                [(st.request_id, list(st.blocks_needed), list(st.blocks_available)) for st in p.stalled],
                p.token_budget, p.num_tokens, p.num_prefill_tokens, p.num_decode_tokens, p.cache_budget,
                p.cache_read_tokens, p.request_cap, len(p.scheduled), p.free_fraction, p.safety_margin,
                list(work.shared_tokens),
            ))

    def step_done(self, work: StepWork, result: StepResult, t0: float, t1: float, t2: float) -> None:
        """A step whose tokens were applied: it ran over [t0, t1] and its update took [t1, t2] (seconds)."""
        timings = dict(result.timings)
        timings["schedule"] = work.schedule_s
        timings["update"] = t2 - t1
        for st in (self.run, self.total):
            st.on_step(work.plan, work.offloads, len(work.restores), timings, t0, t2, result.graph_counts)
        if not self.enabled:
            return
        ev, step = self.pending, work.step_id
        for s in work.plan.scheduled:
            if s.prefix_hit_tokens:
                blocks = s.allocation.prefix.blocks if s.allocation and s.allocation.prefix else []
                ev.append(PrefixHit(step, t0, s.request_id, s.prefix_hit_tokens, list(blocks),
                                    len(s.request.prompt_ids)))
            self._transitions(s.request)
        for d in work.offloads:
            ev.append(Offload(step, t0, d.request.request_id, d.path, d.reason, d.blocks_freed,
                              d.tokens_to_recompute))
            self._transitions(d.request)
        for req, pairs in work.restores:
            ev.append(Restore(step, t0, req.request_id, sum(len(p) for p in pairs)))
        for r in work.failed:
            self._transitions(r)
        ev.append(StepTiming(step, t2, work.schedule_s, timings.get("offload_copy", 0.0), timings.get("prepare", 0.0),
                             timings.get("forward", 0.0), timings.get("sample", 0.0), t2 - t1,
                             work.plan.num_tokens, len(work.plan.scheduled), result.backend))
        for key in result.graph_captured or ():
            ev.append(CudaGraph(step, t2, "capture", tuple(key)))
        for key, err in result.graph_failed or ():
            ev.append(CudaGraph(step, t2, "capture_failed", tuple(key), err))
        if t2 - self._kv_sample_t >= KV_SAMPLE_S:
            self._kv_sample_t = t2
            usage = self.kv_usage()
            self.run.on_kv(usage)
            self.total.on_kv(usage)

    # ------------------------------------------------------------------------------------------ figures
    def kv_usage(self) -> dict[str, float]:
        """`cbnb.core.cache.snapshot.kv_usage` of the attached cache now."""
        return kv_usage(self.cache, {r.request_id: r.num_computed for r in self.core.requests.values()})

    def summary(self) -> dict[str, Any]:
        """{"run": ..., "cumulative": ...} (`RunStats.summary()`), with the KV usage of this moment when enabled, and
        "clock_s": the recorder's clock now (the seconds every time in the figures is measured in: perf_counter
        seconds for `cbnb.Engine`, simulated seconds for `cbnb.sim.SimEngine`)."""
        if self.enabled and self.cache is not None:
            usage = self.kv_usage()
            self.run.kv_last = dict(usage)
            self.total.kv_last = dict(usage)
        return {"run": self.run.summary(), "cumulative": self.total.summary(), "clock_s": self.clock()}

    # ------------------------------------------------------------------------------------------ cache events
    def _cache_event(self, kind: str, **kw: Any) -> None:
        step, t = self._step_id(), self.clock()
        ev = self.pending
        rid = kw.get("request_id", "")
        if kind == "blocks_allocated":
            if any(kw["new_blocks"]):
                ev.append(BlocksAllocated(step, t, rid, kw["new_blocks"], kw["demoted"]))
            for g, dem in enumerate(kw["demoted"]):
                if dem:
                    ev.append(BlocksDemoted(step, t, g, list(dem)))
            if kw["shared"]:
                ev.append(BlocksShared(step, t, rid, list(kw["shared"]), list(kw["refcounts"])))
        elif kind == "blocks_freed":
            ev.append(BlocksFreed(step, t, rid, [list(f) for f, _ in kw["per_group"]],
                                  [list(c) for _, c in kw["per_group"]]))
        elif kind == "blocks_deduplicated":
            ev.append(BlocksDeduplicated(step, t, rid, list(kw["pairs"])))
