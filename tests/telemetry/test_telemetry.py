"""Telemetry: scripted scenarios with exact expectations, the EventLog, snapshots and stats."""

from __future__ import annotations

import json
import random
import threading

import pytest

import cbnb
from cbnb.core.cache.snapshot import BlockState
from cbnb.telemetry.events import EventLog, Offload, PrefixHit, RequestAdded, StateChange, StepPlanned, StepTiming
from cbnb.engine.models import load_model


@pytest.fixture(scope="module")
def tiny():
    model, _ = load_model("tiny:llama")
    return model


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 500) for _ in range(n)]


def _engine(model, **cfg) -> cbnb.Engine:
    return cbnb.Engine(model, config=cbnb.ContinuousBatchingConfig(**cfg))


def test_shared_prefix_hit_is_exactly_the_shared_full_blocks(tiny):
    rng = random.Random(1)
    shared = _ids(rng, 64)
    eng = _engine(tiny, page_size=16, num_blocks=64, max_batch_tokens=64)
    with eng:
        first = eng.generate([shared + _ids(rng, 5)], max_new_tokens=3, eos_token_id=-1)[0]
        second = eng.generate([shared + _ids(rng, 9)], max_new_tokens=3, eos_token_id=-1)[0]
    hits = eng.events.events(PrefixHit)
    assert [(h.request_id, h.tokens, len(h.blocks)) for h in hits] == [(second.request_id, 64, 4)]
    assert first.prefix_cached_tokens == 0 and second.prefix_cached_tokens == 64
    run = eng.stats()["run"]
    assert run["prefix_hit_tokens"] == 64 and run["prefix_hits"] == 1
    # 64 tokens served from cache; 69 + (73 - 64) prompt tokens computed.
    assert run["prefix_hit_rate_pct"] == pytest.approx(100 * 64 / (64 + 69 + 9))


def test_forced_shortage_offloads_the_newest_and_never_the_last_active(tiny):
    rng = random.Random(2)
    # 8 blocks of 8 tokens = 64 tokens; three 12-token prompts generating 20 tokens each need 96.
    eng = _engine(tiny, page_size=8, num_blocks=8, max_batch_tokens=64, safety_margin=0.0,
                  allow_block_sharing=False)
    prompts = [_ids(rng, 12) for _ in range(3)]
    with eng:
        outs = eng.generate(prompts, max_new_tokens=20, eos_token_id=-1)
    assert all(o.state == cbnb.RequestState.FINISHED for o in outs)
    offloads = eng.events.events(Offload)
    assert offloads, "the cache was too small: an offload must have happened"
    arrival = {o.request_id: i for i, o in enumerate(outs)}
    plans = {e.step: e for e in eng.events.events(StepPlanned)}
    for off in offloads:
        assert off.path == "soft_reset" and off.reason.startswith("cache full")
        assert off.blocks_freed > 0 and off.tokens_to_recompute > 0
        # The victim is the newest request that was active (not already waiting) at that step.
        active = _active_before(eng, off.step)
        assert len(active) >= 2, "the last active request must never be offloaded"
        assert off.request_id == max(active, key=arrival.__getitem__)
        assert plans[off.step].stalled, "an offload answers a stalled request"
    assert eng.stats()["run"]["soft_resets"] == len(offloads)


def _active_before(eng: cbnb.Engine, step: int) -> set[str]:
    """Requests that were PREFILLING/DECODING just before `step`'s offloads, from the state-change events."""
    state: dict[str, str] = {}
    for e in eng.events.events():
        if isinstance(e, RequestAdded):
            state[e.request_id] = "PENDING"
        if isinstance(e, StateChange):
            if e.step > step or (e.step == step and e.new == "PENDING"):
                continue
            state[e.request_id] = e.new
    return {r for r, s in state.items() if s in ("PREFILLING", "DECODING")}


