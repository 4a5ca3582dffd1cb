"""Schedulers: candidate order, budgets, chunked prefill, safety margin, reasons for every request not taken."""

from __future__ import annotations

import pytest

from cbnb.core.config import ContinuousBatchingConfig
from cbnb.core.requests import Request, RequestState
from cbnb.core.policies import SCHEDULERS, make_scheduler
from cbnb.core.scheduler import (
    FIFOScheduler,
    PrefillFirstScheduler,
    Scheduler,
    SkipReason,
)

from helpers_core import P, add, core_for, ids, reason, step  # noqa: F401 (P: used by the tests)


# ------------------------------------------------------------------------------------------------ construction
def test_make_scheduler() -> None:
    core = core_for()
    assert isinstance(core.scheduler, FIFOScheduler) and core.scheduler.safety_margin == 0.15
    pf = core_for(scheduler_type="prefill_first")
    assert isinstance(pf.scheduler, PrefillFirstScheduler) and pf.scheduler.safety_margin == 0.0
    assert set(SCHEDULERS) == {"fifo", "prefill_first", "vllm"}
    cfg = ContinuousBatchingConfig().resolve()
    object.__setattr__(cfg, "scheduler_type", "lifo")  # bypass validation
    with pytest.raises(ValueError, match="'fifo', 'prefill_first'"):
        make_scheduler(cfg, core.cache)
    with pytest.raises(ValueError, match="resolve"):
        Scheduler(ContinuousBatchingConfig(), core.cache)


# ------------------------------------------------------------------------------------------------ order
def test_fifo_order_decodes_then_split_prefills_then_waiting() -> None:
    core = core_for(max_batch_tokens=8)
    add(core, "a", 3)
    add(core, "b", 20)
    plan = step(core)
    assert ids(plan) == [("a", 0, 3), ("b", 0, 5)]
    assert [s.phase for s in plan.scheduled] == ["prefill", "prefill"]
    assert [s.samples for s in plan.scheduled] == [True, False]
    add(core, "c", 2)
    add(core, "d", 2)
    plan = step(core)
    assert ids(plan) == [("a", 3, 1), ("b", 5, 7)]
    assert plan.scheduled[0].phase == "decode"
    assert reason(plan, "c") == reason(plan, "d") == SkipReason.TOKEN_BUDGET
    active, waiting = core.scheduler.candidates()
    assert [r.request_id for r in active] == ["a", "b"] and [r.request_id for r in waiting] == ["c", "d"]
    plan = step(core)
    assert ids(plan) == [("a", 4, 1), ("b", 12, 7)]
    plan = step(core)  # b's last prompt token, then c and d in arrival order
    assert ids(plan) == [("a", 5, 1), ("b", 19, 1), ("c", 0, 2), ("d", 0, 2)]


def test_prefill_first_order() -> None:
    core = core_for(max_batch_tokens=8, scheduler_type="prefill_first")
    add(core, "a", 3)
    add(core, "b", 20)
    step(core)
    add(core, "c", 2)
    plan = step(core)
    assert ids(plan) == [("b", 5, 8)]  # the split prefill takes the whole budget before the decode
    assert reason(plan, "a") == reason(plan, "c") == SkipReason.TOKEN_BUDGET
    active, waiting = core.scheduler.candidates()
    assert [r.request_id for r in active] == ["b", "a"] and [r.request_id for r in waiting] == ["c"]


def test_chunked_prefill_states_and_samples() -> None:
    core = core_for(max_batch_tokens=8)
    r = add(core, "a", 20, max_new=2)
    states = []
    plans = []
    while core.has_work:
        plans.append(step(core))
        states.append(r.state)
    assert [ids(p) for p in plans] == [[("a", 0, 8)], [("a", 8, 8)], [("a", 16, 4)], [("a", 20, 1)]]
    assert [p.scheduled[0].samples for p in plans] == [False, False, True, True]
    assert states == [RequestState.PREFILLING, RequestState.PREFILLING, RequestState.DECODING,
                      RequestState.FINISHED]
    assert [s for s, _ in r.transitions] == [RequestState.PENDING, RequestState.PREFILLING, RequestState.DECODING,
                                            RequestState.FINISHED]
    assert r.output_ids == [5, 5] and r.finish_reason == "length"


def test_whole_prompt_in_one_step_goes_straight_to_decoding() -> None:
    core = core_for()
    r = add(core, "a", 10)
    work = core.schedule()
    assert r.state == RequestState.DECODING and r.pending_samples == 1  # before the forward, as in transformers
    assert [s for s, _ in r.transitions] == [RequestState.PENDING, RequestState.DECODING]
    core.apply(work, {"a": 5})
    assert r.pending_samples == 0 and r.output_ids == [5]


