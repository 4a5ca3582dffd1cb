"""Fault rules of the engine (where transformers crashes or loses work; `docs/architecture.md`): bad prompts, requests larger than the cache, cancellation at every
stage, forward exceptions (one batch, then repeated), submitting after stop. In every case the engine either keeps
serving the other requests correctly (checked against ``model.generate``) or stops with the error surfaced, and every
request ends with a terminal output; cancelled/failed requests hold no cache blocks."""

from __future__ import annotations

import threading

import pytest
import torch

import cbnb
from cbnb.engine.engine import EngineStoppedError
from cbnb.core.requests import RequestState

from helpers_engine import (
    STD_NEW, STD_PROMPTS, TIMEOUT, StepRecorder, assert_cache_empty, assert_no_blocks, config, converted_smollm2,
    oracle_for, random_prompts, results, submit_together, tiny_model)



pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _check_finished(oracle, prompts, outs, n):
    for p, o in zip(prompts, outs):
        assert o.state == RequestState.FINISHED, (o.state, o.error)
        assert o.token_ids == oracle(p, n)


# ----------------------------------------------------------------------------------------------- bad prompts
def test_empty_prompt_rejected(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        for bad in ([], (), torch.tensor([], dtype=torch.long)):
            with pytest.raises(ValueError, match="empty"):
                engine.submit(bad, max_new_tokens=3)
        with pytest.raises(ValueError):
            engine.submit("", max_new_tokens=3)  # text (here: without a tokenizer) is refused too
        with pytest.raises(ValueError, match="empty"):
            engine.generate([[4, 5], []], max_new_tokens=3)
        out = engine.generate([[4, 5]], max_new_tokens=3, eos_token_id=-1, timeout=TIMEOUT)[0]
    assert out.token_ids == oracle([4, 5], 3)  # the engine is unaffected


def test_empty_text_prompt_rejected_with_tokenizer(llama):
    from transformers import AutoTokenizer

    path = converted_smollm2()

    engine = cbnb.Engine(llama[0], tokenizer=AutoTokenizer.from_pretrained(str(path)), config=config(page_size=16))
    with engine:
        with pytest.raises(ValueError, match="empty"):
            engine.submit("")
        with pytest.raises(ValueError, match="empty"):
            engine.submit("", chat=False)
        with pytest.raises(ValueError, match="empty"):
            engine.submit([])
        assert engine.running and not engine.core.requests


@pytest.mark.parametrize("bad, error", [([3, 512], ValueError), ([600], ValueError), ([-1, 4], ValueError),
                                        ([4, 2.5], TypeError), ([True, 4], TypeError)], ids=str)
def test_token_id_outside_vocabulary_rejected(llama, bad, error):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        with pytest.raises(error, match="prompt"):
            engine.submit(bad, max_new_tokens=3)
        with pytest.raises(ValueError, match="vocabulary"):
            engine.submit(torch.tensor([7, model.config.vocab_size]), max_new_tokens=3)
        out = engine.generate([[4, 5]], max_new_tokens=3, eos_token_id=-1, timeout=TIMEOUT)[0]
    assert out.token_ids == oracle([4, 5], 3)
    assert not engine.core.requests


# ----------------------------------------------------------------------------------------------- too big for the cache
@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gemma3"])
def test_prompt_larger_than_cache_fails_alone(name):
    model, oracle = tiny_model(name), oracle_for(name)
    engine = cbnb.Engine(model, config=config(page_size=16, num_blocks=4, max_batch_tokens=32))
    cap = engine.cache.max_request_tokens()
    assert cap < 400
    big = random_prompts([cap + 10], seed=31)[0]
    small = STD_PROMPTS[:3]
    with engine:
        hs = submit_together(engine, [small[0], big, small[1]], 8)
        hs.append(engine.submit(small[2], max_new_tokens=8, eos_token_id=-1))
        outs = results(hs)
    assert outs[1].state == RequestState.FAILED and outs[1].finish_reason == "error"
    assert "does not fit" in outs[1].error and str(cap) in outs[1].error
    assert outs[1].token_ids == []
    _check_finished(oracle, small, [outs[0], outs[2], outs[3]], 8)
    assert_cache_empty(engine)


@pytest.mark.parametrize("swap", [0, 0.001], ids=["no_swap", "swap"])
@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gemma3"])
def test_request_that_can_never_fit_warns_then_ends_cache_exhausted(name, swap):
    # The big request (prompt + max_new_tokens > the whole cache) is admitted with a warning; it runs alongside two
    # small ones (which may be offloaded for it); once they are done it is alone, fills the whole cache and ends
    # FINISHED "cache_exhausted" with the tokens it made, whatever the offload path, and the engine goes on.
    model, oracle = tiny_model(name), oracle_for(name)
    engine = cbnb.Engine(model, config=config(page_size=16, num_blocks=4, max_batch_tokens=32,
                                              cpu_offload_space=swap))
    cap = engine.cache.max_request_tokens()
    p = random_prompts([cap - 20], seed=32)[0]
    with engine:
        hs = submit_together(engine, [p, STD_PROMPTS[0], STD_PROMPTS[1]], [60, 30, 20])
        out, *companions = results(hs)
        after = engine.generate(STD_PROMPTS[:2], max_new_tokens=8, eos_token_id=-1, timeout=TIMEOUT)
        assert engine.running and engine.error is None
    assert companions[0].token_ids == oracle(STD_PROMPTS[0], 30)
    assert companions[1].token_ids == oracle(STD_PROMPTS[1], 20)
    assert [c.warning for c in companions] == [None, None]
    assert out.state == RequestState.FINISHED and out.finish_reason == "cache_exhausted" and out.error is None
    assert f"at most {cap} tokens for one request" in out.warning and "num_blocks=4" in out.warning
    assert "sector" not in out.warning
    warned = [e for e in engine.events.events("request_warning")]
    assert [(e.request_id, e.code, e.message) for e in warned] == [(out.request_id, "exceeds_cache", out.warning)]
    # It kept every token that fitted (the last one is sampled from the last cached position), and they are right.
    assert len(out.token_ids) == cap - len(p) + 1
    assert out.token_ids == oracle(p, len(out.token_ids))
    done = [e for e in engine.events.events("request_done") if e.request_id == out.request_id]
    assert [(e.state, e.finish_reason) for e in done] == [("FINISHED", "cache_exhausted")]
    _check_finished(oracle, STD_PROMPTS[:2], after, 8)
    assert_cache_empty(engine)


def test_user_facing_messages_speak_of_blocks_and_tokens_never_sectors(llama):
    model, _ = llama
    engine = cbnb.Engine(model, config=config(page_size=16, num_blocks=4, max_batch_tokens=32))
    with engine:
        too_long = engine.submit(random_prompts([200], seed=3)[0], max_new_tokens=2).result(TIMEOUT)
        exhausted = engine.submit([5, 6, 7], max_new_tokens=500, eos_token_id=-1).result(TIMEOUT)
    with pytest.raises(MemoryError) as no_room:
        cbnb.Engine(model, config=config(page_size=16, max_memory_percent=1e-9))
    assert too_long.state == RequestState.FAILED and exhausted.finish_reason == "cache_exhausted"
    assert len(exhausted.token_ids) == 64 - 3 + 1  # num_blocks=4 of 16 tokens
    for msg in (too_long.error, exhausted.warning, str(no_room.value)):
        assert "sector" not in msg and "block" in msg, msg


# ----------------------------------------------------------------------------------------------- cancel
def test_cancel_while_waiting_behind_full_batch(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16, max_requests_per_batch=1))
    rec = StepRecorder(engine)
    with engine:
        a, b = submit_together(engine, STD_PROMPTS[:2], [150, 5])
        assert b.cancel() is True
        ob = b.result(timeout=TIMEOUT)
        assert not a.done(), "B must be cancelled while A still holds the only batch slot"
        assert_no_blocks(engine, ob.request_id)
        oa = a.result(timeout=TIMEOUT)
    assert ob.state == RequestState.CANCELLED and ob.finish_reason == "cancelled" and ob.token_ids == []
    assert rec.entries(ob.request_id) == []  # never scheduled
    assert ob.timings.finished < oa.timings.finished
    assert oa.state == RequestState.FINISHED and oa.token_ids == oracle(STD_PROMPTS[0], 150)
    assert_cache_empty(engine)


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gemma3"])
def test_cancel_mid_chunk(name):
    model, oracle = tiny_model(name), oracle_for(name)
    engine = cbnb.Engine(model, config=config(page_size=16, max_batch_tokens=16))
    p = STD_PROMPTS[5]  # 60 tokens: 4 chunks of 16
    state = {}

    def before(work):
        for s in work.plan.scheduled:
            if s.request.prompt_ids == p and s.start == 16 and not s.samples:
                state["rid"] = s.request_id
                engine.cancel(s.request_id)

    rec = StepRecorder(engine, before=before)
    with engine:
        hs = submit_together(engine, [p, STD_PROMPTS[0]], 10)
        out = hs[0].result(timeout=TIMEOUT)
        assert_no_blocks(engine, out.request_id)
        other = hs[1].result(timeout=TIMEOUT)
    assert state["rid"] == out.request_id
    assert out.state == RequestState.CANCELLED and out.token_ids == []
    chunks = rec.entries(out.request_id)
    assert [e.start for e in chunks] == [0, 16]  # cancelled after the second chunk; chunks 3 and 4 never ran
    assert all(e.phase == "prefill" and not e.samples for e in chunks)
    assert other.token_ids == oracle(STD_PROMPTS[0], 10)
    assert_cache_empty(engine)