def test_long_prompt_chunks_sum_to_the_prompt(tiny):
    rng = random.Random(3)
    prompt = _ids(rng, 150)
    eng = _engine(tiny, page_size=16, num_blocks=64, max_batch_tokens=32)
    with eng:
        out = eng.generate([prompt], max_new_tokens=2, eos_token_id=-1)[0]
    chunks = [(phase, n) for e in eng.events.events(StepPlanned) for (rid, phase, n, _, _) in e.taken
              if rid == out.request_id]
    prefill = [n for phase, n in chunks if phase == "prefill"]
    assert sum(prefill) == 150
    assert prefill == [32, 32, 32, 32, 22]
    assert all(e.tokens_used <= e.token_budget == 32 for e in eng.events.events(StepPlanned))
    states = [e.new for e in eng.events.events(StateChange) if e.request_id == out.request_id]
    assert states == ["PREFILLING", "DECODING", "FINISHED"]


def test_safety_margin_refusal_carries_margin_and_free_fraction(tiny):
    rng = random.Random(4)
    # 10 blocks of 16 tokens; the first request takes 7 (112 tokens) so the free share falls to 0.3 < 0.5.
    eng = _engine(tiny, page_size=16, num_blocks=10, max_batch_tokens=256, safety_margin=0.5,
                  allow_block_sharing=False)
    with eng:
        h1 = eng.submit(_ids(rng, 100), max_new_tokens=30, eos_token_id=-1)
        for d in h1:  # wait until the first request decodes
            if d.token_ids:
                break
        h2 = eng.submit(_ids(rng, 10), max_new_tokens=2, eos_token_id=-1)
        h1.result(60)
        h2.result(60)
    refusals = [(e, k) for e in eng.events.events(StepPlanned) for k in e.skipped if k[0] == "safety_margin"]
    assert refusals, "the second request must have been held back by the safety margin"
    plan, (reason, rids, detail) = refusals[0]
    assert h2.request_id in rids
    assert detail["safety_margin"] == 0.5
    assert detail["free_fraction"] < 0.5 and detail["free_fraction"] == pytest.approx(plan.free_fraction, abs=1e-6)
    assert h2.result().state == cbnb.RequestState.FINISHED


def test_step_timing_and_cpu_graph_counts(tiny):
    eng = _engine(tiny, page_size=16, num_blocks=32)
    with eng:
        eng.generate([[5, 6, 7, 8]], max_new_tokens=4, eos_token_id=-1)
    timings = eng.events.events(StepTiming)
    assert len(timings) == 4
    for t in timings:
        assert t.forward_s > 0 and t.schedule_s >= 0 and t.update_s >= 0
        assert t.num_requests == 1
    stats = eng.stats()
    run = stats["run"]
    assert run["cuda_graph_captures"] == 0 and run["cuda_graph_replays"] == 0
    assert eng.config.use_cuda_graph == (False, False)  # on CPU: no graphs, visibly
    assert run["output_tokens"] == 4 and run["requests_finished"] == 1
    assert run["ttft_s"]["count"] == 1 and run["ttft_s"]["p50"] > 0
    assert run["tpot_s"]["count"] == 1
    assert run["cuda_graph_capture_failures"] == 0
    assert set(stats["memory_bytes"]) == {"weights", "packed_weights", "kv_cache", "activations", "logits", "cuda_graphs",
                                           "swap_pool"}
    assert stats["memory_bytes"]["cuda_graphs"] == 0


def test_stats_reset_keeps_cumulative(tiny):
    eng = _engine(tiny, page_size=16, num_blocks=32)
    with eng:
        eng.generate([[5, 6, 7]], max_new_tokens=2, eos_token_id=-1)
        eng.reset_stats()
        eng.generate([[9, 10, 11]], max_new_tokens=3, eos_token_id=-1)
    s = eng.stats()
    assert s["run"]["output_tokens"] == 3
    assert s["cumulative"]["output_tokens"] == 5