# ------------------------------------------------------------------------------------------------ budgets
def test_token_budget_is_shared_and_exact() -> None:
    core = core_for(max_batch_tokens=10)
    add(core, "a", 4)
    add(core, "b", 4)
    add(core, "c", 4)
    plan = step(core)
    assert ids(plan) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 2)]
    assert plan.num_tokens == 10 and plan.num_prefill_tokens == 10 and plan.num_decode_tokens == 0
    assert plan.token_budget == 10


def test_request_cap() -> None:
    core = core_for(max_requests_per_batch=2)
    for rid in "abc":
        add(core, rid, 3)
    plan = step(core)
    assert [s.request_id for s in plan.scheduled] == ["a", "b"]
    entry = plan.skip_reason("c")
    assert entry.reason == SkipReason.REQUEST_CAP and entry.detail == {"cap": 2}
    assert plan.request_cap == 2
    plan = step(core)
    assert [s.request_id for s in plan.scheduled] == ["a", "b"]  # decodes first, c still capped
    assert reason(plan, "c") == SkipReason.REQUEST_CAP


def test_cache_budget_binds_with_shared_prefixes() -> None:
    # 6 blocks of 4 tokens = 24 tokens of capacity; three requests share 2 blocks and read 9+ tokens each.
    core = core_for(6, safety_margin=0.0)
    add(core, "a", 9, max_new=4)
    step(core)
    step(core)  # a's blocks are registered
    add(core, "b", 9, max_new=4)
    add(core, "c", 9, max_new=4)
    plan = step(core)
    assert [(s.request_id, s.prefix_hit_tokens) for s in plan.scheduled] == [("a", 0), ("b", 8)]
    entry = plan.skip_reason("c")
    assert entry.reason == SkipReason.CACHE_BUDGET
    assert entry.detail == {"need_tokens": 8, "left_tokens": 24 - 10 - 8, "budget_tokens": 24}
    assert plan.cache_budget == 24 and plan.cache_read_tokens == 18


def test_every_request_not_taken_is_listed_with_a_reason() -> None:
    core = core_for(4, max_batch_tokens=6, safety_margin=0.0)
    add(core, "a", 6, max_new=3)
    add(core, "b", 10, base=50)
    add(core, "c", 5, base=90)
    plan = step(core)
    assert [s.request_id for s in plan.scheduled] == ["a"]
    assert reason(plan, "b") == reason(plan, "c") == SkipReason.TOKEN_BUDGET
    plan = step(core)  # a decodes; b takes a 5-token chunk (2 blocks); c finds no block
    assert ids(plan) == [("a", 6, 1), ("b", 0, 5)]
    assert reason(plan, "c") == SkipReason.TOKEN_BUDGET
    while core.has_work:
        live = set(core.requests)
        plan = step(core)
        listed = {rid for e in plan.skipped for rid in e.request_ids}
        assert live == listed | {s.request_id for s in plan.scheduled}
        assert not listed & {s.request_id for s in plan.scheduled}


# ------------------------------------------------------------------------------------------------ cache pressure
def test_waiting_request_without_blocks_is_skipped_not_stalled() -> None:
    core = core_for(4, safety_margin=0.0)
    add(core, "a", 11, max_new=2)
    add(core, "b", 8, base=50)
    plan = step(core)
    assert [s.request_id for s in plan.scheduled] == ["a"]
    e = plan.skip_reason("b")
    assert e.reason == SkipReason.NO_FREE_BLOCKS
    assert e.detail == {"needed_blocks": (2,), "available_blocks": (1,)}
    assert plan.stalled == []
    # later, smaller requests may still get in (transformers' order, not strict FIFO)
    add(core, "c", 3, base=90)
    plan = step(core)
    assert [s.request_id for s in plan.scheduled] == ["a", "c"]


def test_active_request_without_blocks_is_stalled() -> None:
    core2 = core_for(4, safety_margin=0.0)
    add(core2, "a", 8, max_new=6)
    add(core2, "b", 8, max_new=6, base=50)
    work = core2.schedule()
    core2.apply(work, {"a": 5, "b": 5})
    sched = core2.scheduler.schedule(99)  # the scheduler alone, before the offload policy acts
    assert [s.request_id for s in sched.scheduled] == []
    assert [(s.request_id, s.tokens, s.blocks_needed, s.blocks_available) for s in sched.stalled] == [
        ("a", 9, [1], [0]), ("b", 9, [1], [0])]
    assert sched.skip_reason("a").reason == SkipReason.NO_FREE_BLOCKS


