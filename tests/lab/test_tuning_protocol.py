"""The engine protocol of `cbnb.lab.driver` and `cbnb.lab.tuning`: the driver, metrics, run log, sweep, capacity and
`best` work with an engine-like object that has nothing more than the documented protocol, on a virtual clock (how the
simulator plugs in). The fake is a one-server FIFO queue in virtual time, so every latency is known by hand."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cbnb.core.config import ContinuousBatchingConfig
from cbnb.lab.metrics import SLO
from cbnb.telemetry.runs import RunLog
from cbnb.lab.tuning import best, measure_capacity, run_workload, sweep
from cbnb.lab.workloads import Workload

PREFILL_S, TPOT_S = 0.0625, 0.125  # binary fractions: every expected figure below is exact


class _Handle:
    """Only ``result``: the driver must not need ``request_id``, ``done`` or ``cancel``."""

    def __init__(self, sim: "QueueSim", out: SimpleNamespace) -> None:
        self._sim, self._out = sim, out

    def result(self, timeout=None):
        if self._sim.t < self._out.timings.finished:  # the driver asks only after clock.drain()
            raise RuntimeError("result() before the virtual clock reached the request's end")
        return self._out


class QueueSim:
    """Engine-like with only ``submit``: one request served at a time (prefill, then one token per TPOT)."""

    def __init__(self, t0: float = 10.0) -> None:
        self.t = t0
        self.free_at = t0
        self.driver_clock = VirtualClock(self)

    def tpot_s(self) -> float:
        return TPOT_S

    def submit(self, prompt, max_new_tokens=1, **kw):
        assert kw == {"ignore_eos": True}
        start = max(self.t, self.free_at)
        times = [start + PREFILL_S + k * self.tpot_s() for k in range(max_new_tokens)]
        self.free_at = times[-1]
        out = SimpleNamespace(token_ids=[1] * max_new_tokens, state="FINISHED", token_times=times,
                              timings=SimpleNamespace(queued=self.t, scheduled=start, first_token=times[0],
                                                      finished=times[-1]))
        return _Handle(self, out)


class VirtualClock:
    """The driver's virtual clock over a `QueueSim` (``threaded = False``)."""

    threaded = False

    def __init__(self, sim: QueueSim) -> None:
        self.sim = sim

    def now(self) -> float:
        return self.sim.t

    def sleep_until(self, t: float) -> None:
        self.sim.t = max(self.sim.t, t)

    def drain(self) -> None:
        self.sim.t = max(self.sim.t, self.sim.free_at)


class TunableSim(QueueSim):
    """Adds what `sweep` needs: ``user_config``, ``reconfigure``, ``engine_name``; TPOT grows with page_size."""

    engine_name = "sim"

    def __init__(self, records_reconfigures: bool = False) -> None:
        super().__init__()
        self.user_config = ContinuousBatchingConfig(page_size=16, num_blocks=64)
        self.records_reconfigures = records_reconfigures
        if records_reconfigures:
            self.runs = RunLog(base=self.user_config)
        self.reconfigured = 0

    def tpot_s(self) -> float:
        return TPOT_S * self.user_config.page_size / 16

    def start(self):
        raise AssertionError("on a virtual clock the caller drives the engine: start() must not be called")

    def reconfigure(self, config):
        old, self.user_config = self.user_config, config
        self.reconfigured += 1
        if self.records_reconfigures:
            self.runs.record_reconfigure(old, config, engine=self.engine_name)
        return config


def _workload(arrivals=(0.0, 0.125, 0.25, 2.0)):
    return Workload("hand", "none", [[1, 2, 3, 4]] * len(arrivals), [3] * len(arrivals), arrival_s=list(arrivals))


