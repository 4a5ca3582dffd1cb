"""The driver honours arrival times and records per-request latencies (fake engine: no timed speed assertion)."""

from __future__ import annotations

import os
import random
import threading

import pytest

from cbnb.lab import traffic as tr
from cbnb.lab.driver import Driver, WallClock
from cbnb.lab.metrics import summarize
from cbnb.lab.workloads import synthetic

from fake_engine import FakeEngine, StepClock

#: How late (seconds) a submission may be at p99 on a loaded 2-core CI box. A parameter of the test, not a speed
#: claim: the property under test is "never early, and on time within this tolerance".
LATENESS_TOLERANCE_S = float(os.environ.get("CBNB_LATENESS_TOLERANCE_S", "0.25"))


def _workload(n=30, rate=40.0, seed=0):
    return synthetic("t", n, tr.Poisson(rate), tr.Uniform(2, 6), tr.Fixed(3), vocab_size=64, seed=seed)


def test_wall_clock_never_submits_early_and_is_on_time():
    wl = _workload()
    eng = FakeEngine()
    d = Driver(eng, wl)
    records = d.run(timeout=60)
    assert len(eng.submits) == wl.num_requests
    # The engine's own record of when submit() was called, against each request's scheduled time.
    by_prompt = {tuple(p): t for t, p in eng.submits}
    late = []
    for i, p in enumerate(wl.prompts):
        scheduled = d.t0 + wl.arrival_s[i]
        assert by_prompt[tuple(p)] >= scheduled, f"request {i} submitted {scheduled - by_prompt[tuple(p)]:.6f} s early"
        late.append(by_prompt[tuple(p)] - scheduled)
    assert all(r.lateness_s is not None and r.lateness_s >= 0 for r in records)
    late.sort()
    p99 = late[min(len(late) - 1, int(0.99 * len(late)))]
    assert p99 <= LATENESS_TOLERANCE_S, f"p99 lateness {p99:.4f} s > tolerance {LATENESS_TOLERANCE_S} s"
    m = summarize(records)
    assert m["lateness_s_p99"] <= LATENESS_TOLERANCE_S and m["requests_finished"] == wl.num_requests


def test_submission_order_follows_arrivals_not_list_order():
    wl = synthetic("t", 5, tr.Offline(), tr.Fixed(2), tr.Fixed(1), vocab_size=64)
    wl = type(wl)(wl.name, wl.model, wl.prompts, wl.max_new_tokens, arrival_s=[0.04, 0.0, 0.02, 0.0, 0.01])
    eng = FakeEngine()
    Driver(eng, wl).run(timeout=30)
    assert [tuple(p) for _, p in eng.submits] == [tuple(wl.prompts[i]) for i in (1, 3, 4, 2, 0)]


def test_virtual_clock_runs_inline_and_latencies_are_exact():
    clock = StepClock()
    wl = _workload(n=8, rate=2.0)
    eng = FakeEngine(clock=clock.now, latency=lambda cfg, i: (0.05, 0.25, 0.02))
    d = Driver(eng, wl, clock=clock)
    d.start()
    assert threading.active_count() >= 1 and d._thread is None  # no driver thread on a virtual clock
    recs = d.wait()
    assert clock.sleeps == [100.0 + a for a in sorted(wl.arrival_s)]
    for r in recs:
        assert r.lateness_s == pytest.approx(0.0)
        assert r.ttft_s == pytest.approx(0.25) and r.queue_s == pytest.approx(0.05)
        assert r.tpot_s == pytest.approx(0.02) and r.itl_s == pytest.approx([0.02, 0.02])
        assert r.e2e_s == pytest.approx(0.25 + 2 * 0.02)
    m = summarize(recs)
    assert m["itl_s_p50"] == pytest.approx(0.02) and m["ttft_s_p99"] == pytest.approx(0.25)


def test_refused_submission_is_recorded_and_the_rest_go_on():
    clock = StepClock()
    wl = _workload(n=6, rate=5.0)
    eng = FakeEngine(clock=clock.now, fail_every=3)
    recs = Driver(eng, wl, clock=clock).run()
    failed = [r for r in recs if r.state == "FAILED"]
    assert len(failed) == 2 and all("prompt rejected" in r.error for r in failed)
    assert sum(r.finished for r in recs) == 4
    m = summarize(recs)
    assert m["requests_failed"] == 2 and m["requests_finished"] == 4


def test_timeout_cancels_what_is_left():
    class Stuck(FakeEngine):
        def submit(self, prompt, max_new_tokens=1, **kw):
            h = super().submit(prompt, max_new_tokens, **kw)

            def never(timeout=None):
                ev = threading.Event()
                if not ev.wait(timeout):
                    raise TimeoutError("stuck")

            h.result = never
            h.done = lambda: False
            return h

    eng = Stuck()
    wl = _workload(n=3, rate=1000.0)
    d = Driver(eng, wl)
    with pytest.raises(TimeoutError):
        d.run(timeout=0.3)
    assert d._stop.is_set()


def test_time_scale_and_arguments():
    clock = StepClock()
    wl = _workload(n=4, rate=1.0)
    d = Driver(FakeEngine(clock=clock.now), wl, clock=clock, time_scale=0.5)
    d.run()
    assert [r.arrival_s for r in d.records] == pytest.approx([a * 0.5 for a in wl.arrival_s])
    with pytest.raises(ValueError, match="time_scale"):
        Driver(FakeEngine(), wl, time_scale=0)
    with pytest.raises(RuntimeError, match="already ran"):
        d.start()


def test_wallclock_sleep_until_is_never_early():
    c = WallClock()
    rng = random.Random(0)
    for _ in range(20):
        target = c.now() + rng.uniform(0, 0.003)
        c.sleep_until(target)
        assert c.now() >= target
