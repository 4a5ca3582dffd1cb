"""The driver and the run log on the real engine (a tiny random model): greedy tokens under timed arrivals equal
``model.generate``, token times are the engine's, and the run log survives reconfigure."""

from __future__ import annotations

import pytest

import cbnb
from cbnb import traffic as tr
from cbnb.runs import run_log
from cbnb.tuning import reconfigure, run_workload
from cbnb.workloads import synthetic

from helpers_engine import TIMEOUT, config, oracle_for, tiny_model, torch_threads

LLAMA = "tiny:llama"


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


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


def test_run_log_survives_reconfigure():
    model = tiny_model(LLAMA)
    wl = synthetic("t", 3, tr.Offline(), tr.Fixed(8), tr.Fixed(2), vocab_size=512)
    eng = cbnb.Engine(model, config=config(page_size=16))
    with eng:
        log = run_log(eng)
        first = run_workload(eng, wl, timeout=TIMEOUT)
        reconfigure(eng, eng.user_config.copy(page_size=32, num_blocks=32))
        eng.reconfigure(eng.user_config.copy(max_batch_tokens=64))  # a plain reconfigure keeps the log too
        second = run_workload(eng, wl, timeout=TIMEOUT)
    assert eng.runs is log and [r.id for r in log] == [1, 2, 3]
    assert log[0] is first and log[2] is second
    assert log[1].kind == "reconfigure" and log[1].changes["page_size"] == 32
    assert second.changes["page_size"] == 32 and second.changes["max_batch_tokens"] == 64
    assert first.changes == {}
