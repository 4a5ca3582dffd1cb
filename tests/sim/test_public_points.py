"""The public vLLM points the GPU profiles are fitted to: every one cited and replayable, and the fit's
leave-one-out machinery (the full fit is ``python -m cbnb.measure.validate --gpu``, minutes: not a test)."""

from __future__ import annotations

import pytest

from cbnb.measure.public import GPUS, fit_public, load_points, predict_point
from cbnb.sim.profiles import load_profile


def test_every_point_names_its_source_model_gpu_precision_version_and_settings():
    pts = load_points()
    assert len(pts) >= 6 and {p.gpu for p in pts} == set(GPUS)
    for p in pts:
        assert p.source.startswith("https://"), p.id
        for key in ("model", "engine", "benchmark", "as_read", "gpu_as_reported", "tensor_parallel"):
            assert p.info.get(key), (p.id, key)
        assert p.dtype == "bfloat16" and p.info["tensor_parallel"] == 1
        assert p.measured and all(v > 0 for v in p.measured.values())
        if p.kind == "serve":
            assert len(p.input_lens) == len(p.output_lens) > 0


def test_a_point_replays_on_its_own_gpu_with_the_fitted_factors():
    h200 = next(p for p in load_points() if p.id == "vllm-ci-latency-h200")
    slow = load_profile("h100-sxm").replace(bandwidth_efficiency=0.3, flops_efficiency=0.3)
    shape, prof, dtype = h200.replay_on(slow)
    assert prof.memory_bandwidth == load_profile("h200").memory_bandwidth and prof.bandwidth_efficiency == 0.3
    assert (shape, dtype) == ("llama-3.1-8b", "bfloat16")
    fast, slower = predict_point(h200, "h100-sxm"), predict_point(h200, slow)
    assert slower["duration_s"] > fast["duration_s"] > 0


def test_the_fit_reports_a_leave_one_out_error_per_point():
    pts = [p for p in load_points() if p.kind == "latency"]
    fit = fit_public(pts, max_evals=6)
    assert [r["id"] for r in fit.rows] == [p.id for p in pts]
    for r in fit.rows:
        assert set(r["loo_errors_pct"]) == set(r["measured"]) == {"duration_s"}
    assert fit.band()["points"] == 3 and fit.median_loo_pct == pytest.approx(
        sorted(abs(e) for r in fit.rows for e in r["loo_errors_pct"].values())[1])
    text = fit.report()
    assert "median |leave-one-out error|" in text and all(p.source.split()[0] in text for p in pts)


def test_the_error_band_each_kind_of_profile_carries():
    assert load_profile("l4").error_band() == "datasheet: unverified"
    fitted = load_profile("l4").replace(provenance={"kind": "fitted", "runs": 6, "error_pct": 3.0,
                                                    "loo_error_pct": 5.6, "details": {"public": True}})
    assert fitted.error_band() == "±6 % on 6 held-out public points"
    mine = fitted.replace(provenance={"kind": "fitted", "runs": 4, "loo_error_pct": 3.2})
    assert mine.error_band() == "±3 % leave-one-out on 4 vLLM runs"


def test_a_simulators_dashboard_says_its_error_band():
    pytest.importorskip("ipywidgets")
    from cbnb.sim import SimEngine
    from cbnb.ui import Dashboard

    sim = SimEngine("llama-3.1-8b", "l4")
    d = Dashboard(sim, start=False)
    try:
        assert d.controls.message == "Simulated on l4: datasheet: unverified."
    finally:
        d.close()