def test_telemetry_off_records_no_events_but_counts(tiny):
    eng = cbnb.Engine(tiny, config=cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=32), telemetry=False)
    with eng:
        eng.generate([[5, 6, 7]], max_new_tokens=2, eos_token_id=-1)
    assert len(eng.events) == 0
    assert eng.stats()["run"]["output_tokens"] == 2


def test_snapshot_states_owners_and_fill(tiny):
    rng = random.Random(5)
    shared = _ids(rng, 32)
    eng = _engine(tiny, page_size=16, num_blocks=20, max_batch_tokens=128)
    with eng:
        eng.generate([shared + [1, 2, 3]], max_new_tokens=1, eos_token_id=-1)  # its full blocks become cached
        snap = eng.snapshot()
    g = snap.groups[0]
    assert g.num_blocks == 22  # 20 usable + the two reserved padding blocks
    assert g.padding_blocks == (0, 1)
    assert (g.state[[0, 1]] == BlockState.RESERVED).all()
    assert g.counts()["cached"] == 2  # the request's two full 16-token blocks (its last forward included)
    assert (g.tokens[g.state == BlockState.CACHED] == 16).all()
    assert g.counts()["allocated"] == 0 and (g.owner == -1).all()


def test_snapshot_of_live_requests_marks_shared_blocks():
    from cbnb.core.cache.layout import KVLayout, layer_groups
    from cbnb.core.cache.manager import CacheManager
    from cbnb.core.cache.snapshot import kv_snapshot, kv_usage
    from cbnb.core.requests import Request

    cm = CacheManager(KVLayout(tuple(layer_groups(2)), 2, 16, 4, 16), 16)
    a = Request("a", list(range(3, 40)))
    b = Request("b", list(range(3, 35)) + [7, 7, 7])
    assert not isinstance(cm.allocate(a, 37), type(None))
    a.num_computed = 37
    cm.register_completed(a, 37)
    match = cm.match_prefix(b)
    assert match is not None and match.num_tokens == 32
    cm.allocate(b, 35, match)
    b.num_computed = 35
    snap = kv_snapshot(cm, {"a": 37, "b": 35})
    g = snap.groups[0]
    shared = g.state == BlockState.SHARED
    assert shared.sum() == 2 and (g.refcount[shared] == 2).all()
    for blk in map(int, shared.nonzero()[0]):
        assert sorted(snap.request_ids[i] for i in g.shared_owners[blk]) == ["a", "b"]
    filled = g.tokens[g.state != BlockState.FREE]
    # a: 16 + 16 + 5; b adds one more block with 3 tokens; shared blocks count once.
    assert int(filled[filled > 0].sum()) == 16 + 16 + 5 + 3
    usage = kv_usage(cm, {"a": 37, "b": 35})
    total = 16 * cm.layout.bytes_per_sector
    assert usage["blocks_frac"] == pytest.approx(4 * cm.layout.bytes_per_block(0) / total)
    assert usage["tokens_frac"] == pytest.approx((16 + 16 + 5 + 3) * cm.layout.bytes_per_block(0) / 16 / total)
    assert usage["fragmentation_frac"] == pytest.approx(usage["blocks_frac"] - usage["tokens_frac"])


# ---------------------------------------------------------------------------------------------- EventLog
def _ev(i: int) -> RequestAdded:
    return RequestAdded(i, float(i), f"r{i}", i, None)


def test_eventlog_cursor_reads_and_bound():
    log = EventLog(maxlen=5)
    log.extend([_ev(i) for i in range(3)])
    items, cur, dropped = log.since(0)
    assert [e.step for e in items] == [0, 1, 2] and cur == 3 and dropped == 0
    log.extend([_ev(i) for i in range(3, 8)])
    items, cur, dropped = log.since(cur)
    assert [e.step for e in items] == [3, 4, 5, 6, 7] and cur == 8 and dropped == 0
    items, cur2, dropped = log.since(1)
    assert [e.step for e in items] == [3, 4, 5, 6, 7] and dropped == 2 and cur2 == 8
    assert log.since(8)[0] == []
    with pytest.raises(ValueError, match="maxlen"):
        EventLog(0)


