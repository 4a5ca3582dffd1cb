"""Calibration from vLLM benchmark files: a ``vllm bench serve --save-result --save-detailed`` JSON written here with
vLLM 0.33's field names (vllm/benchmarks/serve.py) from synthetic simulator runs round-trips into a fitted profile
whose predictions reproduce those runs; the fit's error and leave-one-out error are reported and carried by the
profile's provenance."""

from __future__ import annotations

import json
import math

import pytest

from cbnb.lab import traffic as tr
from cbnb.sim import SimEngine
from cbnb.measure.fit_vllm import FIGURES, fit_profile, predict, read_vllm_result
from cbnb.sim.profiles import load_profile
from cbnb.lab.tuning import run_workload
from cbnb.lab.workloads import synthetic, with_arrivals

SHAPE = "llama-3.1-8b"
#: The "device" the synthetic runs were made on: the h100 datasheet profile with other efficiencies and step cost.
TRUE = load_profile("h100-sxm").replace(flops_efficiency=0.45, bandwidth_efficiency=0.6, step_overhead_s=0.003,
                                        step_overhead_graph_s=0.0009)
#: The fit's starting point: the h100 datasheet figures with the assumed efficiencies and step cost the bundled
#: profile had before it was fitted to the public vLLM points.
STOCK = load_profile("h100-sxm").replace(flops_efficiency=0.7, bandwidth_efficiency=0.85, step_overhead_s=0.001,
                                         step_overhead_graph_s=0.0003, provenance={})


def _write_vllm(path, run, rate, conc):
    """One run in vLLM 0.33's result format (the keys `vllm bench serve` writes with --save-detailed)."""
    recs = run.records
    m = run.metrics
    data = {
        "date": "20261202-000000", "endpoint_type": "vllm", "backend": "vllm", "label": None,
        "model_id": "meta-llama/Llama-3.1-8B-Instruct", "tokenizer_id": "meta-llama/Llama-3.1-8B-Instruct",
        "num_prompts": len(recs), "request_rate": "inf" if rate is None else rate, "burstiness": 1.0,
        "max_concurrency": conc, "duration": m["duration_s"], "completed": m["requests_finished"], "failed": 0,
        "total_input_tokens": sum(r.prompt_tokens for r in recs), "total_output_tokens": m["output_tokens"],
        "request_throughput": m["requests_per_s"], "output_throughput": m["output_tokens_per_s"],
        "input_lens": [r.prompt_tokens for r in recs], "output_lens": [r.output_tokens for r in recs],
        "ttfts": [r.ttft_s for r in recs], "itls": [r.itl_s for r in recs], "latencies": [r.e2e_s for r in recs],
        "start_times": [5000.0 + r.submitted_s for r in recs],
        "queue_times": [r.submitted_s - r.arrival_s for r in recs], "errors": ["" for _ in recs],
        "generated_texts": ["" for _ in recs], "median_ttft_ms": 1000 * m["ttft_s_p50"],
    }
    path.write_text(json.dumps(data))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("vllm")
    wl = synthetic("v", 16, tr.Offline(), tr.LogNormal(300, 0.5, 16, 1024), tr.LogNormal(16, 0.5, 2, 48),
                   vocab_size=128000, seed=4)
    out = []
    for name, rate, conc in [("c1", None, 1), ("c8", None, 8), ("r10", 10.0, None)]:
        w = wl if rate is None else with_arrivals(wl, tr.Poisson(rate))
        run = run_workload(SimEngine(SHAPE, TRUE), w, log=False, max_concurrency=conc)
        out.append(_write_vllm(d / f"{name}.json", run, rate, conc))
    return out


def test_reads_the_vllm_fields(files, tmp_path):
    r = read_vllm_result(files[1])
    assert r.max_concurrency == 8 and math.isinf(r.request_rate) and r.arrival_s == [0.0] * 16
    assert len(r.input_lens) == len(r.itls) == 16 and r.failed == 0
    rr = read_vllm_result(files[2])
    assert rr.request_rate == 10.0 and rr.max_concurrency is None and rr.arrival_s[0] == 0.0
    assert rr.arrival_s == sorted(rr.arrival_s) and rr.arrival_s[-1] > 0
    # Replaying on the profile that made the runs gives the runs back.
    for f in files:
        run = read_vllm_result(f)
        pred = predict(run, SHAPE, TRUE)
        for k in FIGURES:
            assert pred[k] == pytest.approx(run.measured[k], rel=1e-6)
    data = json.loads(open(files[0]).read())
    del data["ttfts"]
    bad = tmp_path / "summary-only.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="'ttfts'.*--save-detailed"):
        read_vllm_result(bad)


def test_fitted_profile_reproduces_the_runs_it_was_made_from(files):
    stock = [predict(read_vllm_result(f), SHAPE, STOCK) for f in files]
    fit = fit_profile(files, SHAPE, STOCK, leave_one_out=True, max_evals=35)
    # The datasheet profile is off by far more than the fit.
    stock_err = max(abs(p[k] / read_vllm_result(f).measured[k] - 1) for p, f in zip(stock, files) for k in FIGURES)
    assert stock_err > 0.2
    assert fit.error_pct < 3.0 and fit.loo_error_pct is not None and fit.loo_error_pct < 8.0
    for row in fit.per_run:
        for k in FIGURES:
            assert row["predicted"][k] == pytest.approx(row["measured"][k], rel=0.06)
    prov = fit.profile.trust()
    assert prov["kind"] == "fitted" and prov["runs"] == 3 and prov["error_pct"] == fit.error_pct
    assert prov["loo_error_pct"] == fit.loo_error_pct and "fitted" in prov["what"]
    assert fit.profile.name == "h100-sxm-fitted" and "leave-one-out" in fit.report()
    # The fitted profile is a profile: a SimEngine on it predicts, and its runs carry the provenance.
    sim = SimEngine(SHAPE, fit.profile)
    wl = synthetic("check", 4, tr.Offline(), tr.Fixed(64), tr.Fixed(4), vocab_size=128000)
    run = run_workload(sim, wl, log=False)
    assert run.provenance["kind"] == "fitted" and run.provenance["profile"] == "h100-sxm-fitted"
    assert "not vLLM" in run.provenance["scheduler"]
