"""Schedulers: which requests run in the next step, how many query tokens each, and why the others wait.

Both schedulers follow transformers' `Scheduler._process_candidates` (transformers 5.24,
`generation/continuous_batching/scheduler.py`):

- **Candidates**: FIFO takes active DECODING requests, then active PREFILLING ones (split prefills), then waiting
  requests in arrival order (requests re-queued by an offload interleaved with fresh ones, offloaded first).
  PrefillFirst takes active PREFILLING requests first, then DECODING, then waiting.
- **Token budget** = `max_batch_tokens` query tokens per step; a long prompt takes what is left and the rest of it
  is carried to later steps (chunked prefill).
- **Cache budget** = the cache's capacity in tokens (transformers' `max_tokens_read`): the past tokens read by the
  whole step; with prefix sharing several requests may read the same blocks, so it can bind.
- **Request cap** = `max_requests_per_batch`.
- **Safety margin**: when the free share of the cache is below `safety_margin`, once one request is in the step
  no new or split prefill is admitted; decodes go on.
- **Admission** is all-or-nothing across allocators; a waiting request that does not fit is skipped and later,
  smaller ones may still get in (transformers' order, not strict FIFO). An *active* request that cannot get its next
  blocks is *stalled*: the plan lists it with the blocks it needs, for the offload policy.
- **Stalled requests first** (cbnb, not transformers): once an active request is stalled in a pass, no waiting
  request is admitted behind it (reason "stalled_ahead"), and a stalled *prefill chunk* of a single-group model
  takes the part of the chunk that fits instead of stalling whole. transformers admits newcomers there, which
  deepens the stall and makes the stalled request the next offload victim.
- **Offload back-off**: after an offload, no waiting request is admitted until some request ends (transformers'
  `block_new_requests`), so a freed block is not taken by a newcomer and the victim does not ping-pong.

The result is a `BatchPlan` (`cbnb.core.plan`, re-exported here): plain data that also names every request not taken,
with the reason and the numbers that decided it. This module is torch-free.

**Skips at scale.** Some reasons, once they refuse one waiting request, refuse every later one in the same pass
with the same numbers: the request cap and the token budget (nothing is left), the offload back-off, a stalled
request ahead, and the safety margin (waiting requests are never decodes). The scheduler then records the whole
rest of the waiting queue in one entry, a `cbnb.core.plan.QueueTail` over its append-only `queue_log`, instead of
visiting each request, so a step costs O(active + visited waiting + distinct reasons), not O(waiting). The entry
expands to exactly the ids the per-request loop would have listed (`compact_skips = False` runs that loop; a test
checks both agree); `BatchPlan.skipped_requests()` yields every (request id, reason). While requests re-queued by an
offload wait (their order interleaves with fresh ones), the rest is listed explicitly.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import OrderedDict
from typing import Any, Collection

from .cache.manager import Allocation, CacheManager, Shortfall
from .config import ContinuousBatchingConfig
from .plan import BatchPlan, QueueTail, ScheduledRequest, SkippedRequests, SkipReason, StalledRequest
from .requests import Request, RequestState

__all__ = [
    "SkipReason", "ScheduledRequest", "SkippedRequests", "QueueTail", "StalledRequest", "BatchPlan",
    "Scheduler", "FIFOScheduler", "PrefillFirstScheduler",
]


_PENDING = RequestState.PENDING
_PREFILLING = RequestState.PREFILLING
_DECODING = RequestState.DECODING


class Scheduler:
    """Shared machinery; subclasses define the candidate order.

    Args:
        config: a resolved `ContinuousBatchingConfig` (max_batch_tokens, max_requests_per_batch and safety_margin
            set).
        cache: the `CacheManager`.
    """

    name = "base"
    #: Record a reason that covers the rest of the waiting queue as one `QueueTail` entry (see the module
    #: docstring); False: visit and list every waiting request (the reference the compact form is tested against).
    compact_skips = True

    def __init__(self, config: ContinuousBatchingConfig, cache: CacheManager) -> None:
        if config.max_batch_tokens is None or config.max_requests_per_batch is None:
            raise ValueError("Scheduler needs a resolved config (call ContinuousBatchingConfig.resolve())")
        self.max_batch_tokens = int(config.max_batch_tokens)
        self.max_requests = int(config.max_requests_per_batch)
        self.safety_margin = config.effective_safety_margin
        self.cache = cache
        self.waiting: OrderedDict[str, Request] = OrderedDict()
        self.active: OrderedDict[str, Request] = OrderedDict()
        self.block_new_requests = False
        self.clock = time.perf_counter  # time stamps of state changes (the core sets its own clock)
        sliding_cap = cache.layout.max_window
        self._read_cap = (sliding_cap - 1) if sliding_cap else None
        # With one layer group, "does the table already cover the chunk?" is one length check (`_covered`).
        self._single = cache.allocators[0] if len(cache.allocators) == 1 else None
        self._single_tables = self._single.tables if self._single is not None else None
        self._single_window = getattr(self._single, "window", None)
        self._page = cache.page_size
        self.queue_log: list[str] = []  # every queueing, in order (the log `QueueTail`s read); append-only
        self._pos: dict[str, int] = {}  # waiting request id -> its position in queue_log
        self._gone: list[int] = []  # sorted positions taken out of the queue (none below the oldest waiting one)
        self._requeued: set[str] = set()  # waiting requests that were offloaded or soft-reset before

    # ------------------------------------------------------------------------------------------ queues
    def add_waiting(self, req: Request) -> None:
        """Queue a request at the back of the waiting order."""
        rid = req.request_id
        self.active.pop(rid, None)
        if rid in self.waiting:  # already queued: it keeps its place
            self.waiting[rid] = req
            return
        self.waiting[rid] = req
        self._pos[rid] = len(self.queue_log)
        self.queue_log.append(rid)
        if req.num_offloads or req.num_soft_resets:
            self._requeued.add(rid)

    def _take_waiting(self, request_id: str) -> Request | None:
        req = self.waiting.pop(request_id, None)
        if req is not None:
            bisect.insort(self._gone, self._pos.pop(request_id))
            self._requeued.discard(request_id)
        return req

    def remove(self, request_id: str) -> Request | None:
        """Forget a request (finished, failed, cancelled). An active request leaving ends an offload back-off."""
        req = self.active.pop(request_id, None)
        if req is not None:
            self.block_new_requests = False
            return req
        return self._take_waiting(request_id)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.active)

    def _waiting_order(self) -> tuple[Collection[Request], bool]:
        """(waiting candidates in order, whether that is the queue's own order): requests re-queued by an offload
        interleaved with fresh ones, re-queued first (transformers' order), else the queue as it is."""
        if not self._requeued:
            return self.waiting.values(), True
        requeued = [r for r in self.waiting.values() if r.request_id in self._requeued]
        fresh = [r for r in self.waiting.values() if r.request_id not in self._requeued]
        out: list[Request] = []
        for i in range(max(len(requeued), len(fresh))):
            if i < len(requeued):
                out.append(requeued[i])
            if i < len(fresh):
                out.append(fresh[i])
        return out, False

    def active_candidates(self) -> list[Request]:
        """Active candidates in order."""
        raise NotImplementedError

    def candidates(self) -> tuple[list[Request], list[Request]]:
        """(active candidates in order, waiting candidates in order)."""
        return self.active_candidates(), list(self._waiting_order()[0])

    def _rest(self, head: list[str], waiting: Collection[Request], plain: bool, w_idx: int,
              first: Request | None) -> list[str] | QueueTail:
        """`head`, then the ids of the waiting candidates from position `w_idx` on, `first` being that candidate (None:
        the rest is every waiting candidate); none of them visited yet in this pass."""
        count = len(waiting) - w_idx
        if count <= 0:
            return head
        if self.compact_skips and plain:
            log = self.queue_log
            lo = self._pos[(first or next(iter(waiting))).request_id]
            gone = self._gone
            holes = gone[bisect.bisect_left(gone, lo):]  # every position in [lo, len(log)) not waiting
            if len(holes) <= count:  # else a long explicit list is the smaller record
                return QueueTail(head, log, lo, len(log), holes)
        rest = waiting if isinstance(waiting, list) else list(waiting)
        return head + [r.request_id for r in rest[w_idx:]]

    # ------------------------------------------------------------------------------------------ scheduling
    def schedule(self, step_id: int = 0) -> BatchPlan:
        """Plan one step. Admitted requests move to the active set and their blocks are allocated."""
        cache = self.cache
        plan = self._begin(step_id)
        free, margin = plan.free_fraction, plan.safety_margin
        below = free < margin
        active_c = self.active_candidates()
        waiting_c, plain = self._waiting_order()
        skips = _Skips(self, plan, active_c, waiting_c, plain)
        backoff = self.block_new_requests and bool(self.active)
        token_left, cache_left, req_left = self.max_batch_tokens, cache.capacity_tokens, self.max_requests
        read_cap = self._read_cap
        now = self.clock()
        admitted: list[str] = []
        for idx, req in enumerate(itertools.chain(active_c, waiting_c)):
            if req_left == 0 or token_left == 0:  # everything from here on is refused for the same reason
                skips.refuse_all(idx, req, req_left == 0)
                break
            waiting = req.state is _PENDING
            # Backoff and a stalled request ahead refuse every later waiting candidate too (none is a decode).
            if waiting and backoff:
                if skips.refuse(SkipReason.OFFLOAD_BACKOFF, idx, req, True):
                    break
                continue
            if waiting and plan.stalled:  # the free blocks are owed to the stalled active requests ahead
                if skips.refuse(SkipReason.STALLED_AHEAD, idx, req, True, stalled=len(plan.stalled)):
                    break
                continue
            n_out = len(req.output_ids) + req.pending_samples
            if req.pending_samples and req.max_new_tokens is not None and n_out >= req.max_new_tokens:
                skips.add(SkipReason.FINISHING, req.request_id)  # async: its last token is in flight
                continue
            num_tokens = len(req.prompt_ids) + n_out
            computed = req.num_computed
            decode = num_tokens - computed == 1 and n_out > 0 and not req.swapped  # `Request.is_decode`, inlined
            if below and plan.scheduled and not decode:
                if skips.refuse(SkipReason.SAFETY_MARGIN, idx, req, waiting, safety_margin=margin,
                                free_fraction=round(free, 6)):
                    break
                continue
            match = cache.match_prefix(req) if (waiting and computed == 0) else None
            start = match.num_tokens if match is not None else computed
            remaining = num_tokens - start
            n = remaining if remaining < token_left else token_left
            need_read = start if read_cap is None or start < read_cap else read_cap
            if need_read > cache_left:
                skips.add(SkipReason.CACHE_BUDGET, req.request_id, need_tokens=need_read, left_tokens=cache_left,
                          budget_tokens=cache.capacity_tokens)
                continue
            alloc = None
            if waiting or not self._covered(req.request_id, start + n):
                n, alloc = self._allocate(req, start, n, match, waiting, decode)
                if isinstance(alloc, Shortfall):
                    skips.no_blocks(req, start + n, alloc, waiting)
                    continue
            self._commit(req, start, n, n == remaining, decode, match, alloc, now, plan.scheduled)
            if waiting:
                admitted.append(req.request_id)
            token_left -= n
            cache_left -= need_read
            req_left -= 1
        for rid in admitted:
            self.active[rid] = self._take_waiting(rid)
        plan.cache_read_tokens = cache.capacity_tokens - cache_left
        return plan

    def _begin(self, step_id: int) -> BatchPlan:
        """Start a pass: settle the cache's deferred releases, forget queue positions no tail can reach, and open the
        plan with this step's budgets and free share."""
        cache = self.cache
        cache.flush_host_releases()
        cache.release_empty_sectors()
        if self._gone:  # positions below the oldest waiting request are no tail's business any more
            oldest = self._pos[next(iter(self.waiting))] if self.waiting else len(self.queue_log)
            k = bisect.bisect_left(self._gone, oldest)
            if k:
                del self._gone[:k]
        return BatchPlan(step_id, self.name, token_budget=self.max_batch_tokens, cache_budget=cache.capacity_tokens,
                         request_cap=self.max_requests, free_fraction=cache.free_fraction(),
                         safety_margin=self.safety_margin)

    def _covered(self, rid: str, end: int) -> bool:
        """Whether the request's tables already hold tokens [0, end) in every layer group (no allocation needed)."""
        tables = self._single_tables
        if tables is not None:  # hot path: one layer group, one length check
            t = tables.get(rid)
            window = self._single_window
            return (len(t) if t else 0) * self._page >= (end if window is None or end < window else window)
        return all(a.covers(rid, end) for a in self.cache.allocators)

    def _allocate(self, req: Request, start: int, n: int, match: Any, waiting: bool,
                  decode: bool) -> tuple[int, Allocation | Shortfall]:
        """Blocks for tokens [start, start + n): (query tokens granted, the `Allocation`, or the `Shortfall` when
        none fit). A split prefill of a single-group model that does not fit whole takes the part that fits."""
        cache = self.cache
        end = start + n
        alloc = cache.allocate(req, end, match)
        single = self._single
        if isinstance(alloc, Shortfall) and not waiting and not decode and single is not None:
            fit = self._fitting_end(single, req.request_id, start, end)
            if fit > start:
                end = fit
                alloc = cache.allocate(req, end, None)
        return end - start, alloc

    def _commit(self, req: Request, start: int, n: int, samples: bool, decode: bool, match: Any,
                alloc: Allocation | None, now: float, scheduled: list[ScheduledRequest]) -> None:
        """Take `n` query tokens of the request from `start` into the step: advance it, stamp its state change and
        append its `ScheduledRequest`."""
        hit = 0
        if match is not None:
            hit = match.num_tokens
            # Per admission, not summed: a request re-admitted after a soft reset or a reconfigure matches its prompt
            # again (and may match its own generated tokens); only its prompt tokens count.
            plen = len(req.prompt_ids)
            req.prefix_cached_tokens = hit if hit < plen else plen
        if req.swapped:
            req.swapped = False
        req.num_computed = start + n
        state = req.state
        if samples:
            req.pending_samples += 1
            if state is not _DECODING:
                req.transition(_DECODING, now)
        elif state is not _PREFILLING:
            req.transition(_PREFILLING, now)
        scheduled.append(ScheduledRequest(req, start, n, "decode" if decode else "prefill", samples, hit, alloc))

    def _fitting_end(self, alloc: Any, rid: str, start: int, end: int) -> int:
        """The largest chunk end in (start, end] whose blocks the single layer group can obtain now."""
        table = alloc.tables.get(rid) or ()
        blocks = len(table) + self.cache.obtainable_blocks(alloc.index)
        cap = blocks * self.cache.page_size
        window = getattr(alloc, "window", None)
        if window is not None and cap >= window:
            return end
        return min(end, cap)


class _Skips:
    """The skip entries of one scheduling pass: one `SkippedRequests` per (reason, numbers), in first-seen order.

    A reason that refuses a waiting candidate for what holds for every later one in the pass is recorded, with
    `Scheduler.compact_skips`, as one entry over the rest of the waiting queue (`Scheduler._rest`) and ends the pass.
    """

    __slots__ = ("sched", "plan", "entries", "active_c", "waiting_c", "plain", "n_active", "compact")

    def __init__(self, sched: Scheduler, plan: BatchPlan, active_c: list[Request], waiting_c: Collection[Request],
                 plain: bool) -> None:
        self.sched, self.plan = sched, plan
        self.entries: dict[tuple, SkippedRequests] = {}
        self.active_c, self.waiting_c, self.plain = active_c, waiting_c, plain
        self.n_active = len(active_c)
        self.compact = sched.compact_skips

    def add(self, reason: SkipReason, rid: str, **detail: Any) -> None:
        """List one request under `reason` with these numbers."""
        key = (reason, tuple(sorted(detail.items())))
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = SkippedRequests(reason, [], detail)
            self.plan.skipped.append(entry)
        entry.request_ids.append(rid)

    def refuse(self, reason: SkipReason, idx: int, req: Request, waiting: bool, **detail: Any) -> bool:
        """Refuse candidate number `idx`. Returns True when the entry covers every later candidate too (a waiting
        one, with compact skips): the pass ends there."""
        if not (self.compact and waiting):
            self.add(reason, req.request_id, **detail)
            return False
        self.rest(reason, idx, req, **detail)
        return True

    def rest(self, reason: SkipReason, idx: int, req: Request | None, **detail: Any) -> None:
        """Refuse waiting candidate number `idx` (`req`; None: the first waiting one) and every later one."""
        key = (reason, tuple(sorted(detail.items())))
        entry = self.entries.get(key)
        ids = self.sched._rest(list(entry.request_ids) if entry else [], self.waiting_c, self.plain,
                               idx - self.n_active, req)
        if entry is None:
            entry = self.entries[key] = SkippedRequests(reason, ids, detail)
            self.plan.skipped.append(entry)
        else:
            entry.request_ids = ids

    def refuse_all(self, idx: int, req: Request, cap: bool) -> None:
        """The request cap (`cap`) or the token budget is used up at candidate `idx`: it and every later one."""
        sched = self.sched
        if idx < self.n_active:
            rest = sched._rest([r.request_id for r in self.active_c[idx:]], self.waiting_c, self.plain, 0, None)
        else:
            rest = sched._rest([], self.waiting_c, self.plain, idx - self.n_active, req)
        if cap:
            entry = SkippedRequests(SkipReason.REQUEST_CAP, rest, {"cap": sched.max_requests})
        else:
            entry = SkippedRequests(SkipReason.TOKEN_BUDGET, rest,
                                    {"budget_tokens": sched.max_batch_tokens, "left_tokens": 0})
        self.plan.skipped.append(entry)

    def no_blocks(self, req: Request, end: int, short: Shortfall, waiting: bool) -> None:
        """The request's blocks up to `end` do not fit: an active one is stalled (for the offload policy)."""
        if not waiting:
            self.plan.stalled.append(StalledRequest(req.request_id, end, short.needed, short.available))
        self.add(SkipReason.NO_FREE_BLOCKS, req.request_id, needed_blocks=tuple(short.needed),
                 available_blocks=tuple(short.available))


class FIFOScheduler(Scheduler):
    """Active decodes, then active (split) prefills, then waiting requests in arrival order. Margin 0.15."""

    name = "fifo"

    def active_candidates(self) -> list[Request]:
        dec: list[Request] = []
        pre: list[Request] = []
        for r in self.active.values():
            (dec if r.state is _DECODING else pre).append(r)
        return dec + pre


class PrefillFirstScheduler(Scheduler):
    """Active split prefills first, then decodes, then waiting requests. Margin 0.0."""

    name = "prefill_first"

    def active_candidates(self) -> list[Request]:
        dec: list[Request] = []
        pre: list[Request] = []
        for r in self.active.values():
            (dec if r.state is _DECODING else pre).append(r)
        return pre + dec
