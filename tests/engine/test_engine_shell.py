"""One shell, two clocks: the same script against `cbnb.Engine` (the tiny model, wall clock) and `cbnb.sim.SimEngine`
(the same model's shape, cost model, virtual clock) gives the same event kinds in the same order, step ids that keep
increasing across reconfigures, and the same run segments (`cbnb.engine.shell.EngineShell`)."""

from __future__ import annotations

import inspect

import pytest

import cbnb
from cbnb.engine.engine_like import EngineLike, marks_runs, submit_keywords
from cbnb.sim import SimEngine
from cbnb.lab.traffic import Fixed, Offline
from cbnb.lab.tuning import run_workload
from cbnb.lab.workloads import synthetic

from helpers_engine import TIMEOUT, tiny_model
from helpers_server import wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CFG = dict(page_size=16, num_blocks=64, max_batch_tokens=32)
#: Events whose number depends on the clock, not on the decisions (KV samples are not events; none here).
CLOCKED: frozenset[str] = frozenset()


def script(eng) -> dict:
    """Submit, step, stream, cancel, reconfigure, reset_stats, explain, snapshot and a tuning-lab run."""
    out: dict = {}
    assert eng.pause() is True
    a = eng.submit(list(range(5, 45)), max_new_tokens=5, ignore_eos=True)
    b = eng.submit(list(range(50, 60)), max_new_tokens=3, ignore_eos=True)
    out["steps"] = [eng.step(timeout=TIMEOUT) for _ in range(3)]
    assert not a.done() and eng.paused
    eng.resume()
    out["streamed"] = sum(len(d.token_ids) for d in a)
    assert b.result(TIMEOUT).state.name == "FINISHED"
    eng.pause()
    c = eng.submit(list(range(70, 80)), max_new_tokens=4, ignore_eos=True)
    assert eng.cancel(c.request_id) is True
    assert c.result(TIMEOUT).state.name == "CANCELLED"
    eng.resume()
    eng.reconfigure(cbnb.ContinuousBatchingConfig(**{**CFG, "page_size": 32}))
    d, e = (eng.submit(list(range(90, 90 + n)), max_new_tokens=2, ignore_eos=True) for n in (20, 40))
    assert [h.result(TIMEOUT).state.name for h in (d, e)] == ["FINISHED", "FINISHED"]
    eng.reset_stats("second half")
    story = eng.explain(a)
    out["story"] = [x.kind for x in story.entries]
    snap = eng.snapshot()
    out["snapshot_blocks"] = len(snap.blocks) if hasattr(snap, "blocks") else None
    wl = synthetic("tiny", 3, Offline(), Fixed(12), Fixed(3), vocab_size=500, seed=1)
    run = run_workload(eng, wl, max_concurrency=1, submit_kwargs={"ignore_eos": True}, timeout=TIMEOUT)
    out["run_states"] = [r.state for r in run.records]
    out["stats_keys"] = sorted(eng.stats()["run"])
    return out


def story_of(eng) -> tuple[list[str], list[int], list[tuple[str, str]]]:
    events = eng.events.events()
    kinds = [ev.kind for ev in events if ev.kind not in CLOCKED]
    steps = [ev.step for ev in events if ev.kind == "step_planned"]
    segments = [(ev.cause, ev.label) for ev in events if ev.kind == "run_started"]
    return kinds, steps, segments


@pytest.fixture(scope="module")
def both():
    model = tiny_model("tiny:llama")
    eng = cbnb.Engine(model, config=cbnb.ContinuousBatchingConfig(**CFG))
    try:
        real = script(eng)
        real_log = story_of(eng)
    finally:
        eng.stop()
    sim = SimEngine(model.config, "l4", cbnb.ContinuousBatchingConfig(**CFG), dtype="float32", async_batching=False)
    simulated = script(sim)
    return (real, real_log), (simulated, story_of(sim))


def test_the_same_script_gives_the_same_events_steps_and_segments(both):
    (real, (kinds, steps, segments)), (simulated, (skinds, ssteps, ssegments)) = both
    assert real == simulated
    assert real["steps"] == [1, 2, 3] and real["streamed"] == 5 and real["run_states"] == ["FINISHED"] * 3
    assert kinds == skinds
    assert steps == ssteps and steps == sorted(set(steps)) and len(steps) > 10  # strictly increasing, no restart
    assert segments == ssegments
    assert [c for c, _ in segments] == ["reconfigure", "reset_stats", "workload"]
    for k in ("request_added", "step_planned", "step_timing", "state_change", "request_done", "run_started"):
        assert k in kinds, k


