"""The run log (changes vs base, DataFrame/JSON, persistence, survives reconfigure), interleaved sweeps with repeats,
and `best` (a winner only outside the noise). Fake engine on a virtual clock: nothing here depends on speed."""

from __future__ import annotations

import json

import pytest

from cbnb.lab import traffic as tr
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.telemetry.runs import Run, RunLog, run_log
from cbnb.lab.tuning import best, reconfigure, run_workload, sweep
from cbnb.lab.workloads import synthetic

from fake_engine import FakeEngine, StepClock


def _wl(n=6):
    return synthetic("t", n, tr.Poisson(4.0), tr.Fixed(4), tr.Fixed(3), vocab_size=64)


def test_run_log_records_changes_and_round_trips(tmp_path):
    base = ContinuousBatchingConfig(page_size=16)
    log = RunLog(base=base, path=tmp_path / "runs.jsonl")
    a = log.add("run", config=base, workload={"name": "w"}, metrics={"goodput_requests_per_s": 1.5})
    b = log.add("run", config=base.copy(page_size=64, safety_margin=0.2), workload={"name": "w"},
                metrics={"goodput_requests_per_s": 1.2, "ttft_s_p99": float("nan")})
    log.record_reconfigure(base, base.copy(page_size=64))
    assert (a.id, b.id) == (1, 2) and a.changes == {} and a.change == "base"
    assert b.changes == {"page_size": 64, "safety_margin": 0.2} and b.change == "page_size=64, safety_margin=0.2"
    assert b.metrics["ttft_s_p99"] is None  # NaN is not JSON
    df = log.to_frame()
    assert list(df["kind"]) == ["run", "run", "reconfigure"] and df.loc[1, "page_size"] == 64
    again = RunLog.from_json(log.to_json())
    assert [r.to_dict() for r in again] == [r.to_dict() for r in log]
    # Persisted: a new log on the same file (a restarted notebook) has the history, and appends after it.
    reopened = RunLog(path=tmp_path / "runs.jsonl")
    assert len(reopened) == 3 and reopened.get(2).changes == b.changes
    assert reopened.add("run", config=base, workload={"name": "w"}).id == 4
    assert len(RunLog(path=tmp_path / "runs.jsonl")) == 4
    # The file keeps its base: reopened with another one, changes are still measured against page_size=16.
    other = RunLog(base=base.copy(page_size=64), path=tmp_path / "runs.jsonl")
    assert other.base["page_size"] == 16 and other.add("run", config=base.copy(page_size=64)).changes == {
        "page_size": 64}
    saved = tmp_path / "saved.jsonl"
    log.save(saved)
    assert RunLog(path=saved).base == log.base and len(RunLog(path=saved)) == 3
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "kind": "run"}\nnot json\n')
    with pytest.raises(ValueError, match="line 1"):
        RunLog(path=tmp_path / "bad.jsonl")
    with pytest.raises(KeyError, match="no run with id 99"):
        log.get(99)


def test_run_workload_lands_in_the_engine_log_with_metrics_and_records():
    clock = StepClock()
    eng = FakeEngine(clock=clock.now)
    run = run_workload(eng, _wl(), clock=clock, label="first")
    assert eng.runs is run_log(eng) and eng.runs[0] is run
    assert run.kind == "run" and run.engine == "cbnb" and run.label == "first"
    assert run.workload["arrivals"] == {"kind": "poisson", "rate": 4.0} and run.workload["requests"] == 6
    assert run.metrics["requests_finished"] == 6 and run.metrics["ttft_s_p50"] == pytest.approx(0.1)
    assert run.metrics["mean_kv_fragmentation_frac"] == pytest.approx(0.1)  # from engine.stats()
    assert len(run.records) == 6 and json.loads(json.dumps(run.to_dict(include_records=True)))


