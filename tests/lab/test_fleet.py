"""`plan_fleet`: the cheapest simulated fleet (GPU kind x tensor-parallel size x replicas) that meets an SLO, with the
profile's error band."""

from __future__ import annotations

import pytest

from cbnb.lab import traffic as tr
from cbnb.lab.fleet import error_band, plan_fleet
from cbnb.lab.metrics import SLO
from cbnb.lab.workloads import synthetic

TRAFFIC = synthetic("fleet", 60, tr.Poisson(6.0), tr.LogNormal(1000, 0.8, 32, 6000), tr.LogNormal(120, 0.6, 16, 400),
                    vocab_size=32000, seed=0)
SLO_ = SLO(ttft_s=0.5, tpot_s=0.05)


def test_the_cheapest_fleet_meeting_the_slo_is_the_first_that_meets_it_in_cost_order():
    kw = dict(tensor_parallel=(1, 2, 4, 8), replicas=(1, 2))
    full = plan_fleet("llama-3.1-70b", TRAFFIC, SLO_, exhaustive=True, **kw)
    fast = plan_fleet("llama-3.1-70b", TRAFFIC, SLO_, **kw)
    assert full.best is not None and fast.best is not None
    assert fast.best.candidate == full.best.candidate
    assert len(fast.runs) < len(full.runs)
    cheapest = min(r.cost for r in full.runs if r.meets)
    assert full.best.cost == cheapest and full.best.metrics["slo_attainment_pct"] >= 90
    # TP 1 cannot hold 141 GB of weights on one 80 GiB H100: listed as not fitting, never chosen
    tp1 = [r for r in full.runs if r.candidate.tensor_parallel_size == 1]
    assert tp1 and all(r.meets is None and "does not fit" in r.error for r in tp1)
    # cheaper candidates that fit missed the SLO
    assert all(r.meets is False for r in full.runs if r.cost < cheapest and r.meets is not None)
    text = str(fast)
    assert str(fast.best.candidate) in text and "Error band: datasheet: unverified" in text
    assert fast.band_pct is None and fast.best.robust is None
    cmds = full.best.commands("meta-llama/Llama-3.1-70B")
    tp, n = full.best.candidate.tensor_parallel_size, full.best.candidate.replicas
    assert len(cmds) == n + 1 and cmds[-1].startswith("# router: least_loaded")
    assert all(f"--tensor-parallel-size {tp}" in c and "vllm serve meta-llama/Llama-3.1-70B" in c for c in cmds[:-1])
    assert cmds[0].startswith("CUDA_VISIBLE_DEVICES=" + ",".join(map(str, range(tp)))) and "--port 8000" in cmds[0]
    rows = fast.table()
    assert {"fleet", "gpus", "meets_slo", "ttft_s_p90"} <= set(rows[0])


def test_prices_rank_the_candidates_and_an_unmeetable_slo_says_so():
    ans = plan_fleet("llama-3.1-70b", TRAFFIC, SLO(ttft_s=0.001, tpot_s=0.001), tensor_parallel=(4,), replicas=(1,),
                     gpu_hour_usd={"h100-sxm": 2.5})
    assert ans.best is None and ans.runs[0].cost == 10.0
    assert str(ans).startswith("No simulated fleet met TTFT <= 0.001 s and TPOT <= 1 ms")
    with pytest.raises(ValueError, match="gpu_hour_usd has no price for 'h200'"):
        plan_fleet("llama-3.1-70b", TRAFFIC, SLO_, gpus=("h100-sxm", "h200"), gpu_hour_usd={"h100-sxm": 2.5})


def test_bad_input_is_named():
    empty = synthetic("empty", 1, tr.Offline(), tr.Fixed(8), tr.Fixed(2), vocab_size=100)
    empty.prompts.clear()
    with pytest.raises(ValueError, match="workload has no requests"):
        plan_fleet("llama-3.1-70b", empty, SLO_)
    with pytest.raises(ValueError, match=r"attainment_pct must be in \(0, 100\]"):
        plan_fleet("llama-3.1-70b", TRAFFIC, SLO_, attainment_pct=0)


def test_error_band_of_a_profile_without_a_measured_error():
    text, pct = error_band("h100-sxm")
    assert pct is None and text.startswith("datasheet: unverified")
