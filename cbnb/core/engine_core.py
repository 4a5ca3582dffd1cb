"""`EngineCore`: the torch-free half of the engine loop.

One step is ``work = core.schedule()`` → the runner copies `work.swap_outs` (device → host), then `work.restores`
(host → device), runs the forward for `work.plan` and samples → ``core.apply(work, tokens)``. That copy order is
required: a restore may target device blocks a swap-out of the same step frees, and the host blocks a restore reads
are only freed at the next `schedule()`, so no swap-out of the same step overwrites them. With async batching the next
``schedule()`` may come before ``apply()`` of the step in flight: requests of an unapplied step (``pending_samples >
0``) are never offloaded, and are not ended for lack of blocks until their step is applied. Everything that decides
(admission, chunking, prefix hits, offloading, finishing, failing) happens here, so it can be driven by a fake runner
in tests, by the simulator's cost model, or by the threaded `cbnb.Engine` with a model runner. The data it hands the
runner (`StepWork`, `BatchPlan`) lives in `cbnb.core.plan`.

Fault rules (where transformers would crash or lose work):

- a prompt that needs more blocks than the whole cache holds is FAILED at submission, with the numbers;
- a request whose prompt + `max_new_tokens` can never fit the cache is admitted with a warning
  (`Request.warning`); if it grows to the whole cache while it is the only request left (no victim to offload), it
  ends FINISHED with finish reason "cache_exhausted", keeping the tokens generated so far, and the engine goes on (a
  lone request that still fits an empty cache, stalled only by fragmentation between layer groups, is swapped out or
  soft-reset and re-admitted instead);
- `fail_batch` fails just the requests of a step whose forward raised;
- cancelling frees blocks at once, in any state, including while swapped out.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Mapping

from .cache.manager import CacheManager
from .config import ContinuousBatchingConfig
from .offload import SOFT_RESET, SWAP, OffloadDecision, choose_defragment, choose_victims
from .plan import StepWork
from .requests import CACHE_EXHAUSTED, Request, RequestState
from .policies import make_scheduler

__all__ = ["EngineCore", "StepWork"]

_FINISHED = RequestState.FINISHED  # states >= FINISHED are terminal


class EngineCore:
    """Requests, scheduler, cache manager and offload policy behind one small API.

    Args:
        config: a resolved `ContinuousBatchingConfig`.
        cache: the `CacheManager`.
        on_terminal: optional callback(request) when a request reaches FINISHED, FAILED or CANCELLED.
        clock: time source (seconds) for the requests' state changes and token times; default
            `time.perf_counter` (the engine's wall clock); the simulator passes its virtual clock.

    Attributes:
        observer: who hears the decisions (`cbnb.telemetry.recorder.Recorder` subscribes here); None: nobody. It is told
            ``request_added(req, resume)`` when a request is taken (before anything it causes),
            ``request_warned(req)`` when a request got a warning at admission, ``schedule_started(step_id)`` before
            a step is planned and ``step_planned(work)`` after. An observer only records: it never calls the core.
    """

    def __init__(self, config: ContinuousBatchingConfig, cache: CacheManager,
                 on_terminal: Callable[[Request], None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config
        self.cache = cache
        self.clock = clock or time.perf_counter
        self.scheduler = make_scheduler(config, cache)
        self.scheduler.clock = self.clock
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self.on_terminal = on_terminal
        self.observer: Any = None
        self.kv_for_runner = True  # build `StepWork.kv` (a simulator's cost model does not need it)
        # fill `StepWork.shared_tokens` (prefix blocks several rows of a step read; the simulator's CPU cost model
        # prices them): off by default, it walks the shared blocks every step (on for a CPU engine, either clock)
        self.measure_shared_reads = False
        self.offload_counts = {SWAP: 0, SOFT_RESET: 0}

    # ------------------------------------------------------------------------------------------ requests
    def add(self, req: Request, *, resume: bool = False) -> bool:
        """Queue a request. Returns False when it ended at once: FAILED (its prompt can never fit the cache) or, for
        a resumed request, FINISHED "cache_exhausted" (its tokens so far no longer fit).

        A request whose prompt + `max_new_tokens` can never fit the cache (or whose `max_new_tokens` is unbounded)
        is queued with `req.warning` saying so; it may end "cache_exhausted" (see the module docstring).

        Args:
            resume: the request was carried over from another core (`Engine.reconfigure`): it may already have
                generated tokens, but must hold no blocks and have no sample in flight; its prompt and generated
                tokens are recomputed in this core's cache.
        """
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        if resume:
            if req.state != RequestState.PENDING or req.num_computed or req.pending_samples or req.swapped:
                raise ValueError(f"request {req.request_id!r} cannot be resumed ({req.state.name}, "
                                 f"{req.num_computed} tokens computed, swapped={req.swapped})")
        elif req.state != RequestState.PENDING or req.num_computed or req.output_ids or req.swapped:
            raise ValueError(f"request {req.request_id!r} is not a fresh request ({req.state.name}, "
                             f"{len(req.output_ids)} tokens generated); submit a new Request")
        obs, had = self.observer, req.warning
        if obs is not None:
            obs.request_added(req, resume)
        try:
            return self._queue(req)
        finally:
            if obs is not None and req.warning is not None and req.warning != had:
                obs.request_warned(req)

    def _queue(self, req: Request) -> bool:
        self.requests[req.request_id] = req
        if not self.cache.fits_empty(req.num_tokens):
            self._exhaust(req)
            return False
        self.scheduler.add_waiting(req)
        limit = req.max_new_tokens
        if req.warning is None and (limit is None or not self.cache.fits_empty(len(req.prompt_ids) + limit)):
            req.warning = self._exceeds(req)
        return True

    def _capacity(self) -> str:
        c = self.cache
        return (f"the KV cache holds at most {c.max_request_tokens()} tokens for one request "
                f"(num_blocks={c.layout.whole_model_blocks(c.num_sectors)}, page_size={c.page_size})")

    def _exceeds(self, req: Request) -> str:
        n, limit = len(req.prompt_ids), req.max_new_tokens
        c = self.cache
        cap = c.max_request_tokens()
        asked = "an unbounded max_new_tokens" if limit is None else f"max_new_tokens={limit} = {n + limit} tokens"
        return (f"exceeds the KV cache: {n} prompt tokens + {asked}, but it holds at most {cap} tokens for one "
                f"request (num_blocks={c.layout.whole_model_blocks(c.num_sectors)}, page_size={c.page_size}); the "
                f"request ends with finish reason '{CACHE_EXHAUSTED}' after at most {cap - n + 1} new tokens")

    def _exhaust(self, req: Request) -> None:
        """End a request that outgrew the whole cache: FAILED when even its prompt does not fit, else FINISHED
        "cache_exhausted" with the tokens generated so far."""
        if not self.cache.fits_empty(len(req.prompt_ids)):
            self._fail(req, f"prompt of {len(req.prompt_ids)} tokens does not fit: {self._capacity()}")
            return
        if req.warning is None:
            req.warning = self._exceeds(req)
        req.finish_reason = CACHE_EXHAUSTED
        self._end(req, RequestState.FINISHED)

    def cancel(self, request_id: str) -> Request | None:
        """Cancel a request in any non-terminal state; its blocks (device and host) are freed at once.

        Returns:
            the cancelled request, or None when it is unknown or already terminal.
        """
        req = self.requests.get(request_id)
        if req is None or req.is_terminal:
            return None
        req.finish_reason = "cancelled"
        self._end(req, RequestState.CANCELLED)
        return req

    def _fail(self, req: Request, error: str) -> None:
        req.error = error
        req.finish_reason = "error"
        self._end(req, RequestState.FAILED)

    def fail(self, request_id: str, error: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None or req.is_terminal:
            return None
        self._fail(req, error)
        return req

    def _end(self, req: Request, state: RequestState) -> None:
        req.pending_samples = 0
        req.transition(state, self.clock())
        self.cache.release(req)
        self.cache.forget(req)
        self.scheduler.remove(req.request_id)
        req.swapped = False
        self.requests.pop(req.request_id, None)
        if self.on_terminal is not None:
            self.on_terminal(req)

    @property
    def has_work(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------------------------------ one step
    def schedule(self) -> StepWork:
        """Plan the next step: schedule, offload if requests stall, fail what can never proceed. The work's `t0` is
        the core's clock when planning began; its `schedule_s` the host seconds planning took."""
        t_start = self.clock()
        t0 = time.perf_counter()
        self.step_id += 1
        if self.observer is not None:
            self.observer.schedule_started(self.step_id)
        plan = self.scheduler.schedule(self.step_id)
        work = StepWork(self.step_id, plan)
        self._take_preempted(plan, work)
        if plan.stalled:
            scheduled = {s.request_id for s in plan.scheduled}
            active = list(self.scheduler.active.values())
            decisions = choose_victims(active, plan.stalled, scheduled, self.cache)
            if not decisions and plan.empty:
                decisions = choose_defragment(active, plan.stalled, self.cache)
            for d in decisions:
                self._offload(d, work)
            if decisions:
                self.scheduler.block_new_requests = True
            if plan.empty and decisions:
                # Nothing ran: schedule again now that blocks are free (transformers does the same).
                work.plan = plan = self.scheduler.schedule(self.step_id)
                self._take_preempted(plan, work)
            if plan.empty and not decisions and not any(r.pending_samples for r in active):
                # No victim: the stalled request is alone and has exhausted the cache. (With async batching, nothing
                # is judged while a step is in flight: its apply() may finish requests and free blocks.)
                for s in plan.stalled:
                    req = self.requests.get(s.request_id)
                    if req is not None and not req.is_terminal:
                        self._exhaust(req)
                        work.failed.append(req)
        if plan.empty and not plan.stalled and not self.scheduler.active and self.scheduler.waiting:
            # Nothing active and nothing admitted: a waiting request that cannot fit an empty cache.
            for req in list(self.scheduler.waiting.values()):
                if not self.cache.fits_empty(req.num_tokens):
                    self._exhaust(req)
                    work.failed.append(req)
        for s in plan.scheduled:
            if s.allocation is not None and s.allocation.restored is not None:
                work.restores.append((s.request, s.allocation.restored))
        if self.kv_for_runner:
            work.kv = self.cache.step_kv(work.plan.scheduled)
        if self.measure_shared_reads:
            work.shared_tokens = self.cache.shared_reads(work.plan.scheduled)
        work.schedule_s = time.perf_counter() - t0
        work.t0 = t_start
        if self.observer is not None:
            self.observer.step_planned(work)
        return work

    def _take_preempted(self, plan: Any, work: StepWork) -> None:
        """Count the requests the scheduler preempted itself (`BatchPlan.preempted`) as this step's offloads."""
        for d in plan.preempted:
            self.offload_counts[d.path] += 1
            work.offloads.append(d)

    def _offload(self, d: OffloadDecision, work: StepWork) -> None:
        req = d.request
        if d.path == SWAP and self.cache.can_swap(req):
            pairs = self.cache.swap_out(req)
            req.swapped = True
            req.num_offloads += 1
            work.swap_outs.append((req, pairs))
        else:
            if d.path == SWAP:
                d.path = SOFT_RESET
                d.tokens_to_recompute = req.num_computed
            self.cache.release(req)
            req.num_computed = 0
            req.num_soft_resets += 1
        self.offload_counts[d.path] += 1
        req.transition(RequestState.PENDING, self.clock())
        self.scheduler.add_waiting(req)
        work.offloads.append(d)

    def apply(self, work: StepWork, tokens: Mapping[str, int], logprobs: Mapping[str, Any] | None = None,
              invalid: Mapping[str, str] | None = None, now: float | None = None) -> list[Request]:
        """Apply a step's sampled tokens (request_id -> token id, for the requests that sampled).

        `now` time-stamps the tokens (default: the core's `clock`, the simulator's virtual time in a simulation).

        Registers completed blocks in the prefix index (also those of a request's final step), appends tokens (with
        their `TokenLogprob` from `logprobs`), finishes requests on EOS / a stop string / max_new_tokens and frees
        their blocks. A request in `invalid` (its logits were not finite) fails with that error; the others go on.

        Returns:
            requests that received a token (finished ones included).
        """
        updated = []
        register = self.cache.register_completed
        lps = logprobs or {}
        now = self.clock() if now is None else now
        for s in work.plan.scheduled:
            req = s.request
            if req.state >= _FINISHED:
                continue  # cancelled or failed while the step ran
            register(req, s.start + s.num_tokens)
            if s.samples:
                tok = tokens.get(req.request_id)
                if tok is None:
                    error = (invalid or {}).get(req.request_id)
                    self._fail(req, error or f"internal error: step {work.step_id} returned no token")
                    continue
                done = req.append_token(int(tok), now, logprob=lps.get(req.request_id))
                updated.append(req)
                if done:
                    self._end(req, RequestState.FINISHED)
        return updated

    def fail_batch(self, work: StepWork, error: BaseException | str) -> list[Request]:
        """Fail the requests of a step whose forward raised; the others go on."""
        msg = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        failed = []
        for s in work.plan.scheduled:
            if not s.request.is_terminal:
                self._fail(s.request, msg)
                failed.append(s.request)
        return failed

    def fail_all(self, error: str, requests: Iterable[Request] | None = None) -> list[Request]:
        reqs = list(self.requests.values()) if requests is None else list(requests)
        for r in reqs:
            if not r.is_terminal:
                self._fail(r, error)
        return reqs

    def take_unfinished(self) -> list[Request]:
        """Release every unfinished request and hand them over, in arrival order, ready for another core's
        ``add(req, resume=True)`` (`Engine.reconfigure`): PENDING, nothing computed, tokens so far kept.

        This core is left empty.
        """
        carry = sorted(self.requests.values(), key=lambda r: r.arrival)
        for req in carry:
            self.cache.release(req)
            self.cache.forget(req)
            self.scheduler.remove(req.request_id)
            if req.state != RequestState.PENDING:
                req.transition(RequestState.PENDING)
            req.num_computed = 0
            req.pending_samples = 0
            req.swapped = False
        self.requests.clear()
        return carry