def test_sweep_interleaves_points_round_robin_and_summarises_spread():
    clock = StepClock()
    seen = []

    def latency(cfg, i):
        seen.append(cfg.page_size)
        return 0.0, 0.1 * cfg.page_size / 16, 0.01

    eng = FakeEngine(clock=clock.now, latency=latency)
    res = sweep(eng, _wl(n=2), {"page_size": [16, 32, 64]}, repeats=3, progress=False, clock=clock,
                derive=lambda c: {"num_blocks": 1024 // c["page_size"]})
    # Round robin: 16, 32, 64, 16, 32, 64, ... (two requests per run).
    assert seen == [p for _ in range(3) for p in (16, 16, 32, 32, 64, 64)]
    assert [(r.point, r.repeat) for r in res.runs] == [(p, k) for k in range(3) for p in range(3)]
    assert res.runs[1].changes == {"page_size": 32, "num_blocks": 32}
    # A fresh cache for every run: one reconfigure per run, each in the log.
    assert eng.reconfigures == 9 and len(eng.runs.runs("reconfigure")) == 9
    s = res.summary(["ttft_s_p50"])
    assert list(s["n"]) == [3, 3, 3] and list(s["page_size"]) == [16, 32, 64]
    assert s.loc[0, "change"] == "num_blocks=64, page_size=16"
    assert list(s["ttft_s_p50_median"]) == pytest.approx([0.1, 0.2, 0.4])
    v = best(res, "ttft_s_p50")
    assert not v.tie and v.winner == {"page_size": 16, "num_blocks": 64} and "num_blocks=64, page_size=16 wins" in v.text
    with pytest.raises(ValueError, match="repeats"):
        sweep(eng, _wl(), {"page_size": [16]}, repeats=0)


def _group(change, values, figure="goodput_requests_per_s"):
    return [Run(i, "run", "cbnb", {}, change, {"name": "w"}, {figure: v}) for i, v in enumerate(values)]


def test_best_says_tie_when_ranges_overlap():
    groups = [_group({"page_size": 16}, [1.50, 1.10, 1.40]), _group({"page_size": 64}, [1.30, 1.20, 1.35])]
    v = best(groups, "goodput_requests_per_s")
    assert v.tie and v.winner is None and v.tied_with == ["page_size=64"]
    assert v.text.startswith("Tie within noise on goodput (req/s)")
    assert "1.400 [1.100-1.500]" in v.text and "1.300 [1.200-1.350]" in v.text
    assert v.ranking[0][0] == "page_size=16"


def test_best_names_a_winner_when_ranges_do_not_overlap():
    groups = [_group({"page_size": 16}, [1.50, 1.45, 1.60]), _group({"page_size": 64}, [1.30, 1.20, 1.35]),
              _group({"page_size": 128}, [0.5, 0.6, 0.7])]
    v = best(groups, "goodput_requests_per_s")
    assert not v.tie and v.winner == {"page_size": 16}
    assert "page_size=16 wins" in v.text and "runner-up page_size=64" in v.text and "3 runs each" in v.text
    # Lower is better for latencies: the same numbers as TTFT pick page_size=128.
    lat = [_group(g[0].changes, [r.metrics["goodput_requests_per_s"] for r in g], "ttft_s_p99") for g in groups]
    assert best(lat, "ttft_s_p99").winner == {"page_size": 128}
    # A third point overlapping the winner makes it a tie even when the runner-up is clear.
    wide = groups + [_group({"page_size": 32}, [0.9, 1.0, 1.55])]
    assert best(wide, "goodput_requests_per_s").tie
    one = best([_group({"a": 1}, [2.0]), _group({"a": 2}, [1.0])], "goodput_requests_per_s")
    assert not one.tie and "provisional" in one.text
    with pytest.raises(ValueError, match="at least two"):
        best([_group({"a": 1}, [2.0])], "goodput_requests_per_s")


def test_reconfigure_helper_records_into_the_log():
    eng = FakeEngine()
    log = run_log(eng)
    reconfigure(eng, eng.user_config.copy(page_size=32))
    (entry,) = log.runs("reconfigure")
    assert entry.changes == {"page_size": 32} and "page_size=32" in entry.note


def test_sweep_over_two_loads_interleaves_workloads_and_points():
    clock = StepClock()
    seen = []
    eng = FakeEngine(clock=clock.now, latency=lambda cfg, i: (0.0, 0.1 * cfg.page_size / 16, 0.01))
    orig_submit = eng.submit

    def submit(prompt, max_new_tokens=1, **kw):
        seen.append((len(prompt), eng.user_config.page_size))
        return orig_submit(prompt, max_new_tokens, **kw)

    eng.submit = submit
    light = synthetic("t", 1, tr.Poisson(1.0), tr.Fixed(4), tr.Fixed(2), vocab_size=64)
    heavy = synthetic("t", 1, tr.Poisson(5.0), tr.Fixed(6), tr.Fixed(2), vocab_size=64)
    res = sweep(eng, {"light": light, "heavy": heavy}, {"page_size": [16, 64]}, repeats=2, progress=False,
                warmup=False, clock=clock)
    # Per repeat: light x (16, 64), then heavy x (16, 64).
    assert seen == [(4, 16), (4, 64), (6, 16), (6, 64)] * 2
    assert [r.workload["label"] for r in res.runs[:4]] == ["light", "light", "heavy", "heavy"]
    s = res.summary(["ttft_s_p50"])
    assert list(s["load"]) == ["light", "light", "heavy", "heavy"] and list(s["n"]) == [2, 2, 2, 2]
    assert res.best("ttft_s_p50", workload="heavy").winner == {"page_size": 16}
    assert len(res.groups("light")) == 2
    with pytest.raises(ValueError, match="name one with workload="):
        res.best("ttft_s_p50")
