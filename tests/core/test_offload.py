"""Offload policy and the engine core's fault rules: victims, swap vs soft reset, restore, cancel, failures."""

from __future__ import annotations

import zlib

import pytest

from cbnb.core.cache.layout import FULL, SLIDING, KVLayout, layer_groups
from cbnb.core.cache.manager import Allocation, CacheManager
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.core.engine_core import EngineCore
from cbnb.core.offload import SOFT_RESET, SWAP, choose_defragment, choose_victims
from cbnb.core.requests import Request, RequestState, SamplingParams
from cbnb.core.scheduler import StalledRequest

P = 4


def full_cache(num_sectors: int, swap: int = 0, sharing: bool = True) -> CacheManager:
    layout = KVLayout(tuple(layer_groups(1)), 1, 16, 4, P)  # one block per sector
    return CacheManager(layout, num_sectors, allow_block_sharing=sharing, swap_sectors=swap)


def hybrid_cache(num_sectors: int, window: int = 8, swap: int = 0) -> CacheManager:
    # 1 full + 3 sliding layers: 3 full blocks or 1 sliding block per sector
    layout = KVLayout(tuple(layer_groups(4, [FULL, SLIDING, SLIDING, SLIDING], window)), 1, 16, 4, P)
    return CacheManager(layout, num_sectors, swap_sectors=swap)


def make_core(cache: CacheManager, **cfg) -> EngineCore:
    cfg.setdefault("max_batch_tokens", 64)
    cfg.setdefault("safety_margin", 0.0)
    config = ContinuousBatchingConfig(page_size=P, **cfg).resolve("cpu")
    return EngineCore(config, cache, on_terminal=lambda r: ended.append(r))


ended: list[Request] = []


def add(core: EngineCore, rid: str, n: int, max_new: int = 8, base: int = 10) -> Request:
    r = Request(rid, [base + i for i in range(n)], SamplingParams(max_new_tokens=max_new, eos_token_ids=1))
    assert core.add(r)
    return r


def token(rid: str, pos: int) -> int:
    return 2 + zlib.crc32(f"{rid}:{pos}".encode()) % 50


def step(core: EngineCore):
    work = core.schedule()
    core.apply(work, {s.request_id: token(s.request_id, s.end) for s in work.plan.scheduled if s.samples})
    core.cache.check_invariants(list(core.requests.values()))
    return work


def drain(core: EngineCore, limit: int = 500) -> list:
    works = []
    for _ in range(limit):
        if not core.has_work:
            return works
        works.append(step(core))
    raise AssertionError("not idle")


def admit(cache: CacheManager, rid: str, n: int, base: int = 10) -> Request:
    r = Request(rid, [base + i for i in range(n)])
    out = cache.allocate(r, n)
    assert isinstance(out, Allocation)
    r.num_computed = n
    r.transition(RequestState.DECODING)
    return r


# ------------------------------------------------------------------------------------------------ choose_victims
def test_fewest_newest_victims() -> None:
    cache = full_cache(8)
    a = admit(cache, "a", 8)  # 2 blocks
    b = admit(cache, "b", 8, base=30)
    c = admit(cache, "c", 4, base=50)  # 1 block
    d = admit(cache, "d", 12, base=70)  # 3 blocks: the cache is full
    stalled = [StalledRequest("a", 9, [1], [0])]
    victims = choose_victims([a, b, c, d], stalled, set(), cache)
    assert [v.request.request_id for v in victims] == ["d"]  # the newest; one is enough
    assert victims[0].path == SOFT_RESET and victims[0].blocks_freed == 3
    assert victims[0].tokens_to_recompute == 12 and "a needs 1 blocks" in victims[0].reason
    # needing 5 blocks takes the newest until enough: d (3), c (1), b (2)
    stalled = [StalledRequest("a", 25, [5], [0])]
    victims = choose_victims([a, b, c, d], stalled, set(), cache)
    assert [v.request.request_id for v in victims] == ["d", "c", "b"]


