"""The simulator under vLLM V1's policy (`scheduler_type="vllm"`) and cbnb's, on the same mixed traffic: where they
must agree and where they must differ, in the documented direction."""

from __future__ import annotations

import pytest

from cbnb.core.config import ContinuousBatchingConfig
from cbnb.core.requests import RequestState
from cbnb.lab import traffic as tr
from cbnb.lab.metrics import SLO
from cbnb.lab.tuning import run_workload
from cbnb.lab.workloads import synthetic
from cbnb.sim import SimEngine

# Long and short prompts mixed, Poisson arrivals: prefills and decodes compete for every step's token budget.
MIXED = synthetic("mixed", 120, tr.Poisson(20.0), tr.LogNormal(1000, 1.0, 32, 8000), tr.LogNormal(150, 0.8, 16, 600),
                  vocab_size=32000, seed=0)


def simulate(policy: str, **cfg):
    sim = SimEngine("llama-3.1-8b", "h100-sxm", ContinuousBatchingConfig(scheduler_type=policy, **cfg))
    run = run_workload(sim, MIXED, slo=SLO(ttft_s=1.0, tpot_s=0.05))
    assert all(r.finished for r in run.records)
    assert [r.output_tokens for r in run.records] == MIXED.max_new_tokens
    return sim, run.metrics


def test_with_room_in_the_cache_vllm_and_cbnb_fifo_make_the_same_steps():
    # Both run the running requests (decodes, then their prompt chunks) before admitting waiting ones, within the same
    # token budget: without cache pressure nothing else differs.
    a, ma = simulate("fifo", max_batch_tokens=512)
    b, mb = simulate("vllm", max_batch_tokens=512)
    assert [(s.start_s, s.end_s) for s in a.steps] == [(s.start_s, s.end_s) for s in b.steps]
    assert ma["ttft_s_p50"] == mb["ttft_s_p50"] and ma["tpot_s_p90"] == mb["tpot_s_p90"]


def test_decode_first_trades_ttft_for_tpot_against_prefill_first():
    # vLLM's documented effect of scheduling decodes before prefill chunks: better inter-token latency, the
    # prompts wait a little longer.
    _, v = simulate("vllm", max_batch_tokens=512)
    _, p = simulate("prefill_first", max_batch_tokens=512)
    assert v["tpot_s_p90"] < p["tpot_s_p90"] and v["itl_s_p99"] < p["itl_s_p99"]
    assert v["ttft_s_p50"] > p["ttft_s_p50"]


def test_under_cache_pressure_vllm_admits_sooner_and_preempts_where_cbnb_holds_newcomers_back():
    # 150 blocks of 256 tokens: vLLM admits while a block is free (watermark 0) and preempts the newest running
    # request by recompute when a decode cannot grow; cbnb's FIFO stops admitting below its 15 % safety margin, so
    # nothing is preempted. The prompts start sooner under vLLM's policy; the tokens of running requests come slower.
    fifo, f = simulate("fifo", num_blocks=150, max_batch_tokens=2048)
    vllm, v = simulate("vllm", num_blocks=150, max_batch_tokens=2048)
    assert f["soft_resets"] == 0 < v["soft_resets"] and v["recomputed_tokens"] > 0
    assert v["ttft_s_p50"] < f["ttft_s_p50"] and v["ttft_s_p90"] < f["ttft_s_p90"]
    assert v["tpot_s_p50"] > f["tpot_s_p50"] and v["tpot_s_p90"] > f["tpot_s_p90"]
    for out in vllm.outputs():  # preempted requests finished with all their tokens (checked in `simulate`)
        assert out.state == RequestState.FINISHED


def test_vllm_policy_is_selectable_by_config_and_validated():
    with pytest.raises(ValueError, match="scheduler_type must be one of 'fifo', 'prefill_first', 'vllm'"):
        ContinuousBatchingConfig(scheduler_type="vLLM")
    sim = SimEngine("llama-3.1-8b", "h100-sxm", ContinuousBatchingConfig(scheduler_type="vllm"))
    assert sim.core.scheduler.name == "vllm" and sim.config.safety_margin == 0.0