def test_safety_margin_blocks_new_prefills_not_decodes() -> None:
    core = core_for(10, safety_margin=0.5)
    add(core, "a", 24, max_new=8)  # 6 of 10 blocks: free 0.4 < 0.5
    step(core)
    add(core, "b", 3)
    plan = step(core)
    assert plan.below_margin and plan.free_fraction == pytest.approx(0.4)
    assert ids(plan) == [("a", 24, 1)]
    e = plan.skip_reason("b")
    assert e.reason == SkipReason.SAFETY_MARGIN and e.detail["safety_margin"] == 0.5
    # prefill_first's default margin (0) admits it
    pf = core_for(10, scheduler_type="prefill_first")
    add(pf, "a", 24, max_new=8)
    step(pf)
    add(pf, "b", 3)
    assert [s.request_id for s in step(pf).scheduled] == ["a", "b"]


def test_safety_margin_still_admits_one_request_when_nothing_decodes() -> None:
    core = core_for(10, safety_margin=0.9, max_batch_tokens=16)
    add(core, "a", 20, max_new=1)
    plan = step(core)
    assert ids(plan) == [("a", 0, 16)]  # free fraction 1.0: not below
    add(core, "b", 3)
    plan = step(core)
    # below the margin: the split prefill is the first entry, so it runs; b waits
    assert plan.below_margin and ids(plan) == [("a", 16, 4)]
    assert reason(plan, "b") == SkipReason.SAFETY_MARGIN


# ------------------------------------------------------------------------------------------------ prefix caching
def test_final_forward_blocks_are_hashed() -> None:
    # max_new_tokens=1: the prompt's only forward is also the request's last one (transformers misses these).
    core = core_for()
    add(core, "a", 9, max_new=1)
    step(core)
    assert not core.has_work
    add(core, "b", 9, max_new=1)
    plan = step(core)
    s = plan.scheduled[0]
    assert (s.start, s.num_tokens, s.prefix_hit_tokens) == (8, 1, 8)


def test_wholly_cached_prompt_still_computes_its_last_token() -> None:
    core = core_for()
    add(core, "a", 8, max_new=1)
    step(core)
    b = add(core, "b", 8, max_new=2)
    plan = step(core)
    s = plan.scheduled[0]
    assert (s.start, s.num_tokens, s.prefix_hit_tokens, s.samples) == (4, 4, 4, True)
    assert b.prefix_cached_tokens == 4
    add(core, "c", 9, max_new=1)
    plan = step(core)
    assert [(s.request_id, s.start, s.num_tokens) for s in plan.scheduled] == [("b", 8, 1), ("c", 8, 1)]


def test_no_prefix_hits_without_sharing() -> None:
    core = core_for(sharing=False)
    add(core, "a", 9, max_new=1)
    step(core)
    add(core, "b", 9, max_new=1)
    plan = step(core)
    assert plan.scheduled[0].prefix_hit_tokens == 0 and plan.scheduled[0].num_tokens == 9


def test_prefix_hit_counted_once_per_admission() -> None:
    core = core_for()
    add(core, "a", 13, max_new=1)
    step(core)
    b = add(core, "b", 13, max_new=3)
    step(core)
    assert b.prefix_cached_tokens == 12
    while core.has_work:
        step(core)
    assert b.output().prefix_cached_tokens == 12


# ------------------------------------------------------------------------------------------------ re-queued requests
def test_requeued_requests_interleave_with_fresh_ones() -> None:
    core = core_for()
    sched = core.scheduler
    reqs = {}
    for rid in ["f1", "o1", "f2", "o2", "o3", "f3"]:
        reqs[rid] = Request(rid, [1, 2])
        if rid.startswith("o"):
            reqs[rid].num_soft_resets = 1
        sched.add_waiting(reqs[rid])
    _, waiting = sched.candidates()
    assert [r.request_id for r in waiting] == ["o1", "f1", "o2", "f2", "o3", "f3"]


def test_offload_backoff_until_an_active_request_ends() -> None:
    core = core_for()
    a = add(core, "a", 3, max_new=2)
    step(core)
    core.scheduler.block_new_requests = True  # as after an offload
    add(core, "b", 3)
    plan = step(core)
    assert [s.request_id for s in plan.scheduled] == ["a"] and reason(plan, "b") == SkipReason.OFFLOAD_BACKOFF
    assert a.state == RequestState.FINISHED
    plan = step(core)
    assert [s.request_id for s in plan.scheduled] == ["b"]  # a ended: the back-off is over
    # Cancelling a waiting request does not end a back-off (no device block was freed).
    core.scheduler.block_new_requests = True
    add(core, "c", 3)
    core.cancel("c")
    assert core.scheduler.block_new_requests


def test_plan_is_plain_data() -> None:
    core = core_for()
    add(core, "a", 5)
    plan = core.schedule().plan
    s = plan.scheduled[0]
    assert s.end == 5 and s.request_id == "a" and s.allocation is not None
    assert plan.scheduler == "fifo" and plan.step_id == 1 and not plan.empty
    assert plan.safety_margin == 0.15 and plan.free_fraction == 1.0