def test_scheduled_requests_are_never_victims() -> None:
    cache = full_cache(4)
    a = admit(cache, "a", 4)
    b = admit(cache, "b", 4, base=30)
    c = admit(cache, "c", 8, base=50)
    victims = choose_victims([a, b, c], [StalledRequest("a", 5, [1], [0])], {"c"}, cache)
    assert [v.request.request_id for v in victims] == ["b"]


def test_never_the_last_active_request() -> None:
    cache = full_cache(2)
    a = admit(cache, "a", 8)
    assert choose_victims([a], [StalledRequest("a", 9, [1], [0])], set(), cache) == []
    cache2 = full_cache(3)
    a = admit(cache2, "a", 4)
    b = admit(cache2, "b", 8, base=30)
    # both stalled, both unscheduled: only one may go, and the last one stays
    victims = choose_victims([a, b], [StalledRequest("a", 20, [4], [0]), StalledRequest("b", 9, [1], [0])],
                             set(), cache2)
    assert [v.request.request_id for v in victims] == ["b"]


def test_victim_whose_blocks_are_all_shared_is_skipped() -> None:
    cache = full_cache(4)
    a = admit(cache, "a", 9)
    cache.register_completed(a, 9)
    c = admit(cache, "c", 4, base=50)
    b = Request("b", list(range(10, 18)))  # a's two full blocks, nothing else
    m = cache.match_prefix(Request("probe", list(range(10, 19))))
    cache.allocate(b, 8, m)
    b.num_computed = 8
    b.transition(RequestState.DECODING)
    assert cache.exclusive_blocks(b) == [0]
    victims = choose_victims([a, c, b], [StalledRequest("a", 13, [1], [0])], set(), cache)
    assert [v.request.request_id for v in victims] == ["c"]


def test_swap_when_the_pool_holds_it_else_soft_reset() -> None:
    cache = full_cache(6, swap=3)
    a = admit(cache, "a", 4)
    b = admit(cache, "b", 8, base=30)  # 2 blocks
    c = admit(cache, "c", 12, base=50)  # 3 blocks
    stalled = [StalledRequest("a", 20, [4], [0])]
    victims = choose_victims([a, b, c], stalled, set(), cache)
    # c (3 blocks) fits the 3-sector pool; b then does not (the pool is promised to c)
    assert [(v.request.request_id, v.path) for v in victims] == [("c", SWAP), ("b", SOFT_RESET)]
    assert victims[0].tokens_to_recompute == 0 and victims[1].tokens_to_recompute == 8


def test_hybrid_victims_account_for_sectors() -> None:
    # Full blocks: 3 per sector; sliding: 1 per sector; window 8 (2 sliding blocks per request).
    cache = hybrid_cache(5)
    s = admit(cache, "s", 4)  # full: 1 block (sector 2), sliding: 1 block (sector 3)
    v = admit(cache, "v", 8, base=50)  # full: 2 blocks (sector 2's free ones), sliding: 2 blocks (2 sectors)
    assert cache.pool.num_free == 1
    s.prompt_ids.append(99)
    out = cache.allocate(s, 5)  # needs 1 full block and 1 sliding block: 2 sectors, 1 free
    assert out.needed == [1, 1] and out.available == [3, 1]  # each group alone would fit
    victims = choose_victims([s, v], [StalledRequest("s", 5, out.needed, out.available)], set(), cache)
    assert [x.request.request_id for x in victims] == ["v"]


