"""vLLM V1's scheduling policy on cbnb's cache manager (torch-free): `scheduler_type="vllm"`.

What it follows (facts read in vLLM's `vllm/v1/core/sched/scheduler.py` and `vllm/v1/core/kv_cache_manager.py`,
main branch, December 2026; no code taken):

- **Running first**: every running request (admitted earlier, in admission order, unfinished prompt chunks included)
  gets its next tokens (one for a decode, `min(left of its prompt, token budget left)` for a chunk) before any waiting
  request is looked at. vLLM has no decode or prefill phase: a request's computed tokens catch up with its tokens.
- **Token budget** = `max_num_batched_tokens` (cbnb's `max_batch_tokens`) query tokens per step, chunked prefill on.
- **`max_num_seqs`** (cbnb's `max_requests_per_batch`) caps the *running* requests: a waiting request is admitted only
  while fewer are running.
- **Recompute preemption**: when a running request cannot get a block, the newest running request is preempted: its
  blocks are freed (full ones stay in the prefix cache), its computed tokens reset to 0, and it goes to the *front*
  of the waiting queue; allocation is retried until it succeeds or the request would have to preempt itself. A step
  that preempted admits no waiting request.
- **Waiting requests** in strict FCFS order: the first one that does not fit (blocks, budget, `max_num_seqs`) stops
  admission for the step; nothing behind it is admitted (cbnb's transformers-style FIFO skips it and tries smaller
  ones).
- **Watermark** (vLLM's `--watermark`, default 0.0 in its `KVCacheManager`): a waiting or preempted request is admitted
  only if its new blocks leave `watermark x num_blocks` blocks free, checked only when some request is already in the
  step. Here it is `safety_margin` (default 0.0 for this scheduler); vLLM's exporter writes it as `--watermark`.
- **Prefix caching**: a waiting request with nothing computed looks up its full blocks (the last token is always
  recomputed, as vLLM's `max_cache_hit_length = num_tokens - 1`); a preempted one looks up its prompt and generated
  tokens again. vLLM evicts cached blocks least recently freed first, a finished request's tail first: cbnb's
  `prefix_eviction="lru"` (set it with this scheduler for the same eviction order).

Where it departs from vLLM, and why:

- A request whose step is still in flight (async batching, `pending_samples > 0`) is never preempted: its blocks are
  being written. vLLM preempts it and discards the in-flight token.
- A running request alone in the cache that cannot grow is not preempted (it would preempt itself forever): the plan
  reports it stalled and `EngineCore` applies cbnb's fault rule (defragment, or end it "cache_exhausted"). vLLM caps
  a request at `max_model_len` at admission instead.
- No cache-read budget, safety margin or offload back-off (transformers' rules): vLLM has none of them.

Preemptions are `OffloadDecision`s with path "soft_reset" in `BatchPlan.preempted`; `EngineCore` counts them and
hands them on in `StepWork.offloads`, so telemetry shows them as soft resets. Skip reasons: "token_budget",
"request_cap" (`max_num_seqs` running), "no_free_blocks" (with the watermark in the detail when it decided),
"offload_backoff" (a preemption in this step; detail "preempted"), "finishing" (async).
"""

from __future__ import annotations

import bisect
import itertools
from typing import Any, Iterator

from .cache.manager import Shortfall
from .offload import SOFT_RESET, OffloadDecision
from .plan import BatchPlan, QueueTail, SkipReason
from .requests import Request, RequestState
from .scheduler import Scheduler, _Skips

__all__ = ["VLLMScheduler"]

_PENDING = RequestState.PENDING


