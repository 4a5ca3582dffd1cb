"""Step-by-step mode: `Engine.pause`, `step`, `resume` and the slow-motion cap (`set_step_rate`), in both loops."""

from __future__ import annotations

import time

import pytest
import torch

import cbnb
from cbnb.engine.inbox import EngineStoppedError

from helpers_engine import TIMEOUT, assert_cache_empty, async_engine, oracle_for, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = dict(page_size=16, num_blocks=64, max_batch_tokens=16)


def planned(engine, since):
    events, cursor, _ = engine.events.since(since)
    return [e for e in events if e.kind == "step_planned"], cursor


def states(engine):
    return {o.request_id: o.state.name for o in engine.requests_snapshot()}


@pytest.fixture(params=["sync", "async"])
def engine(request):
    cfg = cbnb.ContinuousBatchingConfig(**CFG)
    if request.param == "async":
        # Its own copy of the weights: the CUDA runner's attention is the model's only while no CPU engine of an
        # earlier test still routes that model (the implementation is set per model).
        from cbnb.engine.models import load_model

        eng = async_engine(load_model("tiny:llama", dtype=torch.float32, device="cpu")[0], cfg)
    else:
        eng = cbnb.Engine(tiny_model("tiny:llama"), config=cfg)
    yield eng
    eng.stop()


def test_one_step_is_exactly_one_step_planned_and_walks_a_lone_prompt(engine):
    """A lone 40-token prompt under max_batch_tokens=16: PENDING, then 3 chunks (PREFILLING, PREFILLING, its last
    chunk samples: DECODING), decodes, FINISHED; every step() call plans exactly one step."""
    assert engine.pause() is True  # before start: the loop starts held
    engine.start()
    assert engine.pause(timeout=TIMEOUT) and engine._loop.parked.is_set()
    prompt = list(range(5, 45))
    h = engine.submit(prompt, max_new_tokens=4, eos_token_id=-1)
    time.sleep(0.2)  # the loop admits it while paused, and plans nothing
    cursor = 0
    steps, cursor = planned(engine, cursor)
    assert steps == [] and states(engine) == {h.request_id: "PENDING"}
    seen = []
    for _ in range(20):
        sid = engine.step(timeout=TIMEOUT)
        new, cursor = planned(engine, cursor)
        if sid is None:
            assert new == []  # nothing to run: no step planned
            break
        assert [e.step for e in new] == [sid]  # exactly one StepPlanned per step()
        assert engine.paused and engine._loop.parked.wait(TIMEOUT)
        taken = new[0].taken
        seen.append((taken[0][1], taken[0][2], states(engine).get(h.request_id, "FINISHED")))
    assert seen == [("prefill", 16, "PREFILLING"), ("prefill", 16, "PREFILLING"), ("prefill", 8, "DECODING"),
                    ("decode", 1, "DECODING"), ("decode", 1, "DECODING"), ("decode", 1, "FINISHED")]
    out = h.result(TIMEOUT)
    assert out.token_ids == oracle_for("tiny:llama")(prompt, 4)  # stepping changes nothing computed


def test_paused_loop_admits_cancels_and_reconfigures(engine):
    engine.start()
    engine.pause(timeout=TIMEOUT)
    a = engine.submit(list(range(5, 25)), max_new_tokens=6, eos_token_id=-1)
    b = engine.submit(list(range(7, 27)), max_new_tokens=6, eos_token_id=-1)
    first = engine.step(timeout=TIMEOUT)
    assert first is not None
    assert b.cancel() and b.result(TIMEOUT).state.name == "CANCELLED"  # cancel wins while paused
    with pytest.raises(TimeoutError, match=r"1 of 1 requests .* The engine is paused: engine.resume\(\)"):
        engine.generate([[9, 10, 11]], max_new_tokens=2, timeout=0.05)  # a paused engine says why it waits
    engine.reconfigure(engine.config.copy(max_batch_tokens=32), timeout=TIMEOUT)
    assert engine.paused and engine.config.max_batch_tokens == 32
    cursor = engine.events.cursor
    time.sleep(0.2)
    assert planned(engine, cursor)[0] == []  # still held after the rebuild
    second = engine.step(timeout=TIMEOUT)
    assert second == first + 1  # step numbers go on across a reconfigure
    engine.resume()
    assert not engine.paused
    out = a.result(TIMEOUT)
    assert out.state.name == "FINISHED" and len(out.token_ids) == 6
    assert_cache_empty(engine)


def test_stop_while_paused_drains_and_then_refuses_steps():
    eng = cbnb.Engine(tiny_model("tiny:llama"), config=cbnb.ContinuousBatchingConfig(**CFG))
    eng.pause()
    h = eng.submit(list(range(5, 30)), max_new_tokens=3, eos_token_id=-1)
    eng.stop(drain=True, timeout=TIMEOUT)  # a stop overrides the pause: what was submitted runs to its end
    assert h.result(TIMEOUT).state.name == "FINISHED"
    with pytest.raises(EngineStoppedError):
        eng.step()


def test_resume_with_single_steps_pending_releases_them():
    eng = cbnb.Engine(tiny_model("tiny:llama"), config=cbnb.ContinuousBatchingConfig(**CFG))
    with eng:
        assert eng.step(timeout=TIMEOUT) is None  # no request: nothing to step
        eng.resume()
        assert eng.generate([list(range(5, 20))], max_new_tokens=2, timeout=TIMEOUT)[0].state.name == "FINISHED"


def test_slow_motion_caps_the_step_rate_and_checks_its_value():
    eng = cbnb.Engine(tiny_model("tiny:llama"), config=cbnb.ContinuousBatchingConfig(**CFG))
    for bad in (-1, 1001, "fast", True):
        with pytest.raises(ValueError, match="steps_per_s"):
            eng.set_step_rate(bad)
    with eng:
        eng.set_step_rate(20)
        assert eng.step_rate == 20.0
        t0 = time.monotonic()
        out = eng.generate([list(range(5, 20))], max_new_tokens=10, eos_token_id=-1, timeout=TIMEOUT)[0]
        elapsed = time.monotonic() - t0
        steps = sum(1 for e in eng.events.events("step_planned"))
        assert out.state.name == "FINISHED" and steps == 10, (out.state.name, out.error, steps)
        # A cap, not a speed: 10 steps at <= 20 per second take at least 9 intervals of 50 ms.
        assert elapsed >= 9 / 20 - 0.01, elapsed
        eng.set_step_rate(0)
        assert eng.step_rate is None