# ------------------------------------------------------------------------------------------------ engine core
@pytest.mark.parametrize("sharing", [False, True])
def test_soft_reset_keeps_progress(sharing: bool) -> None:
    core = make_core(full_cache(6, sharing=sharing), allow_block_sharing=sharing)
    a = add(core, "a", 6, max_new=12)
    b = add(core, "b", 6, max_new=12, base=40)
    works = drain(core)
    offloads = [d for w in works for d in w.offloads]
    assert offloads and all(d.path == SOFT_RESET for d in offloads)
    victim = offloads[0].request
    assert victim.num_soft_resets >= 1 and victim.num_offloads == 0
    for r in (a, b):
        assert r.state == RequestState.FINISHED and len(r.output_ids) == 12
        assert r.output_ids == [token(r.request_id, 6 + k) for k in range(12)]
        assert r.prompt_ids == ([10 + i for i in range(6)] if r is a else [40 + i for i in range(6)])
    assert core.offload_counts[SOFT_RESET] == len(offloads)
    # the victim went back to PENDING and was recomputed as a prefill
    states = [s for s, _ in victim.transitions]
    assert RequestState.PENDING in states[1:]
    off_step = next(w.step_id for w in works if w.offloads)
    back = next(s for w in works if w.step_id > off_step for s in w.plan.scheduled
                if s.request_id == victim.request_id)
    assert back.phase == "prefill" and back.num_tokens > 1
    if sharing:
        # its full blocks stayed in the prefix cache: the recompute starts after them
        assert back.start == back.prefix_hit_tokens > 0 and victim.prefix_cached_tokens >= back.start
    else:
        assert back.start == 0 and back.prefix_hit_tokens == 0


def test_swap_out_and_restore_through_the_core() -> None:
    core = make_core(full_cache(6, swap=8))
    a = add(core, "a", 6, max_new=12)
    b = add(core, "b", 6, max_new=12, base=40)
    works = drain(core)
    outs = [(w.step_id, r.request_id, so) for w in works for r, so in w.swap_outs]
    restores = [(w.step_id, r.request_id, pairs) for w in works for r, pairs in w.restores]
    assert outs and restores
    step_out, victim, so = outs[0]
    step_in, restored, pairs = next(x for x in restores if x[1] == victim)
    assert step_in > step_out
    host = [h for _, h in so.pairs[0]]
    assert [h for h, _ in pairs[0]] == host  # each host block comes back
    v = a if victim == "a" else b
    assert v.num_offloads >= 1 and v.num_soft_resets == 0
    # the restore recomputes only the last token (no prefill of the whole sequence)
    w = next(w for w in works if w.step_id == step_in)
    s = next(s for s in w.plan.scheduled if s.request_id == victim)
    assert s.num_tokens == 1 and s.phase == "prefill" and s.allocation.restored is not None
    for r in (a, b):
        assert r.output_ids == [token(r.request_id, 6 + k) for k in range(12)]


def test_requests_that_fit_get_no_warning_and_a_prompt_too_long_fails() -> None:
    core = make_core(full_cache(3))
    ok = add(core, "fits", 6, max_new=6)  # 12 tokens: exactly the cache
    assert ok.warning is None
    big = Request("big", [7] * 13, SamplingParams(max_new_tokens=1))
    assert core.add(big) is False
    assert big.state == RequestState.FAILED and big.finish_reason == "error"
    assert big.error == ("prompt of 13 tokens does not fit: the KV cache holds at most 12 tokens for one request "
                         "(num_blocks=3, page_size=4)")
    drain(core)
    assert ok.state == RequestState.FINISHED and ok.finish_reason == "length"


def test_tiny_swap_pool_falls_back_to_soft_reset() -> None:
    core = make_core(full_cache(6, swap=1))
    add(core, "a", 6, max_new=12)
    add(core, "b", 6, max_new=12, base=40)
    works = drain(core)
    paths = [d.path for w in works for d in w.offloads]
    assert paths and set(paths) == {SOFT_RESET}