def test_both_engines_follow_the_protocol_and_take_the_same_submit_keywords():
    assert isinstance(SimEngine("qwen3-0.6b", "l4"), EngineLike)
    members = {n for n in dir(EngineLike) if not n.startswith("_")} | set(EngineLike.__annotations__)
    per_instance = {"tokenizer", "vocab_size", "max_positions"}  # set by Engine.__init__
    assert members - per_instance and all(hasattr(cbnb.Engine, n) for n in members - per_instance)
    real = set(inspect.signature(cbnb.Engine.submit).parameters)
    simulated = set(inspect.signature(SimEngine.submit).parameters)
    assert real <= simulated, f"SimEngine.submit lacks {sorted(real - simulated)}"
    assert simulated - real == {"arrival_s"}
    assert marks_runs(cbnb.Engine) and marks_runs(SimEngine)
    assert {"logprobs", "stop", "prompt_logprobs"} <= submit_keywords(cbnb.Engine)
    assert not {"logprobs", "stop", "prompt_logprobs"} & submit_keywords(SimEngine)
    sim = SimEngine("qwen3-0.6b", "l4")
    h = sim.submit([1, 2, 3], 2, temperature=0.7, do_sample=True, repetition_penalty=1.2, source="notebook")
    assert h.result().token_ids == [cbnb.sim.SIM_TOKEN] * 2 and h.result().source == "notebook"
    for kw, v in (("logprobs", 1), ("stop", ["x"]), ("prompt_logprobs", 0)):
        with pytest.raises(ValueError, match=kw):
            sim.submit([1, 2, 3], 2, **{kw: v})
    with pytest.raises(ValueError, match="top_p"):
        sim.submit([1, 2, 3], 2, top_p=7.0)


def test_a_simulation_steps_while_paused_on_its_playback_thread():
    sim = SimEngine("qwen3-0.6b", "l4")
    sim.start()
    try:
        assert sim.pause(timeout=TIMEOUT)
        h = sim.submit(list(range(100, 140)), 3)
        before = len(sim.events.events("step_planned"))
        sid = sim.step(timeout=TIMEOUT)
        planned = sim.events.events("step_planned")
        assert len(planned) == before + 1 and planned[-1].step == sid and not h.done()
        sim.set_step_rate(500)
        sim.resume()
        assert h.result(TIMEOUT).state.name == "FINISHED"
    finally:
        sim.stop()
    caller = SimEngine("qwen3-0.6b", "l4")
    caller.pause()
    h = caller.submit([1, 2, 3], 2)
    with pytest.raises(TimeoutError):
        h.result(timeout=0.2)  # a paused simulation holds its waiter (as a paused engine holds generate())
    assert caller.step() == 1 and caller.step() == 2 and caller.step() is None and h.done()


@pytest.mark.parametrize("kind", ["real", "sim"])
def test_submissions_show_pending_and_explain_while_paused_and_reconfigure_takes_keywords(kind):
    """On both engines: a request submitted to a paused engine is PENDING in `requests_snapshot` and has a story;
    `reconfigure(page_size=32)` changes the config in force; an unknown keyword is a ValueError naming it."""
    model = tiny_model("tiny:llama")
    cfg = cbnb.ContinuousBatchingConfig(**CFG)
    eng = (cbnb.Engine(model, config=cfg) if kind == "real"
           else SimEngine(model.config, "l4", cfg, dtype="float32", async_batching=False))
    try:
        first = eng.submit([1, 2, 3], 2)
        if kind == "sim":  # (the real engine's thread may already run it)
            assert [(o.request_id, o.state.name) for o in eng.requests_snapshot()] == [(first.request_id, "PENDING")]
        assert eng.pause() is True
        h = eng.submit([4, 5, 6], 2)
        shown = {o.request_id: o.state.name for o in eng.requests_snapshot()}
        assert shown[h.request_id] == "PENDING"
        # (the real engine's loop admits it on its next turn, paused or not: wait for that, not a fixed time)
        wait_until(lambda: "arrived with 3 prompt tokens" in eng.explain(h.request_id).text(), what="admitted")
        eng.resume()
        assert eng.reconfigure(page_size=32).page_size == 32 and eng.config.page_size == 32
        assert eng.config.num_blocks == eng.user_config.num_blocks  # the rest as it was
        with pytest.raises(ValueError, match="'pagesize' is not a ContinuousBatchingConfig field"):
            eng.reconfigure(pagesize=32)
        assert h.result(TIMEOUT).state.name == "FINISHED"
    finally:
        eng.stop()
