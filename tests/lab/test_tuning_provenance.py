"""Every prediction says how far to trust it: runs and sweeps carry the profile's provenance, and `best` calls a tie
when simulated points differ by less than the profile's error."""

from __future__ import annotations

from cbnb.lab import traffic as tr
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.lab.runs import Run
from cbnb.sim import SimEngine
from cbnb.sim.profiles import VALIDATION, load_profile
from cbnb.lab.tuning import best, provenance, run_workload, sweep
from cbnb.lab.workloads import synthetic

WL = synthetic("prov", 24, tr.Poisson(40.0), tr.LogNormal(300, 0.5), tr.LogNormal(24, 0.5, 2, 64),
               vocab_size=128000, seed=3)
GRID = {"max_batch_tokens": [256, 2048]}


def _sim(profile="h100-sxm"):
    return SimEngine("llama-3.1-8b", profile, ContinuousBatchingConfig(max_memory_percent=0.3))


def test_datasheet_runs_say_so_and_the_summary_shows_it(capsys):
    sim = _sim()
    res = sweep(sim, WL, GRID, repeats=1)
    out = capsys.readouterr().out
    assert "datasheet (unverified)" in out and "not vLLM" in out  # said where the user reads the sweep
    prov = res.provenance
    assert prov["kind"] == "datasheet" and prov["profile"] == "h100-sxm" and prov["error_pct"] is None
    assert set(res.summary()["prediction"]) == {"datasheet (unverified)"}
    v = best(res, "ttft_s_p50")
    assert v.model_error_pct is None and "datasheet profile" in v.text
    # The provenance survives the run log's JSON.
    run = res.runs[0]
    assert Run.from_dict(run.to_dict()).provenance == run.provenance
    # So do the definitions of its figures (goodput over the run and over its steady-state window).
    assert "steady-state window" in run.definitions["goodput_steady_requests_per_s"]
    assert Run.from_dict(run.to_dict()).definitions == run.definitions
    assert "goodput_steady_requests_per_s" in run.metrics


def _fitted(err):
    return load_profile("h100-sxm").replace(name="h100-fit", provenance={"kind": "fitted", "runs": 3,
                                                                         "error_pct": err / 2, "loo_error_pct": err})


def test_best_ties_points_closer_than_the_profiles_error():
    res = sweep(_sim(), WL, GRID, repeats=1, progress=False)
    a, b = (r.metrics["ttft_s_p50"] for r in res.runs)
    gap_pct = 100 * abs(a - b) / max(a, b)
    assert gap_pct > 1  # the two configs do differ
    wide = sweep(_sim(_fitted(2 * gap_pct)), WL, GRID, repeats=1, progress=False)
    v = best(wide, "ttft_s_p50")
    assert v.tie and v.winner is None and v.model_error_pct == 2 * gap_pct  # leave-one-out error applies
    assert "Tie within the model's error" in v.text and "fitted from 3 runs" in v.text
    narrow = sweep(_sim(_fitted(gap_pct / 2)), WL, GRID, repeats=1, progress=False)
    v = best(narrow, "ttft_s_p50")
    assert not v.tie and v.winner is not None and "leads by more than the profile's error" in v.text


def test_provenance_of_each_kind():
    assert provenance(object()) == {"kind": "measured"}
    cpu = load_profile("h100-sxm").replace(name="my-cpu", kind="cpu", runner="cpu")
    assert cpu.trust()["kind"] == "custom" and cpu.trust()["error_pct"] is None
    measured = cpu.replace(sources={"gemm_flops": "measured by cbnb.measure.calibrate (torch): GEMMs"})
    t = measured.trust()
    assert t["kind"] == "calibrated" and t["error_pct"] == VALIDATION["wall_error_pct_max"]
    run = run_workload(_sim(), synthetic("one", 2, tr.Offline(), tr.Fixed(32), tr.Fixed(2), vocab_size=128000),
                       log=False)
    assert run.provenance["kind"] == "datasheet" and "config" in run.provenance["what"]