def test_lone_request_that_outgrows_the_cache_ends_cache_exhausted_with_partial_output() -> None:
    ended.clear()
    core = make_core(full_cache(3))
    r = add(core, "a", 6, max_new=20)
    # decided at admission: 6 + 20 tokens can never fit the 12 the cache holds
    assert r.warning is not None and "at most 12 tokens for one request" in r.warning
    assert r.warning.startswith("exceeds the KV cache: 6 prompt tokens + max_new_tokens=20 = 26 tokens")
    assert "after at most 7 new tokens" in r.warning  # the last token is sampled from the last cached position
    works = drain(core)
    assert r.state == RequestState.FINISHED and r.finish_reason == "cache_exhausted" and r.error is None
    # 12 positions computed (the whole cache): 7 tokens sampled; the 13th position has no room
    assert r.output_ids == [token("a", 6 + k) for k in range(7)]
    assert works[-1].failed == [r] and ended[-1] is r
    # the engine goes on
    b = add(core, "b", 3, max_new=2)
    drain(core)
    assert b.state == RequestState.FINISHED


def test_lone_hybrid_request_stalled_by_fragmentation_is_not_failed() -> None:
    # Regression: cross-group sector fragmentation used to FAIL a request alone in the cache although it fits an
    # empty cache. Found by the random workloads (hybrid, page 4, window 5).
    layout = KVLayout(tuple(layer_groups(3, [FULL, SLIDING, FULL], 5)), 1, 16, 4, 4)  # full: 1/sector, sliding: 2
    cache = CacheManager(layout, 8, allow_block_sharing=False)
    assert (cache.allocators[0].blocks_per_sector, cache.allocators[1].blocks_per_sector) == (1, 2)
    core = make_core(cache, max_batch_tokens=3, max_requests_per_batch=2, safety_margin=None)
    reqs = [add(core, "r0", 2, max_new=11), add(core, "r1", 4, max_new=3, base=30)]
    works = []
    for _ in range(4):
        works.append(step(core))
    reqs += [add(core, "r2", 3, max_new=25, base=50), add(core, "r3", 3, max_new=2, base=70)]
    works += drain(core)
    for r in reqs:
        assert r.state == RequestState.FINISHED, (r, r.error)
    defrag = [d for w in works for d in w.offloads if d.reason.startswith("defragment")]
    assert defrag, "the scenario no longer fragments; adjust it"
    assert all(d.request is reqs[2] for d in defrag)
    r2 = reqs[2]
    assert cache.max_request_tokens() == 28  # r2 needs all of it: 3 + 25 tokens
    assert len(r2.output_ids) == 25 and r2.num_soft_resets + r2.num_offloads >= 1
    assert r2.output_ids == [token("r2", 3 + k) for k in range(25)]


def test_choose_defragment_rules() -> None:
    cache = hybrid_cache(4)
    r = admit(cache, "a", 4)
    st = StalledRequest("a", 5, [1, 1], [0, 0])
    assert [d.request for d in choose_defragment([r], [st], cache)] == [r]
    assert choose_defragment([r], [StalledRequest("a", 10**6, [1, 1], [0, 0])], cache) == []  # never fits
    other = admit(cache, "b", 4, base=40)
    assert choose_defragment([r, other], [st], cache) == []  # not alone: the victim rule applies


def test_cancel_frees_blocks_in_every_state() -> None:
    cache = full_cache(8, swap=8)
    core = make_core(cache, max_batch_tokens=4)
    a = add(core, "a", 10)
    step(core)  # a is mid-prefill
    assert a.state == RequestState.PREFILLING and cache.block_tables(a)[0]
    core.cancel("a")
    assert a.state == RequestState.CANCELLED and a.finish_reason == "cancelled"
    assert cache.block_tables(a) == [[]]
    # while swapped out
    b = add(core, "b", 4, base=30)
    step(core)
    so = cache.swap_out(b)
    assert so.num_blocks == 1
    b.swapped = True
    b.transition(RequestState.PENDING)
    core.scheduler.add_waiting(b)
    assert cache.swap.holds("b")
    assert core.cancel("b") is b
    assert not cache.swap.holds("b") and b.state == RequestState.CANCELLED
    # waiting, and unknown / already terminal
    c = add(core, "c", 4, base=50)
    assert core.cancel("c") is c and core.cancel("c") is None and core.cancel("nope") is None
    cache.check_invariants([a, b, c])
    assert not core.has_work