def test_eventlog_threads_subscribe_and_export(tmp_path):
    log = EventLog(maxlen=100_000)
    got: list[int] = []
    unsub = log.subscribe(lambda evs: got.extend(e.step for e in evs))

    def writer(k: int) -> None:
        for i in range(500):
            log.append(_ev(k * 1000 + i))

    threads = [threading.Thread(target=writer, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert log.cursor == 4000 and len(log) == 4000 and len(got) == 4000
    assert sorted(got) == sorted(k * 1000 + i for k in range(8) for i in range(500))
    unsub()
    log.append(_ev(99))
    assert len(got) == 4000
    log.subscribe(lambda evs: 1 / 0)  # a broken subscriber does not break appends
    log.append(_ev(100))
    assert log.cursor == 4002
    d = log.to_dicts()[0]
    assert d["kind"] == "request_added" and {"step", "t", "request_id"} <= set(d)
    path = tmp_path / "events.jsonl"
    log.to_jsonl(str(path))
    lines = path.read_text().splitlines()
    assert len(lines) == 4002 and json.loads(lines[-1])["request_id"] == "r100"
    df = log.to_dataframe()
    assert len(df) == 4002 and "kind" in df.columns


def test_the_recorder_observes_the_core_and_never_calls_it():
    """Telemetry observes: the loop calls the core, the `Recorder` (the core's observer and the cache's sink) hears
    what it decided, in order, and calls no method of the core or the cache manager."""
    from cbnb.core.cache.layout import KVLayout, layer_groups
    from cbnb.core.cache.manager import CacheManager
    from cbnb.core.engine_core import EngineCore
    from cbnb.core.requests import Request, SamplingParams
    from cbnb.telemetry.recorder import Recorder

    class Watched:
        """Counts the method calls made on the wrapped object while `recording` is set."""

        def __init__(self, obj):
            self._obj, self.calls, self.recording = obj, [], False

        def __getattr__(self, name):
            v = getattr(self._obj, name)
            if callable(v) and self.recording:
                self.calls.append(name)
            return v

    layout = KVLayout(tuple(layer_groups(2)), 2, 8, 4, 4)
    cfg = cbnb.ContinuousBatchingConfig(page_size=4, num_blocks=16, max_batch_tokens=8).resolve("cpu")
    cache = CacheManager(layout, 16, allow_block_sharing=True)
    rec = Recorder()
    cache.sink = rec.sink
    core = EngineCore(cfg, cache, on_terminal=rec.request_done)
    watched_core, watched_cache = Watched(core), Watched(cache)
    rec.attach(watched_core, watched_cache)
    core.observer = rec  # `attach` subscribed the wrapper; the core itself must tell the recorder
    watched_core.recording = watched_cache.recording = True
    core.add(Request("a", list(range(3, 13)), SamplingParams(max_new_tokens=2, ignore_eos=True)))
    core.add(Request("huge", list(range(3, 200)), SamplingParams(max_new_tokens=2)))  # never fits: FAILED at once
    for _ in range(6):
        work = core.schedule()
        core.apply(work, {s.request_id: 5 for s in work.plan.scheduled if s.samples})
        rec.flush()
    assert watched_core.calls == [] and watched_cache.calls == []
    kinds = [e.kind for e in rec.events.events()]
    assert kinds[:5] == ["request_added", "request_added", "state_change", "request_done", "step_planned"], kinds
    assert kinds[5] == "blocks_allocated"  # the cache's event of step 1 comes after its plan
    planned = rec.events.events("step_planned")
    assert [p.step for p in planned] == list(range(1, len(planned) + 1))
    done = {e.request_id: e.state for e in rec.events.events("request_done")}
    assert done == {"huge": "FAILED", "a": "FINISHED"}