def test_cancel_while_decoding_streams_final_delta(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    p = STD_PROMPTS[2]

    def before(work):
        for s in work.plan.scheduled:
            if s.request.prompt_ids == p and s.phase == "decode" and len(s.request.output_ids) == 3:
                engine.cancel(s.request_id)

    rec = StepRecorder(engine, before=before)
    with engine:
        h, other = submit_together(engine, [p, STD_PROMPTS[1]], [100, 30])
        deltas = list(h)
        out = h.result(timeout=0)
        assert_no_blocks(engine, out.request_id)
        o2 = other.result(timeout=TIMEOUT)
    assert out.state == RequestState.CANCELLED
    assert deltas[-1].finished and deltas[-1].state == RequestState.CANCELLED
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert len(out.token_ids) == 3  # cancelled while its 4th token's step ran: that token is not delivered
    assert out.token_ids == oracle(p, len(out.token_ids))
    assert len(rec.entries(out.request_id)) <= 6
    assert o2.token_ids == oracle(STD_PROMPTS[1], 30)
    assert_cache_empty(engine)


@pytest.mark.parametrize("path", ["swap", "soft_reset"])
@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gemma3"])
def test_cancel_while_offloaded(name, path):
    # Cancel a request right after it was offloaded (pages on the host, or soft-reset and re-queued).
    model, oracle = tiny_model(name), oracle_for(name)
    engine = cbnb.Engine(model, config=config(page_size=8, num_blocks=12, max_batch_tokens=64,
                                              cpu_offload_space=0.001 if path == "swap" else 0))
    victim: dict = {}
    schedule = engine.core.schedule

    def spy_schedule():  # runs in the engine thread
        work = schedule()
        for d in work.offloads:
            if "rid" not in victim:
                assert d.path == path
                victim.update(rid=d.request.request_id, step=work.step_id, req=d.request,
                              swapped=d.request.swapped)
                engine.cancel(d.request.request_id)
        return work

    engine.core.schedule = spy_schedule
    rec = StepRecorder(engine)
    with engine:
        hs = submit_together(engine, STD_PROMPTS, STD_NEW)
        outs = {o.request_id: o for o in results(hs)}
    assert "rid" in victim, f"no request was offloaded ({path})"
    assert victim["swapped"] == (path == "swap")
    v = outs[victim["rid"]]
    assert v.state == RequestState.CANCELLED
    assert (v.num_offloads if path == "swap" else v.num_soft_resets) >= 1
    # It never ran again after being offloaded: the cancel reached it while it was off the device.
    later = [e for step in rec.steps for e in step if e.step_id > victim["step"] and e.request_id == v.request_id]
    assert later == []
    assert not victim["req"].swapped
    assert_no_blocks(engine, v.request_id)
    assert v.token_ids == oracle(v.prompt_token_ids, len(v.token_ids))
    for p, h in zip(STD_PROMPTS, hs):
        if h.request_id != v.request_id:
            o = outs[h.request_id]
            assert o.state == RequestState.FINISHED and o.token_ids == oracle(p, STD_NEW)
    assert_cache_empty(engine)


# ----------------------------------------------------------------------------------------------- forward exceptions
class InjectedFault(RuntimeError):
    pass


def _arm_layer_fault(model, armed: threading.Event) -> torch.utils.hooks.RemovableHandle:
    """Make the last decoder layer raise (once per arming) during a forward, after the earlier layers wrote K/V."""

    def hook(module, args, kwargs):
        if armed.is_set() and kwargs.get("cbnb_batch") is not None:
            armed.clear()
            raise InjectedFault("injected forward fault")

    return model.model.layers[-1].register_forward_pre_hook(hook, with_kwargs=True)


def test_forward_exception_fails_only_that_batch(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16, max_batch_tokens=32, max_requests_per_batch=2))
    marked = random_prompts([48], seed=41)[0]  # 3 full blocks; the first 32-token chunk runs fine
    armed = threading.Event()
    failed_batch: dict = {}

    def before(work):
        ids = [s.request_id for s in work.plan.scheduled]
        for s in work.plan.scheduled:
            if s.request.prompt_ids == marked and s.start == 32 and not failed_batch:
                failed_batch["rids"] = set(ids)
                armed.set()

    StepRecorder(engine, before=before)
    handle = _arm_layer_fault(model, armed)
    try:
        with engine:
            prompts = [marked, STD_PROMPTS[0], STD_PROMPTS[1], STD_PROMPTS[2], STD_PROMPTS[4]]
            hs = submit_together(engine, prompts, 10)
            outs = results(hs)
            assert engine.running and engine.error is None
            # The engine goes on; the marked prompt again hits the blocks its first (good) chunk registered.
            again = engine.generate([marked, STD_PROMPTS[3]], max_new_tokens=10, eos_token_id=-1, timeout=TIMEOUT)
    finally:
        handle.remove()
    rids = failed_batch["rids"]
    assert hs[0].request_id in rids and len(rids) <= 2
    for p, o in zip(prompts, outs):
        if o.request_id in rids:
            assert o.state == RequestState.FAILED and o.finish_reason == "error"
            assert "InjectedFault" in o.error and "injected forward fault" in o.error
        else:
            assert o.state == RequestState.FINISHED and o.token_ids == oracle(p, 10)
    assert len(rids) < len(prompts)
    _check_finished(oracle, [marked, STD_PROMPTS[3]], again, 10)
    assert again[0].prefix_cached_tokens == 32  # only the blocks of the successful chunk were cached
    assert_cache_empty(engine)