class VLLMScheduler(Scheduler):
    """vLLM V1's policy: running requests first, recompute preemption of the newest, strict FCFS admission.

    `safety_margin` is vLLM's watermark (a fraction of each layer group's blocks; default 0.0).
    """

    name = "vllm"

    def __init__(self, config: Any, cache: Any) -> None:
        super().__init__(config, cache)
        # Preempted requests, at the front of the waiting queue (most recently preempted first).
        self._front: list[str] = []
        self._watermark = [int(self.safety_margin * a.usable_blocks) for a in cache.allocators]

    # ------------------------------------------------------------------------------------------ queues
    def _take_waiting(self, request_id: str) -> Request | None:
        req = super()._take_waiting(request_id)
        if req is not None and self._front and request_id in self._front:
            self._front.remove(request_id)
        return req

    def _fresh(self) -> Iterator[Request]:
        """Waiting requests not at the front, in queue order."""
        if not self._front:
            return iter(self.waiting.values())
        front = set(self._front)
        return (r for r in self.waiting.values() if r.request_id not in front)

    def _waiting_order(self) -> tuple[list[Request], bool]:
        return [self.waiting[r] for r in self._front] + list(self._fresh()), False

    def active_candidates(self) -> list[Request]:
        """Running requests in admission order (vLLM's `running` list)."""
        return list(self.active.values())

    def _rest(self, head: list[str], waiting: Any, plain: bool, w_idx: int,
              first: Request | None) -> list[str] | QueueTail:
        """`head`, then the waiting queue from position `w_idx` on (the front, then the rest in queue order); compact
        (a `QueueTail` whose holes include the front's log positions) unless `compact_skips` is off."""
        front = self._front
        nf = len(front)
        if w_idx < nf:
            head = list(head) + front[w_idx:]
            w_idx, first = nf, None
        if len(self.waiting) <= w_idx:
            return head
        if not self.compact_skips:
            return list(head) + [r.request_id for r in itertools.islice(self._fresh(), w_idx - nf, None)]
        lo = self._pos[(first or next(self._fresh())).request_id]
        gone = self._gone
        holes = gone[bisect.bisect_left(gone, lo):] + [self._pos[r] for r in front if self._pos[r] >= lo]
        return QueueTail(head, self.queue_log, lo, len(self.queue_log), holes)

    # ------------------------------------------------------------------------------------------ scheduling
    def schedule(self, step_id: int = 0) -> BatchPlan:
        """Plan one step: the running requests, preempting the newest when blocks run out, then waiting ones."""
        plan = self._begin(step_id)
        running = self.active_candidates()  # preemption pops from its end
        skips = _Skips(self, plan, running, (), False)
        n_running = len(running)
        now = self.clock()
        token_left = self.max_batch_tokens
        read = 0
        i = 0
        while i < len(running):
            req = running[i]
            if token_left == 0:
                skips.refuse_all(i, req, False)
                break
            n_out = len(req.output_ids) + req.pending_samples
            if req.pending_samples and req.max_new_tokens is not None and n_out >= req.max_new_tokens:
                skips.add(SkipReason.FINISHING, req.request_id)  # async: its last token is in flight
                i += 1
                continue
            start = req.num_computed
            remaining = len(req.prompt_ids) + n_out - start
            n = remaining if remaining < token_left else token_left
            alloc = None
            if not self._covered(req.request_id, start + n):
                alloc = self._allocate_running(req, start + n, running, i, plan, now)
                if isinstance(alloc, Shortfall):
                    self._refuse_running(skips, req, start + n, alloc, running, i, plan, now)
                    break
            decode = remaining == 1 and n_out > 0
            self._commit(req, start, n, n == remaining, decode, None, alloc, now, plan.scheduled)
            token_left -= n
            read += self._past(start)
            i += 1
        else:
            read += self._admit(plan, skips, n_running, token_left, now)
        plan.cache_read_tokens = read
        return plan

    def _past(self, start: int) -> int:
        cap = self._read_cap
        return start if cap is None or start < cap else cap

    def _allocate_running(self, req: Request, end: int, running: list[Request], i: int, plan: BatchPlan,
                          now: float) -> Any:
        """Blocks for running request number `i` up to `end`, preempting the newest running requests behind it (not
        in flight) until they fit. Returns the `Allocation`, or the `Shortfall` when nobody is left to preempt."""
        cache = self.cache
        alloc = cache.allocate(req, end, None)
        while isinstance(alloc, Shortfall):
            j = len(running) - 1
            while j > i and running[j].pending_samples:
                j -= 1
            if j == i:
                return alloc
            victim = running.pop(j)
            plan.preempted.append(self._preempt(victim, req, alloc, now))
            alloc = cache.allocate(req, end, None)
        return alloc

    def _refuse_running(self, skips: _Skips, req: Request, end: int, short: Shortfall, running: list[Request],
                        i: int, plan: BatchPlan, now: float) -> None:
        """Running request number `i` cannot grow and nobody behind it can be preempted: vLLM preempts the request
        itself. With its step in flight it just waits; alone in the cache it is stalled instead, for the core's
        fault rule. Nothing after it runs this step."""
        if req.pending_samples:
            skips.add(SkipReason.NO_FREE_BLOCKS, req.request_id, needed_blocks=tuple(short.needed),
                      available_blocks=tuple(short.available))
        elif not plan.scheduled and len(self.active) == 1:
            skips.no_blocks(req, end, short, False)
        else:
            running.pop(i)
            plan.preempted.append(self._preempt(req, req, short, now))
            i -= 1
        rest = running[i + 1:]
        for r in rest:
            skips.add(SkipReason.NO_FREE_BLOCKS, r.request_id, needed_blocks=tuple(short.needed),
                      available_blocks=tuple(short.available))
        skips.rest(SkipReason.OFFLOAD_BACKOFF if plan.preempted else SkipReason.NO_FREE_BLOCKS, skips.n_active, None,
                   **({"preempted": len(plan.preempted)} if plan.preempted else
                      {"needed_blocks": tuple(short.needed), "available_blocks": tuple(short.available)}))

    def _preempt(self, victim: Request, for_req: Request, short: Shortfall, now: float) -> OffloadDecision:
        """vLLM's recompute preemption: free the victim's blocks, reset its progress, queue it at the front."""
        freed = sum(self.cache.exclusive_blocks(victim))
        d = OffloadDecision(victim, SOFT_RESET,
                            f"preempted: {for_req.request_id} needs {sum(short.needed)} blocks, "
                            f"{min(short.available)} obtainable", freed, victim.num_computed)
        self.cache.release(victim)
        victim.num_computed = 0
        victim.num_soft_resets += 1
        victim.transition(_PENDING, now)
        self.add_waiting(victim)
        self._front.insert(0, victim.request_id)
        return d

    def _admit(self, plan: BatchPlan, skips: _Skips, n_running: int, token_left: int, now: float) -> int:
        """Admit waiting requests in FCFS order until one does not fit; returns the past tokens they read."""
        if plan.preempted:  # vLLM admits nothing in a step that preempted
            skips.rest(SkipReason.OFFLOAD_BACKOFF, n_running, None, preempted=len(plan.preempted))
            return 0
        cache = self.cache
        admitted: list[str] = []
        running = len(self.active)
        read = 0
        waiting_c = itertools.chain([self.waiting[r] for r in self._front], self._fresh())
        for w, req in enumerate(waiting_c):
            idx = n_running + w
            if token_left == 0 or running + len(admitted) >= self.max_requests:
                skips.refuse_all(idx, req, token_left != 0)
                break
            match = cache.match_prefix(req) if req.num_computed == 0 else None
            start = match.num_tokens if match is not None else req.num_computed
            remaining = len(req.prompt_ids) + len(req.output_ids) - start
            n = remaining if remaining < token_left else token_left
            alloc = self._watermark_short(req, start + n, match) if plan.scheduled else None
            if alloc is None:
                alloc = cache.allocate(req, start + n, match)
            if isinstance(alloc, Shortfall):
                detail = {"needed_blocks": tuple(alloc.needed), "available_blocks": tuple(alloc.available)}
                if plan.scheduled and any(self._watermark):
                    detail["watermark_blocks"] = tuple(self._watermark)
                skips.rest(SkipReason.NO_FREE_BLOCKS, idx, req, **detail)
                break
            decode = remaining == 1 and len(req.output_ids) > 0 and not req.swapped
            self._commit(req, start, n, n == remaining, decode, match, alloc, now, plan.scheduled)
            admitted.append(req.request_id)
            token_left -= n
            read += self._past(start)
        for rid in admitted:
            self.active[rid] = self._take_waiting(rid)
        return read

    def _watermark_short(self, req: Request, end: int, match: Any) -> Shortfall | None:
        """A `Shortfall` when admitting the request would leave fewer than the watermark's blocks free (None: it
        may try)."""
        if not any(self._watermark):
            return None
        cache = self.cache
        needed = cache.blocks_needed(req, end, match)
        avail = [cache.obtainable_blocks(g) for g in range(len(needed))]
        if all(n + w <= a for n, w, a in zip(needed, self._watermark, avail)):
            return None
        return Shortfall([n + w for n, w in zip(needed, self._watermark)], avail)
