"""The public `Engine` / `RequestHandle` API: generate, submit, streaming (sync and async), result timeouts, threads,
lifecycle, config resolution, reconfigure, sampling. Tokens are always checked against ``model.generate``."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

import cbnb
from cbnb.core.requests import RequestState

from helpers_engine import (
    STD_NEW, STD_PROMPTS, TIMEOUT, StepRecorder, assert_cache_empty, cbnb_threads, config, oracle_for, paused,
    random_prompts, results, submit_together, tiny_model)

LLAMA = "tiny:llama"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------------- generate / outputs
def test_generate_outputs_in_input_order(llama):
    model, oracle = llama
    prompts = [STD_PROMPTS[5], STD_PROMPTS[0], tuple(STD_PROMPTS[3]), torch.tensor(STD_PROMPTS[1])]
    as_lists = [STD_PROMPTS[5], STD_PROMPTS[0], STD_PROMPTS[3], STD_PROMPTS[1]]
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        outs = engine.generate(prompts, max_new_tokens=10, eos_token_id=-1, timeout=TIMEOUT)
    assert len(outs) == 4 and len({o.request_id for o in outs}) == 4
    for o, p in zip(outs, as_lists):
        assert isinstance(o, cbnb.RequestOutput)
        assert o.prompt_token_ids == p
        assert o.token_ids == oracle(p, 10)
        assert o.state == RequestState.FINISHED and o.error is None and o.text == ""
        t = o.timings
        assert t.queued <= t.scheduled <= t.first_token <= t.finished
        assert 0 < t.ttft_s <= t.e2e_s


def test_from_pretrained_tiny(llama):
    model, oracle = llama
    engine = cbnb.Engine.from_pretrained(LLAMA, config=config(page_size=16))
    assert engine.tokenizer is None and engine.model is not model  # its own copy, same seed -> same weights
    with engine:
        out = engine.generate([STD_PROMPTS[2]], max_new_tokens=8, eos_token_id=-1, timeout=TIMEOUT)[0]
    assert out.token_ids == oracle(STD_PROMPTS[2], 8)


def test_request_ids_custom_and_duplicate(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        h = engine.submit([5, 6, 7], max_new_tokens=4, request_id="mine", eos_token_id=-1)
        with pytest.raises(ValueError, match="already in use"):
            engine.submit([5, 6, 7], max_new_tokens=4, request_id="mine")
        out = h.result(timeout=TIMEOUT)
    assert h.request_id == out.request_id == "mine"
    assert out.token_ids == oracle([5, 6, 7], 4)
    assert h.cancel() is False  # already done
    assert engine.cancel("unknown-id") is False


def test_source_is_carried_to_outputs_and_snapshots(llama):
    model, _ = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        h = engine.submit([5, 6, 7], max_new_tokens=3, eos_token_id=-1, source="workshop laptop 7")
        outs = engine.generate([[8, 9], [10, 11]], max_new_tokens=2, eos_token_id=-1, source="batch job",
                               timeout=TIMEOUT)
        plain = engine.submit([12, 13], max_new_tokens=2, eos_token_id=-1)
        assert h.result(TIMEOUT).source == "workshop laptop 7"
        assert [o.source for o in outs] == ["batch job", "batch job"]
        assert plain.result(TIMEOUT).source is None
        snap = {o.request_id: o.source for o in engine.requests_snapshot()}
        assert snap[h.request_id] == "workshop laptop 7" and snap[plain.request_id] is None
        assert {snap[o.request_id] for o in outs} == {"batch job"}
        with pytest.raises(TypeError, match="source must be a string"):
            engine.submit([5, 6], max_new_tokens=2, source=7)
        with pytest.raises(ValueError, match="source must be at most 512 characters; got 513"):
            engine.submit([5, 6], max_new_tokens=2, source="x" * 513)
        assert engine.cancel_all() == 0  # the refused submissions queued nothing


def test_latency_samples_are_the_stats_figures(llama):
    model, _ = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        engine.generate([[5, 6, 7], [8, 9]], max_new_tokens=3, eos_token_id=-1, timeout=TIMEOUT)
        lat, st = engine.latency_samples(), engine.stats()["cumulative"]
        assert sorted(lat) == ["e2e_latency_s", "queue_time_s", "tpot_s", "ttft_s"]
        for key in lat:
            assert len(lat[key]) == st[key]["count"] == 2 and max(lat[key]) == st[key]["max"]
        lat["ttft_s"].clear()  # a copy: the engine's figures are untouched
        assert len(engine.latency_samples()["ttft_s"]) == 2
        engine.reset_stats()
        engine.generate([[5, 6]], max_new_tokens=2, eos_token_id=-1, timeout=TIMEOUT)
        assert len(engine.latency_samples(cumulative=False)["e2e_latency_s"]) == 1
        assert len(engine.latency_samples()["e2e_latency_s"]) == 3


# ----------------------------------------------------------------------------------------------- streaming
def test_streaming_tokens(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16, max_batch_tokens=32))
    with engine:
        hs = [engine.submit(p, max_new_tokens=20, eos_token_id=-1) for p in STD_PROMPTS[:4]]
        streams = [list(h) for h in hs]
        outs = results(hs)
    for p, deltas, out in zip(STD_PROMPTS, streams, outs):
        assert deltas[-1].finished and deltas[-1].state == RequestState.FINISHED
        assert not any(d.finished for d in deltas[:-1])
        assert all(d.request_id == out.request_id for d in deltas)
        assert [t for d in deltas for t in d.token_ids] == out.token_ids == oracle(p, 20)
        assert len(deltas) >= 2  # really streamed, not one final blob


def test_streaming_text_matches_final_text(llama, smollm2_tokenizer):
    # A tiny model with SmolLM2's tokenizer: ids < 512 are byte-level pieces and specials, so incremental decoding
    # meets incomplete UTF-8 sequences and skipped special tokens.
    model, oracle = llama
    tok = smollm2_tokenizer
    engine = cbnb.Engine(model, tokenizer=tok, config=config(page_size=16))
    prompts = random_prompts([8, 20, 33], seed=21)
    with engine:
        hs = [engine.submit(p, max_new_tokens=40, eos_token_id=-1) for p in prompts]
        streams = [list(h) for h in hs]
        outs = results(hs)
    for p, deltas, out in zip(prompts, streams, outs):
        assert out.token_ids == oracle(p, 40)
        assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
        assert "".join(d.text for d in deltas) == out.text
        assert [t for d in deltas for t in d.token_ids] == out.token_ids
        assert deltas[-1].finished


def test_second_iteration_yields_nothing_instead_of_waiting(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))

    async def consume(h):
        return [d async for d in h]

    with engine:
        h = engine.submit(STD_PROMPTS[0], max_new_tokens=5, eos_token_id=-1)
        first = list(h)
        box = {}
        t = threading.Thread(target=lambda: box.update(again=list(h), again_async=asyncio.run(consume(h))))
        t.start()
        t.join(10)
        assert not t.is_alive(), "iterating a consumed handle blocked"
    assert [tk for d in first for tk in d.token_ids] == oracle(STD_PROMPTS[0], 5)
    assert box == {"again": [], "again_async": []}
    assert h.result(timeout=0).token_ids == oracle(STD_PROMPTS[0], 5)


def test_generate_refuses_a_bare_string_and_cancels_on_a_bad_prompt(llama):
    model, _ = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        with pytest.raises(TypeError, match="list of prompts"):
            engine.generate("Hello", max_new_tokens=2)
        with pytest.raises(ValueError):
            engine.generate([STD_PROMPTS[0], STD_PROMPTS[1], []], max_new_tokens=50, eos_token_id=-1)
        snap = engine.requests_snapshot()
        deadline = time.monotonic() + TIMEOUT
        while not (len(snap) == 2 and all(r.state.is_terminal for r in snap)) and time.monotonic() < deadline:
            time.sleep(0.02)
            snap = engine.requests_snapshot()
        # The two prompts submitted before the bad one were cancelled, not left running unseen.
        assert [r.state for r in snap] == [RequestState.CANCELLED] * 2


def test_async_iteration(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))

    async def consume(h):
        return [d async for d in h]

    async def main():
        hs = [engine.submit(p, max_new_tokens=12, eos_token_id=-1) for p in STD_PROMPTS[:3]]
        return hs, await asyncio.wait_for(asyncio.gather(*(consume(h) for h in hs)), TIMEOUT)

    with engine:
        hs, streams = asyncio.run(main())
    for p, h, deltas in zip(STD_PROMPTS, hs, streams):
        assert deltas[-1].finished and deltas[-1].state == RequestState.FINISHED
        toks = [t for d in deltas for t in d.token_ids]
        assert toks == h.result(timeout=0).token_ids == oracle(p, 12)


def test_result_timeout(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    gate = threading.Event()
    StepRecorder(engine, before=lambda work: gate.wait(TIMEOUT))
    with engine:
        h = engine.submit(STD_PROMPTS[1], max_new_tokens=5, eos_token_id=-1)
        with pytest.raises(TimeoutError):
            h.result(timeout=0.05)
        assert not h.done()
        with pytest.raises(TimeoutError):
            engine.generate([STD_PROMPTS[0]], max_new_tokens=3, timeout=0.05)
        gate.set()
        out = h.result(timeout=TIMEOUT)
    assert out.state == RequestState.FINISHED and out.token_ids == oracle(STD_PROMPTS[1], 5)


def test_submit_from_8_threads(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16, max_batch_tokens=64))
    prompts = random_prompts([4 + 3 * i for i in range(24)], seed=22)
    barrier = threading.Barrier(8)
    handles: list[list] = [[] for _ in range(8)]
    errors = []

    def worker(k):
        try:
            barrier.wait(TIMEOUT)
            for j in range(3):
                p = prompts[3 * k + j]
                handles[k].append((p, engine.submit(p, max_new_tokens=6, eos_token_id=-1)))
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    with engine:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        assert not errors
        pairs = [ph for hs in handles for ph in hs]
        outs = [(p, h.result(timeout=TIMEOUT)) for p, h in pairs]
    assert len(outs) == 24 and len({o.request_id for _, o in outs}) == 24
    for p, o in outs:
        assert o.state == RequestState.FINISHED
        assert o.token_ids == oracle(p, 6)
    assert not engine._handles  # nothing left behind
    assert_cache_empty(engine)


# ----------------------------------------------------------------------------------------------- lifecycle
def test_stop_leaves_no_thread_and_restart_works(llama):
    model, oracle = llama
    before = cbnb_threads()
    engine = cbnb.Engine(model, config=config(page_size=16))
    attn = model.config._attn_implementation
    engine.start()
    assert engine.running
    assert cbnb_threads() - before, "the engine runs on a cbnb thread"
    out = engine.generate([STD_PROMPTS[0]], max_new_tokens=4, eos_token_id=-1, timeout=TIMEOUT)[0]
    engine.stop()
    assert not engine.running
    assert cbnb_threads() <= before, "stop() left a cbnb thread alive"
    assert model.config._attn_implementation == attn  # the model's attention is restored
    assert out.token_ids == oracle(STD_PROMPTS[0], 4)
    # start() again after a stop works.
    with engine:
        again = engine.generate([STD_PROMPTS[0]], max_new_tokens=4, eos_token_id=-1, timeout=TIMEOUT)[0]
    assert again.token_ids == out.token_ids
    assert cbnb_threads() <= before


def test_stop_without_drain_cancels_unfinished(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16, max_requests_per_batch=1))
    gate = threading.Event()
    StepRecorder(engine, before=lambda work: gate.wait(TIMEOUT))
    hs = submit_together(engine, STD_PROMPTS[:3], 50)
    posted = threading.Event()
    inbox = engine._loop.inbox
    request_stop = inbox.request_stop

    def spy(*args, **kw):  # tells when stop() has asked the loop to stop
        request_stop(*args, **kw)
        posted.set()

    inbox.request_stop = spy
    stopper = threading.Thread(target=engine.stop)  # stop() joins the loop, which is held in its first step
    stopper.start()
    assert posted.wait(TIMEOUT)
    gate.set()
    stopper.join(TIMEOUT)
    assert not stopper.is_alive()
    outs = results(hs, timeout=5)
    for o in outs:
        assert o.state == RequestState.CANCELLED and o.finish_reason == "cancelled"
        assert o.error == "engine stopped"
        assert len(o.token_ids) < 50
    assert_cache_empty(engine)


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gemma3"])
def test_two_engines_share_one_model(name):
    # Stopping one engine must not switch the other's forwards away from the paged cache.
    model, oracle = tiny_model(name), oracle_for(name)
    refs = [oracle(p, 12) for p in STD_PROMPTS[:3]]
    attn = model.config._attn_implementation
    e1 = cbnb.Engine(model, config=config(page_size=16))
    e2 = cbnb.Engine(model, config=config(page_size=8, max_batch_tokens=32))
    try:
        e1.start()
        e2.start()
        a = e1.generate(STD_PROMPTS[:3], max_new_tokens=12, eos_token_id=-1, timeout=TIMEOUT)
        e1.stop()  # the engine that activated the model first stops first
        b = e2.generate(STD_PROMPTS[:3], max_new_tokens=12, eos_token_id=-1, timeout=TIMEOUT)
        e2.stop()
    finally:
        e1.stop()
        e2.stop()
    assert model.config._attn_implementation == attn  # restored once the last engine stopped
    with e2:
        c = e2.generate(STD_PROMPTS[:3], max_new_tokens=12, eos_token_id=-1, timeout=TIMEOUT)
    assert [o.token_ids for o in a] == refs
    assert [o.token_ids for o in b] == refs
    assert [o.token_ids for o in c] == refs
    assert model.config._attn_implementation == attn


@pytest.mark.parametrize("name", ["tiny:gemma3", "tiny:mistral"])
def test_model_generate_while_engine_holds_the_model(name):
    # A plain model.generate while an engine is running falls back to sdpa, sliding-window masks included.
    model, oracle = tiny_model(name), oracle_for(name)
    p = STD_PROMPTS[5]
    ref = oracle(p, 10)
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        assert model.config._attn_implementation == "cbnb_paged"
        ids = torch.tensor([p])
        with torch.no_grad():
            direct = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                    eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        out = engine.generate([p], max_new_tokens=10, eos_token_id=-1, timeout=TIMEOUT)[0]
    assert direct == ref
    assert out.token_ids == ref


# ----------------------------------------------------------------------------------------------- config
def test_config_resolved_and_user_config_unchanged(llama):
    model, _ = llama
    user = config(page_size=16)
    snapshot = user.to_dict()
    engine = cbnb.Engine(model, config=user)
    assert user.to_dict() == snapshot and user.num_blocks is None and user.max_batch_tokens is None
    c = engine.config
    assert c is not user
    assert isinstance(c.num_blocks, int) and not isinstance(c.num_blocks, bool) and c.num_blocks > 0
    assert isinstance(c.max_batch_tokens, int) and c.max_batch_tokens == 512  # CPU default
    assert c.page_size == 16 and c.max_requests_per_batch <= c.max_batch_tokens


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:mistral"])
def test_explicit_num_blocks_honoured(name):
    engine = cbnb.Engine(tiny_model(name), config=config(page_size=16, num_blocks=37, max_batch_tokens=48))
    assert engine.config.num_blocks == 37
    assert engine.config.max_batch_tokens == 48


@pytest.mark.parametrize("name, groups", [
    ("tiny:llama", ["group 0 (full_attention, page 16 tokens): 64 blocks + 2 reserved padding"]),
    ("tiny:gemma3", ["group 0 (sliding_attention, page 16 tokens): 86 blocks + 2 reserved padding",
                     "group 1 (full_attention, page 16 tokens): 258 blocks + 6 reserved padding"])])
def test_snapshot_labels_the_reserved_padding_blocks(name, groups):
    engine = cbnb.Engine(tiny_model(name), config=config(page_size=16, num_blocks=64))
    snap = engine.snapshot()
    assert repr(snap) == f"KVSnapshot({'; '.join(groups)}; 0 requests)"
    g = snap.groups[0]
    assert g.reserved_blocks == 2 and g.counts()["reserved"] == 2 and set(g.padding_blocks) <= {0, 1, 2, 3}
    assert g.usable_blocks + g.reserved_blocks == g.num_blocks
    if name == "tiny:llama":
        assert g.usable_blocks == engine.config.num_blocks == 64
        gate, held = threading.Event(), threading.Event()

        def before(work):  # hold its second step (its table: 48 slots, 3 blocks of 16) while we look
            if any(len(s.request.output_ids) == 1 for s in work.plan.scheduled):
                held.set()
                gate.wait(TIMEOUT)

        StepRecorder(engine, before=before)
        with engine:
            h = engine.submit(STD_PROMPTS[4], max_new_tokens=2, eos_token_id=-1)  # 47 tokens
            assert held.wait(TIMEOUT)
            used = engine.snapshot()
            gate.set()
            h.result(TIMEOUT)
        assert repr(used).startswith("KVSnapshot(group 0 (full_attention, page 16 tokens): 64 blocks + 2 reserved "
                                     "padding, 3 allocated")


def test_reconfigure_between_runs(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        a = engine.generate(STD_PROMPTS[:3], max_new_tokens=8, eos_token_id=-1, timeout=TIMEOUT)
        new = config(page_size=8, num_blocks=40, max_batch_tokens=24)
        resolved = engine.reconfigure(new)
        assert resolved is engine.config and resolved.page_size == 8 and resolved.num_blocks == 40
        assert new.num_blocks == 40 and new.max_batch_tokens == 24  # user object untouched
        b = engine.generate(STD_PROMPTS[:3], max_new_tokens=8, eos_token_id=-1, timeout=TIMEOUT)
        # A config that cannot be applied raises and leaves the old one in force.
        with pytest.raises((ValueError, MemoryError)):
            engine.reconfigure(config(page_size=8, num_blocks=10**12))
        assert engine.config.num_blocks == 40
        c = engine.generate(STD_PROMPTS[:3], max_new_tokens=8, eos_token_id=-1, timeout=TIMEOUT)
    for p, x, y, z in zip(STD_PROMPTS, a, b, c):
        assert x.token_ids == y.token_ids == z.token_ids == oracle(p, 8)


def test_reconfigure_keeps_queued_and_running_requests(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16, max_requests_per_batch=2))
    with engine:
        hs = submit_together(engine, STD_PROMPTS, 30)
        first = next(iter(hs[0]))  # hs[0] is running (it produced a token); most others are still queued
        assert first.token_ids and not first.finished
        engine.reconfigure(config(page_size=8, num_blocks=200, max_batch_tokens=40), timeout=TIMEOUT)
        assert engine.config.page_size == 8
        outs = results(hs, timeout=30)
    for p, o in zip(STD_PROMPTS, outs):
        assert o.state == RequestState.FINISHED, (o.state, o.error)
        assert o.token_ids == oracle(p, 30)


# ----------------------------------------------------------------------------------------------- sampling
SAMPLED = dict(do_sample=True, temperature=0.9, top_k=50, top_p=0.95)


def test_seeded_sampling_reproducible_and_batch_independent(llama):
    model, oracle = llama
    p = STD_PROMPTS[3]
    alone = cbnb.Engine(model, config=config(page_size=16))
    with alone:
        a1 = alone.generate([p], max_new_tokens=20, seed=1234, eos_token_id=-1, timeout=TIMEOUT, **SAMPLED)[0]
        a2 = alone.generate([p], max_new_tokens=20, seed=1234, eos_token_id=-1, timeout=TIMEOUT, **SAMPLED)[0]
        other_seed = alone.generate([p], max_new_tokens=20, seed=99, eos_token_id=-1, timeout=TIMEOUT, **SAMPLED)[0]
    crowd = cbnb.Engine(model, config=config(page_size=8, max_batch_tokens=24))
    with crowd:
        with paused(crowd):
            noise = [crowd.submit(q, max_new_tokens=20, eos_token_id=-1, **SAMPLED) for q in STD_PROMPTS]
            seeded = crowd.submit(p, max_new_tokens=20, seed=1234, eos_token_id=-1, **SAMPLED)
            greedy = [crowd.submit(q, max_new_tokens=20, eos_token_id=-1) for q in STD_PROMPTS[:2]]
        b = seeded.result(timeout=TIMEOUT)
        results(noise + greedy)
    assert len(a1.token_ids) == 20
    assert a1.token_ids == a2.token_ids == b.token_ids
    assert other_seed.token_ids != a1.token_ids
    assert a1.token_ids != oracle(p, 20)  # it really sampled
    for q, h in zip(STD_PROMPTS, greedy):
        assert h.result(timeout=0).token_ids == oracle(q, 20)  # greedy neighbours unaffected by sampling ones


def test_seeded_sampling_survives_reconfigure(llama):
    # "Outputs after soft resets/swaps are identical to uninterrupted runs": a seeded request that is running when
    # the engine is reconfigured must keep its sample stream.
    model, _ = llama
    p = STD_PROMPTS[4]
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        ref = engine.generate([p], max_new_tokens=40, seed=7, eos_token_id=-1, timeout=TIMEOUT, **SAMPLED)[0]
        h = engine.submit(p, max_new_tokens=40, seed=7, eos_token_id=-1, **SAMPLED)
        it = iter(h)
        got = list(next(it).token_ids)
        engine.reconfigure(config(page_size=8, num_blocks=64), timeout=TIMEOUT)
        out = h.result(timeout=30)
    assert out.state == RequestState.FINISHED, (out.state, out.error)
    assert got == out.token_ids[: len(got)]
    assert out.token_ids == ref.token_ids


def test_top_k_1_equals_greedy(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        outs = engine.generate(STD_PROMPTS[:3], max_new_tokens=12, do_sample=True, top_k=1, temperature=0.7,
                               eos_token_id=-1, timeout=TIMEOUT)
    for p, o in zip(STD_PROMPTS, outs):
        assert o.token_ids == oracle(p, 12)


def test_eos_stops_and_is_included(llama):
    model, oracle = llama
    p = STD_PROMPTS[4]
    ref = oracle(p, STD_NEW)
    eos = ref[6]
    j = ref.index(eos)
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        one = engine.submit(p, max_new_tokens=STD_NEW, eos_token_id=eos).result(timeout=TIMEOUT)
        many = engine.submit(p, max_new_tokens=STD_NEW, eos_token_id=[510, eos]).result(timeout=TIMEOUT)
        ignored = engine.submit(p, max_new_tokens=STD_NEW, eos_token_id=eos, ignore_eos=True).result(timeout=TIMEOUT)
    assert one.token_ids == ref[: j + 1] and one.token_ids[-1] == eos
    assert one.finish_reason == "eos" and one.state == RequestState.FINISHED
    assert many.token_ids == one.token_ids
    assert ignored.token_ids == ref and ignored.finish_reason == "length"


def test_default_eos_is_the_models(llama):
    model, _ = llama
    engine = cbnb.Engine(model)
    assert engine.default_eos == frozenset({model.generation_config.eos_token_id})


def test_max_queue_size_bounds_unfinished_requests(llama):
    import queue as _queue

    model, _ = llama
    eng = cbnb.Engine(model, config=cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_queue_size=2))
    with paused(eng):
        a = eng.submit([5, 6, 7], max_new_tokens=3, eos_token_id=-1)
        b = eng.submit([8, 9, 10], max_new_tokens=3, eos_token_id=-1)
        with pytest.raises(_queue.Full, match="max_queue_size is 2"):
            eng.submit([11, 12], max_new_tokens=3, eos_token_id=-1)
    assert a.result(TIMEOUT).state == RequestState.FINISHED and b.result(TIMEOUT).state == RequestState.FINISHED
    c = eng.submit([11, 12], max_new_tokens=3, eos_token_id=-1)  # room again once they finished
    assert c.result(TIMEOUT).state == RequestState.FINISHED
    eng.stop()
