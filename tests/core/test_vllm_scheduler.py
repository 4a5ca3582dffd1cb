"""vLLM V1's policy (`scheduler_type="vllm"`): running requests first, strict FCFS admission, max_num_seqs on the
running requests, recompute preemption of the newest running request, its watermark."""

from __future__ import annotations

from cbnb.core.plan import SkipReason
from cbnb.core.requests import RequestState
from cbnb.core.vllm_scheduler import VLLMScheduler

from helpers_core import P, add, core_for, ids, reason, step  # noqa: F401 (P: used by the tests)


def token(rid: str, pos: int) -> int:
    return 2 + (hash((rid, pos)) % 50)


def run_out(core, limit: int = 500):
    """Step until idle with tokens that depend on (request, position) only; returns the plans."""
    plans = []
    while core.has_work and len(plans) < limit:
        work = core.schedule()
        core.apply(work, {s.request_id: token(s.request_id, s.end) for s in work.plan.scheduled if s.samples})
        core.cache.check_invariants(list(core.requests.values()))
        plans.append(work)
    assert not core.has_work
    return plans


def test_running_requests_first_then_strict_fcfs() -> None:
    core = core_for(num_sectors=64, scheduler_type="vllm", max_batch_tokens=16, sharing=False)
    assert isinstance(core.scheduler, VLLMScheduler) and core.scheduler.safety_margin == 0.0
    add(core, "a", 20)  # a long prompt: chunked over two steps
    add(core, "b", 3)
    p1 = step(core)
    assert ids(p1) == [("a", 0, 16)]
    assert reason(p1, "b") == SkipReason.TOKEN_BUDGET
    add(core, "c", 2)
    p2 = step(core)
    # the running chunk of "a" goes first, then waiting requests in arrival order
    assert ids(p2) == [("a", 16, 4), ("b", 0, 3), ("c", 0, 2)]
    p3 = step(core)
    assert [s.phase for s in p3.scheduled] == ["decode"] * 3


def test_a_waiting_request_that_does_not_fit_blocks_the_ones_behind_it() -> None:
    # 6 blocks of 4 tokens; "big" (20 tokens) needs 5 of the 4 left; "small" would fit but waits behind it (FCFS).
    # cbnb's FIFO (transformers' order) admits "small" past it.
    for policy, admitted in (("vllm", []), ("fifo", ["small"])):
        core = core_for(num_sectors=6, scheduler_type=policy, safety_margin=0.0, max_batch_tokens=64, sharing=False)
        add(core, "first", 7, max_new=20)
        step(core)
        add(core, "big", 20)
        add(core, "small", 2)
        p = step(core)
        assert [s.request_id for s in p.scheduled if s.request_id != "first"] == admitted, policy
        assert reason(p, "big") == SkipReason.NO_FREE_BLOCKS


def test_max_num_seqs_caps_the_running_requests() -> None:
    core = core_for(num_sectors=64, scheduler_type="vllm", max_requests_per_batch=2)
    for i in range(4):
        add(core, f"r{i}", 3, max_new=3)
    for work in run_out(core):
        assert len(work.plan.scheduled) <= 2
        assert len(core.scheduler.active) <= 2


def test_recompute_preemption_frees_blocks_and_the_request_finishes_whole() -> None:
    core = core_for(num_sectors=10, scheduler_type="vllm", max_batch_tokens=32)
    reqs = [add(core, f"r{i}", 6 + 2 * i, max_new=12) for i in range(3)]
    first_preemption = None
    for _ in range(500):
        if not core.has_work:
            break
        work = core.schedule()
        if work.offloads and first_preemption is None:
            first_preemption = work
            d = work.offloads[0]
            assert d.path == "soft_reset" and d.reason.startswith("preempted")
            victim = d.request
            # the newest running request is the victim; its blocks are freed and it waits at the front
            assert victim.request_id == "r2"
            assert victim.state == RequestState.PENDING and victim.num_computed == 0
            assert all(victim.request_id not in a.tables for a in core.cache.allocators)
            assert next(iter(core.scheduler._waiting_order()[0])).request_id == "r2"
            assert victim.request_id not in {s.request_id for s in work.plan.scheduled}
            # a step that preempted admits nobody
            assert reason(work.plan, "r2") == SkipReason.OFFLOAD_BACKOFF
        core.apply(work, {s.request_id: token(s.request_id, s.end) for s in work.plan.scheduled if s.samples})
        core.cache.check_invariants(list(core.requests.values()))
    assert first_preemption is not None, "no preemption happened"
    assert core.offload_counts["soft_reset"] >= 1
    for r in reqs:
        assert r.state == RequestState.FINISHED and len(r.output_ids) == 12
        # every token is the one its position gives (progress recomputed, nothing lost or repeated)
        assert r.output_ids == [token(r.request_id, len(r.prompt_ids) + k) for k in range(12)]
    assert reqs[2].num_soft_resets >= 1


def test_watermark_keeps_blocks_free_for_admission() -> None:
    # 16 blocks; watermark 0.5 keeps 8 free when admitting while something is already in the step.
    core = core_for(num_sectors=16, scheduler_type="vllm", safety_margin=0.5, sharing=False)
    add(core, "a", 8, max_new=30)
    p = step(core)
    assert ids(p) == [("a", 0, 8)]  # nothing scheduled yet in that step: no watermark
    # "a" grows to 3 blocks: 13 free
    add(core, "b", 20)  # 5 blocks: 13 - 5 = 8 left, allowed
    add(core, "c", 4)  # 1 more: would leave 7 < 8
    p = step(core)
    assert [s.request_id for s in p.scheduled] == ["a", "b"]
    entry = p.skip_reason("c")
    assert entry.reason == SkipReason.NO_FREE_BLOCKS and entry.detail["watermark_blocks"] == (8,)


def test_a_lone_request_that_outgrows_the_cache_ends_cache_exhausted() -> None:
    core = core_for(num_sectors=4, scheduler_type="vllm")  # 16 tokens in all
    r = add(core, "r", 10, max_new=30)
    run_out(core)
    assert r.state == RequestState.FINISHED and r.finish_reason == "cache_exhausted"
    assert len(r.output_ids) == 16 - 10 + 1
