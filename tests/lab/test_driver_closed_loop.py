"""Closed loop (``max_concurrency=C``): exactly C requests in flight, the next submitted when one ends, on the
simulator (virtual clock, synchronous and async batching) and on the real engine (wall clock)."""

from __future__ import annotations

import pytest

from cbnb.lab import traffic as tr
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.lab.driver import Driver
from cbnb.sim import SimEngine
from cbnb.lab.tuning import run_workload
from cbnb.lab.workloads import synthetic


def _in_flight_at_steps(events, n_requests: int) -> list[int]:
    """Requests admitted and not ended (from the event log) when each step was planned, up to the last admission."""
    n = adds = 0
    out = []
    for e in events:
        if e.kind == "request_added":
            n += 1
            adds += 1
        elif e.kind == "request_done":
            n -= 1
        elif e.kind == "step_planned" and adds < n_requests:
            out.append(n)
    return out


def _max_in_flight(events) -> int:
    n = mx = 0
    for e in events:
        n += (e.kind == "request_added") - (e.kind == "request_done")
        mx = max(mx, n)
    return mx


def _client_in_flight(records, t: float) -> int:
    return sum(1 for r in records if r.submitted_s <= t < r.finished_s)


def _sim(async_batching: bool) -> SimEngine:
    return SimEngine("llama-3.1-8b", "h100-sxm", ContinuousBatchingConfig(max_memory_percent=0.3),
                     async_batching=async_batching)


WL = synthetic("closed", 60, tr.Offline(), tr.Uniform(20, 200), tr.Uniform(5, 60), vocab_size=128000, seed=1)


@pytest.mark.parametrize("async_batching", [False, True])
def test_sim_closed_loop_keeps_exactly_c_in_flight(async_batching):
    C = 8
    sim = _sim(async_batching)
    run = run_workload(sim, WL, max_concurrency=C)
    recs = run.records
    assert run.metrics["requests_finished"] == 60 and run.workload["max_concurrency"] == C
    ev = sim.events.events()
    assert _max_in_flight(ev) == C
    steps = _in_flight_at_steps(ev, 60)
    assert steps and max(steps) == C
    if not async_batching:  # the driver resubmits before the next step is planned: every step sees C
        assert set(steps) == {C}
    # (With async batching step N+1 is planned before step N's ends are applied, so a step may see fewer: the
    # engine's view lags the client's by a step, as on the real engine.)
    # The client's view: every request after the first C is sent at the instant an earlier one ended.
    ends = sorted(r.finished_s for r in recs)
    starts = sorted(r.submitted_s for r in recs)
    assert starts[:C] == [0.0] * C
    for k, s in enumerate(starts[C:]):
        assert s in ends and s == ends[k]  # the k-th end frees the slot of the (C + k)-th request
    for t in starts[C:]:
        assert _client_in_flight(recs, t) == C
    # Open loop on the same engine admits everything at once.
    sim2 = _sim(async_batching)
    run_workload(sim2, WL)
    assert _max_in_flight(sim2.events.events()) == 60


def test_closed_loop_with_a_rate_waits_for_both_the_arrival_and_a_slot():
    sim = _sim(False)
    wl = synthetic("rated", 30, tr.Poisson(50.0), tr.Uniform(20, 100), tr.Uniform(20, 80), vocab_size=128000)
    recs = Driver(sim, wl, clock=sim.driver_clock, max_concurrency=2).run()
    for r in recs:
        assert r.submitted_s >= r.arrival_s - 1e-12
    assert _max_in_flight(sim.events.events()) == 2


def test_max_concurrency_must_be_a_positive_integer():
    sim = _sim(False)
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="max_concurrency"):
            Driver(sim, WL, clock=sim.driver_clock, max_concurrency=bad)


def test_real_engine_closed_loop_keeps_c_in_flight():
    import cbnb
    from helpers_engine import TIMEOUT, config, oracle_for, tiny_model, torch_threads

    C = 3
    wl = synthetic("closed-real", 10, tr.Offline(), tr.Uniform(4, 16), tr.Uniform(2, 6), vocab_size=512, seed=5)
    with torch_threads(1):
        model, oracle = tiny_model("tiny:llama"), oracle_for("tiny:llama")
        eng = cbnb.Engine(model, config=config(page_size=16))
        with eng:
            run = run_workload(eng, wl, max_concurrency=C, timeout=TIMEOUT)
            ev = eng.events.events()
    recs = run.records
    assert run.metrics["requests_finished"] == 10
    for rec, prompt, n in zip(recs, wl.prompts, wl.max_new_tokens):
        assert rec.token_ids == oracle(prompt, n)
    # Never more than C in flight, by the engine's own log and by the client's marks; C reached.
    assert _max_in_flight(ev) == C
    for r in recs:
        assert _client_in_flight(recs, r.submitted_s) <= C
    # Each request after the first C was sent after an earlier one ended (the k-th end frees the (C+k)-th slot).
    ends = sorted(r.finished_s for r in recs)
    starts = sorted(r.submitted_s for r in recs)
    for k, s in enumerate(starts[C:]):
        assert s >= ends[k]


def test_runs_at_different_concurrencies_are_different_points_in_the_log():
    sim = _sim(False)
    wl = synthetic("pts", 6, tr.Offline(), tr.Fixed(32), tr.Fixed(3), vocab_size=128000)
    for c in (1, 1, 3):
        run_workload(sim, wl, max_concurrency=c)
    run_workload(sim, wl)
    groups = sim.runs.groups()
    assert sorted(len(g) for g in groups) == [1, 1, 2]  # C=1 twice (repeats), C=3 once, open loop once
    assert {g[0].workload["max_concurrency"] for g in groups} == {1, 3, None}
