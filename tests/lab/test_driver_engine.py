"""The driver and the run log on the real engine (a tiny random model): greedy tokens under timed arrivals equal
``model.generate``, token times are the engine's, and the run log survives reconfigure."""

from __future__ import annotations

import gc

import pytest

import cbnb
import cbnb.telemetry.runs
from cbnb.lab import traffic as tr
from cbnb.telemetry.runs import run_log
from cbnb.lab.tuning import reconfigure, run_workload
from cbnb.lab.workloads import synthetic

from helpers_engine import TIMEOUT, config, oracle_for, tiny_model

LLAMA = "tiny:llama"


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


def test_timed_run_matches_generate_and_records_engine_times():
    model, oracle = tiny_model(LLAMA), oracle_for(LLAMA)
    wl = synthetic("t", 6, tr.Poisson(20.0), tr.Uniform(4, 20), tr.Uniform(3, 8), vocab_size=512, seed=3)
    eng = cbnb.Engine(model, config=config(page_size=16))
    with eng:
        run = run_workload(eng, wl, timeout=TIMEOUT)
    assert run.metrics["requests_finished"] == 6 and run.engine == "cbnb"
    for rec, prompt, n in zip(run.records, wl.prompts, wl.max_new_tokens):
        assert rec.token_ids == oracle(prompt, n)
        assert len(rec.token_times_s) == n and rec.token_times_s == sorted(rec.token_times_s)
        assert rec.lateness_s >= 0 and rec.submitted_s >= rec.arrival_s
        # The engine's marks, in order: queued (inside submit) <= scheduled <= first token <= finished.
        assert rec.submitted_s <= rec.queued_s <= rec.scheduled_s <= rec.first_token_s <= rec.finished_s
        assert rec.first_token_s == rec.token_times_s[0] and rec.ttft_s > 0
    assert run.metrics["itl_s_p50"] > 0 and "mean_kv_usage_blocks_frac" in run.metrics


def test_run_log_survives_reconfigure_and_the_engine_records_every_reconfigure(tmp_path):
    model = tiny_model(LLAMA)
    wl = synthetic("t", 3, tr.Offline(), tr.Fixed(8), tr.Fixed(2), vocab_size=512)
    path = tmp_path / "runs.jsonl"
    eng = cbnb.Engine(model, config=config(page_size=16), runs=path)
    log = eng.runs  # made by the constructor, persisted to `path`
    assert run_log(eng) is log and log.path == str(path) and len(log) == 0
    with eng:
        first = run_workload(eng, wl, timeout=TIMEOUT)
        reconfigure(eng, eng.user_config.copy(page_size=32, num_blocks=32))  # the engine writes the entry
        eng.reconfigure(eng.user_config.copy(max_batch_tokens=64))  # a plain reconfigure is recorded too
        eng.reconfigure(eng.user_config)  # the same config again: a fresh cache, recorded as such
        with pytest.raises(MemoryError):
            eng.reconfigure(eng.user_config.copy(num_blocks=10**12))  # refused: nothing recorded
        eng.reset_stats()  # a new stats window, not an entry
        second = run_workload(eng, wl, timeout=TIMEOUT)
    assert eng.runs is log and [r.kind for r in log] == ["run", "reconfigure", "reconfigure", "reconfigure", "run"]
    assert log[0] is first and log[-1] is second and first.changes == {}
    assert log[1].changes == {"page_size": 32, "num_blocks": 32} and log[1].note == "num_blocks=32, page_size=32"
    assert log[2].note == "max_batch_tokens=64" and log[3].note == "same config (fresh cache)"
    assert second.changes == {"page_size": 32, "num_blocks": 32, "max_batch_tokens": 64}
    # A restarted notebook: a new engine on the same file has the history and appends after it.
    again = cbnb.Engine(model, config=config(page_size=16), runs=path)
    assert [r.kind for r in again.runs] == [r.kind for r in log] and again.runs.get(5).metrics == second.metrics
    again.reconfigure(again.user_config.copy(page_size=32))
    assert [r.id for r in cbnb.telemetry.runs.RunLog(path=path)] == [1, 2, 3, 4, 5, 6]
    # Or share one log between engines.
    shared = cbnb.Engine(model, config=config(page_size=16), runs=log)
    assert shared.runs is log


def test_transformers_peer_runs_the_same_timed_workload():
    """transformers' continuous batching behind the engine-like API: the same arrivals, its own timestamps, the
    same greedy tokens as cbnb, into the same run log; the cbnb engine on the shared model pauses meanwhile."""
    from cbnb.bench.engine_peer import HFContinuousBatching, compare_outputs

    gc.collect()  # engines of earlier tests on this cached model stop and give its attention back
    model = tiny_model(LLAMA)
    wl = synthetic("t", 5, tr.Poisson(20.0), tr.Uniform(4, 20), tr.Uniform(2, 6), vocab_size=512, seed=5)
    cfg = config(page_size=16, num_blocks=64, max_batch_tokens=64)
    eng = cbnb.Engine(model, config=cfg).start()
    try:
        ours = run_workload(eng, wl, timeout=TIMEOUT)
        with pytest.raises(RuntimeError, match="share_with"):
            HFContinuousBatching(model, cfg).start()
        with HFContinuousBatching(model, cfg, max_new_tokens=8, share_with=eng) as hf:
            assert not eng.running
            theirs = run_workload(hf, wl, log=eng.runs, timeout=TIMEOUT)
        assert eng.running  # restarted
        assert eng.generate([[5, 6, 7]], max_new_tokens=2)[0].state.name == "FINISHED"
    finally:
        eng.stop()
    assert theirs.engine == "hf-cb" and eng.runs[-1] is theirs and theirs.metrics["requests_finished"] == 5
    same = compare_outputs(ours, theirs)
    assert same["identical"] == 5 and same["agreement_frac"] == 1.0
    for rec in theirs.records:
        assert len(rec.token_times_s) == rec.output_tokens and rec.ttft_s > 0 and rec.lateness_s >= 0
        assert rec.queued_s <= rec.first_token_s <= rec.finished_s + 1e-6