def test_repeated_forward_failures_stop_engine_with_error(llama):
    model, _ = llama
    attn = model.config._attn_implementation
    engine = cbnb.Engine(model, config=config(page_size=16, max_requests_per_batch=1))

    def before(work):
        raise InjectedFault(f"step {work.step_id} broke")

    StepRecorder(engine, before=before)
    hs = submit_together(engine, STD_PROMPTS, 5)
    thread = engine._thread
    outs = results(hs)
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert not engine.running
    assert isinstance(engine.error, InjectedFault)
    assert all(o.state == RequestState.FAILED for o in outs)
    died = [o for o in outs if o.error.startswith("engine died")]
    direct = [o for o in outs if not o.error.startswith("engine died")]
    assert len(direct) == 3 and len(died) == len(outs) - 3  # 3 consecutive failed steps of one request each
    for o in direct:
        assert o.error.startswith("InjectedFault: step") and "broke" in o.error
    for o in died:  # the cause is surfaced to the requests that never ran
        assert "consecutive failed steps" in o.error and "InjectedFault" in o.error
    assert model.config._attn_implementation == attn
    with pytest.raises(EngineStoppedError, match="died"):
        engine.submit([4, 5], max_new_tokens=2)
    with pytest.raises(EngineStoppedError, match="died"):
        engine.start()
    assert_cache_empty(engine)