def test_driver_metrics_and_run_log_on_an_engine_with_only_submit():
    sim = QueueSim()
    run = run_workload(sim, _workload(), slo=SLO(ttft_s=0.3, tpot_s=0.125))  # the clock: sim.driver_clock
    recs = run.records
    # By hand: service 0.3125 s each (0.0625 prefill + 2 x 0.125); arrivals 0, 0.125, 0.25 queue, 2.0 does not.
    assert [r.submitted_s for r in recs] == [r.arrival_s for r in recs] == [0.0, 0.125, 0.25, 2.0]
    assert [r.ttft_s for r in recs] == [0.0625, 0.25, 0.4375, 0.0625]
    assert [r.queue_s for r in recs] == [0.0, 0.1875, 0.375, 0.0]
    assert [r.e2e_s for r in recs] == [0.3125, 0.5, 0.6875, 0.3125]
    assert all(r.tpot_s == 0.125 and r.itl_s == [0.125, 0.125] for r in recs)
    assert all(r.request_id is None and r.state == "FINISHED" for r in recs)
    m = run.metrics
    assert m["duration_s"] == 2.3125 and m["requests_finished"] == 4 and m["output_tokens"] == 12
    assert m["slo_met"] == 3  # the third request's TTFT (0.4375 s) misses 0.3 s
    assert m["goodput_requests_per_s"] == pytest.approx(3 / 2.3125)
    assert m["output_tokens_per_s"] == pytest.approx(12 / 2.3125)
    assert m["ttft_s_p50"] == 0.0625 and m["ttft_s_p99"] == 0.4375 and m["lateness_s_p99"] == 0.0
    # No stats(): no engine figures; no config: an empty one; the log was set on the object.
    assert "steps" not in m and run.config == {} and run.engine == "cbnb"
    assert isinstance(sim.runs, RunLog) and sim.runs[0] is run


def test_sweep_capacity_and_best_on_a_tunable_engine_like():
    sim = TunableSim()
    cap = measure_capacity(sim, _workload(), repeats=2)
    # Offline: 4 requests served one after the other, 0.3125 s each.
    assert cap["runs_requests_per_s"] == [pytest.approx(4 / 1.25)] * 2
    res = sweep(sim, _workload(), {"page_size": [16, 64]}, repeats=3, progress=False)
    assert [r.changes.get("page_size", 16) for r in res.runs] == [16, 64] * 3
    assert all(r.engine == "sim" for r in res.runs)
    # page_size=64: TPOT 0.5 s, so the queue behind the first request is longer.
    s = res.summary(["ttft_s_p99", "tpot_s_p50"])
    assert list(s["ttft_s_p99_median"]) == [0.4375, 0.0625 + 2 * (0.0625 + 2 * 0.5) - 0.25]
    assert list(s["tpot_s_p50_min"]) == list(s["tpot_s_p50_max"]) == [0.125, 0.5]
    v = best(res, "ttft_s_p99")
    assert not v.tie and v.winner == {"page_size": 16} and v.text.startswith("sim: page_size=16 wins")
    # Every reconfigure (2 between capacity repeats, one before each of the 6 sweep runs) is in the log, once.
    assert sim.reconfigured == 8 and len(sim.runs.runs("reconfigure")) == 8
    assert len(sim.runs.runs("run")) == 6  # capacity runs are not recorded


def test_an_engine_that_records_its_own_reconfigures_gets_no_second_entry():
    sim = TunableSim(records_reconfigures=True)
    res = sweep(sim, _workload(), {"page_size": [16, 32]}, repeats=2, progress=False)
    entries = sim.runs.runs("reconfigure")
    assert sim.reconfigured == 4 and len(entries) == 4 and len(res.runs) == 4
    assert [e.note for e in entries] == ["same config (fresh cache)", "page_size=32", "page_size=16", "page_size=32"]
    # A separate log given to the sweep gets the entries the engine cannot write there.
    other = RunLog()
    sweep(sim, _workload(), {"page_size": [16]}, repeats=1, progress=False, log=other)
    assert len(other.runs("reconfigure")) == 1 and len(other.runs("run")) == 1
    assert len(sim.runs.runs("reconfigure")) == 5 and len(sim.runs.runs("run")) == 4


def test_virtual_clock_order_is_sleep_now_submit_then_drain():
    calls = []

    class Recording(VirtualClock):
        def now(self):
            calls.append("now")
            return super().now()

        def sleep_until(self, t):
            calls.append(("sleep", t))
            super().sleep_until(t)

        def drain(self):
            calls.append("drain")
            super().drain()

    sim = QueueSim(t0=0.0)
    sim.driver_clock = Recording(sim)
    sub = sim.submit
    sim.submit = lambda *a, **kw: (calls.append("submit"), sub(*a, **kw))[1]
    run_workload(sim, _workload((0.0, 0.5)), log=False)
    assert calls == ["now", ("sleep", 0.0), "now", "submit", ("sleep", 0.5), "now", "submit", "drain"]


def test_a_clock_without_threaded_is_refused():
    with pytest.raises(TypeError, match="threaded"):
        run_workload(QueueSim(), _workload(), clock=SimpleNamespace(now=lambda: 0.0), log=False)