def test_cancel_during_a_step() -> None:
    core = make_core(full_cache(8))
    a = add(core, "a", 5)
    b = add(core, "b", 5, base=30)
    work = core.schedule()
    core.cancel("a")
    updated = core.apply(work, {"a": 3, "b": 4})
    assert updated == [b] and a.output_ids == [] and a.state == RequestState.CANCELLED
    core.cache.check_invariants([a, b])


def test_fail_batch_fails_only_that_batch() -> None:
    core = make_core(full_cache(8), max_requests_per_batch=1)
    a = add(core, "a", 5)
    b = add(core, "b", 5, base=30)
    work = core.schedule()
    assert [s.request_id for s in work.plan.scheduled] == ["a"]
    failed = core.fail_batch(work, RuntimeError("boom"))
    assert failed == [a] and a.state == RequestState.FAILED and a.error == "RuntimeError: boom"
    assert b.state == RequestState.PENDING
    drain(core)
    assert b.state == RequestState.FINISHED
    core.cache.check_invariants([a, b])


def test_missing_token_fails_the_request() -> None:
    core = make_core(full_cache(8))
    a = add(core, "a", 5)
    b = add(core, "b", 5, base=30)
    work = core.schedule()
    core.apply(work, {"b": 7})
    assert a.state == RequestState.FAILED and "no token" in a.error
    assert b.output_ids == [7]


def test_add_rules() -> None:
    core = make_core(full_cache(2))
    big = Request("big", list(range(9)))
    assert core.add(big) is False
    assert big.state == RequestState.FAILED and "9 tokens" in big.error and "8 tokens" in big.error
    a = add(core, "a", 4, max_new=3)
    with pytest.raises(ValueError, match="already in use"):
        core.add(Request("a", [1]))
    drain(core)
    assert a.state == RequestState.FINISHED
    with pytest.raises(ValueError, match="not a fresh request"):
        core.add(a)  # re-submitting a finished request object
    add(core, "a", 4)  # the id is free again


def test_fail_all_and_fail() -> None:
    core = make_core(full_cache(8))
    a = add(core, "a", 5)
    b = add(core, "b", 5, base=30)
    step(core)
    assert core.fail("a", "stop") is a and a.error == "stop"
    assert core.fail("a", "again") is None
    core.fail_all("shutdown")
    assert b.state == RequestState.FAILED and b.error == "shutdown" and not core.has_work
    core.cache.check_invariants([a, b])
    assert all(not t for alloc in core.cache.allocators for t in alloc.tables.values())


def test_async_in_flight_requests_are_neither_offloaded_nor_failed() -> None:
    # With async batching the next step is planned before the previous one is applied.
    core = make_core(full_cache(4))
    a = add(core, "a", 8, max_new=3)
    b = add(core, "b", 8, max_new=3, base=40)
    w1 = core.schedule()
    assert [s.request_id for s in w1.plan.scheduled] == ["a", "b"]
    w2 = core.schedule()  # both need a third block, none is free, and both have a sample in flight
    assert w2.plan.empty and not w2.offloads and not w2.failed
    assert {s.request_id for s in w2.plan.stalled} == {"a", "b"}
    assert a.pending_samples == b.pending_samples == 1 and a.state == b.state == RequestState.DECODING
    core.apply(w1, {"a": 5, "b": 6})
    core.apply(w2, {})
    w3 = core.schedule()  # now the newest one gives way
    assert [(d.request.request_id, d.path) for d in w3.offloads] == [("b", SOFT_RESET)]
    assert [s.request_id for s in w3.plan.scheduled] == ["a"]
    core.apply(w3, {"a": 7})
    drain(core)
    assert a.output_ids[:2] == [5, 7] and a.state == b.state == RequestState.FINISHED
    assert b.output_ids[0] == 6 and b.num_soft_resets == 1