def test_failure_counter_resets_after_a_good_step(llama):
    # Failures that are not consecutive never stop the engine.
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16, max_requests_per_batch=1))
    bad = {tuple(p) for p in random_prompts([6, 7, 8, 9], seed=42)}

    def before(work):
        if any(tuple(s.request.prompt_ids) in bad for s in work.plan.scheduled):
            raise InjectedFault("bad request")

    StepRecorder(engine, before=before)
    prompts = []
    for i, p in enumerate(random_prompts([6, 7, 8, 9], seed=42)):
        prompts += [p, STD_PROMPTS[i]]
    with engine:
        outs = results(submit_together(engine, prompts, 3))
        assert engine.running
    for i, (p, o) in enumerate(zip(prompts, outs)):
        if i % 2 == 0:
            assert o.state == RequestState.FAILED and "bad request" in o.error
        else:
            assert o.state == RequestState.FINISHED and o.token_ids == oracle(p, 3)


# ----------------------------------------------------------------------------------------------- after stop
def test_submit_after_stop_raises(llama):
    model, _ = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        engine.generate([[4, 5]], max_new_tokens=2, timeout=TIMEOUT)
    with pytest.raises(EngineStoppedError, match="stopped"):
        engine.submit([4, 5], max_new_tokens=2)
    with pytest.raises(EngineStoppedError):
        engine.generate([[4, 5]], max_new_tokens=2)
    assert isinstance(EngineStoppedError("x"), RuntimeError)
