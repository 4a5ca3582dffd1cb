"""Traps of the tuning lab that must be clear errors or loud warnings, never silent wrong answers (issue 22)."""

from __future__ import annotations

import warnings

import pytest

from cbnb import tuning
from cbnb.core.config import ContinuousBatchingConfig as C
from cbnb.telemetry.runs import RunLog
from cbnb.sim import HardwareProfile, SimEngine
from cbnb.lab.traffic import Fixed, Offline, Poisson, Uniform
from cbnb.lab.tuning import best, run_workload, sweep
from cbnb.lab.workloads import get_workload, synthetic, with_arrivals


# ------------------------------------------------------------------------------------------------ workloads
def test_a_bare_number_as_arrivals_says_what_to_pass():
    with pytest.raises(TypeError, match=r"arrivals must be an arrival process.*Poisson\(20.0\)"):
        synthetic("x", 4, 20.0, Fixed(8), Fixed(4))
    with pytest.raises(TypeError, match=r"prompt_len must be a length distribution.*Fixed\(8\)"):
        synthetic("x", 4, Poisson(2.0), 8, Fixed(4))
    wl = synthetic("x", 4, Offline(), Fixed(8), Fixed(4))
    with pytest.raises(TypeError, match="Poisson"):
        with_arrivals(wl, 3)


def test_a_shared_prefix_without_a_fraction_is_shared_by_all():
    wl = synthetic("x", 6, Offline(), Fixed(8), Fixed(4), shared_prefix_tokens=40)
    assert wl.traffic["shared_requests"] == 6 and all(p[:40] == wl.prompts[0][:40] for p in wl.prompts)
    half = synthetic("x", 6, Offline(), Fixed(8), Fixed(4), shared_prefix_tokens=40, shared_fraction=0.5)
    assert half.traffic["shared_requests"] == 3
    with pytest.warns(UserWarning, match="no request"):
        none = synthetic("x", 6, Offline(), Fixed(8), Fixed(4), shared_prefix_tokens=40, shared_fraction=0.0)
    assert none.traffic["shared_requests"] == 0
    with pytest.warns(UserWarning, match="shares nothing"):
        synthetic("x", 6, Offline(), Fixed(8), Fixed(4), shared_fraction=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        synthetic("x", 6, Offline(), Fixed(8), Fixed(4))  # no prefix, no fraction: nothing to say
    with pytest.raises(ValueError, match="shared_prefix_tokens must be an integer >= 0"):
        synthetic("x", 6, Offline(), Fixed(8), Fixed(4), shared_prefix_tokens=-1)


def test_get_workload_fits_the_engines_vocabulary():
    sim = SimEngine("llama-3.1-8b", "h100-sxm")
    wl = get_workload("nanovllm-256", scale=0.05, engine=sim)
    assert max(max(p) for p in wl.prompts) < sim.vocab_size == 128256
    assert get_workload("nanovllm-256", scale=0.05).prompts != wl.prompts  # qwen3's 151,936 ids otherwise
    with pytest.raises(ValueError, match=r"vocab_size must be <= the engine's vocabulary \(128256\)"):
        get_workload("nanovllm-256", scale=0.05, engine=sim, vocab_size=151936)
    with pytest.raises(ValueError, match="engine must have an integer vocab_size"):
        get_workload("cpu-32", engine=object())


# ------------------------------------------------------------------------------------------------ failed runs
def test_a_run_with_failed_requests_warns_with_the_count_and_first_error():
    sim = SimEngine("llama-3.1-8b", "h100-sxm")
    wl = get_workload("nanovllm-256", scale=0.05)  # ids up to 151,936: outside llama's vocabulary
    with pytest.warns(UserWarning, match=r"\d+ of 13 requests .* FAILED.*outside the vocabulary"):
        run = run_workload(sim, wl, log=False)
    assert run.metrics["requests_failed"] > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ok = run_workload(sim, get_workload("nanovllm-256", scale=0.05, engine=sim), log=False)
    assert ok.metrics["requests_failed"] == 0


def _run(log: RunLog, change: dict, value: float, failed: int = 0, repeat: int = 0):
    records = [{"state": "FAILED", "error": "boom"}] * failed + [{"state": "FINISHED", "error": None}]
    return log.add("run", engine="cbnb", config=C(**change), metrics={"goodput_requests_per_s": value,
                   "requests_failed": failed}, records=records, repeat=repeat)


def test_best_skips_points_whose_runs_had_failures_and_says_so():
    log = RunLog(base=C())
    a = [_run(log, {"page_size": 16}, 9.0, failed=3, repeat=r) for r in range(2)]
    b = [_run(log, {"page_size": 32}, 5.0, repeat=r) for r in range(2)]
    c = [_run(log, {"page_size": 64}, 2.0, repeat=r) for r in range(2)]
    v = best([a, b, c], "goodput_requests_per_s")
    assert v.winner == {"page_size": 32} and not v.tie
    assert [r[0] for r in v.ranking] == ["page_size=32", "page_size=64"]
    assert v.skipped == [("page_size=16", "6 failed requests over 2 runs; first: boom")]
    assert "Skipped 1 point: page_size=16 (6 failed requests" in v.text
    only = best([a, b], "goodput_requests_per_s")
    assert only.winner == {"page_size": 32} and "only point left" in only.text and "not a comparison" in only.text
    with pytest.raises(ValueError, match="no run without failed requests"):
        best([a, [_run(log, {"page_size": 8}, 1.0, failed=1)]], "goodput_requests_per_s")


# ------------------------------------------------------------------------------------------------ sweeps
def _tiny(sim):
    return synthetic("tiny", 6, Offline(), Uniform(16, 64), Fixed(8), vocab_size=sim.vocab_size)


def test_a_point_that_does_not_fit_is_recorded_and_the_sweep_goes_on():
    sim = SimEngine("llama-3.1-8b", "h100-sxm", C(page_size=16, num_blocks=512))
    with pytest.warns(UserWarning, match=r"1 of 2 runs could not run \(num_blocks=10000000\).*MemoryError"):
        res = sweep(sim, _tiny(sim), {"num_blocks": [512, 10**7]}, repeats=1, progress=False)
    assert len(res.runs) == 1 and res.runs[0].changes.get("num_blocks", 512) == 512
    assert res.failed == [{"point": 1, "repeat": 0, "workload": "", "change": "num_blocks=10000000",
                           "error": res.failed[0]["error"]}] and res.failed[0]["error"].startswith("MemoryError")
    assert sim.config.num_blocks == 512  # the engine kept the config that fits
    v = best(res, "output_tokens_per_s")
    assert v.skipped[0][0] == "num_blocks=10000000" and "could not run: MemoryError" in v.text


def test_other_errors_keep_the_partial_sweep_reachable(monkeypatch):
    sim = SimEngine("llama-3.1-8b", "h100-sxm", C(page_size=16, num_blocks=512))
    real, calls = tuning.run_workload, []

    def flaky(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise TimeoutError("the run did not end")
        return real(*a, **k)

    monkeypatch.setattr(tuning, "run_workload", flaky)
    with pytest.raises(TimeoutError) as err:
        sweep(sim, _tiny(sim), {"page_size": [16, 32]}, repeats=1, progress=False)
    assert len(err.value.sweep_result.runs) == 1


def test_an_exact_tie_lists_at_most_five_points():
    sim = SimEngine("llama-3.1-8b", "h100-sxm", C(page_size=16, num_blocks=512))
    res = sweep(sim, _tiny(sim), {"seed": list(range(8))}, repeats=1, progress=False)  # seeds change nothing here
    v = best(res, "output_tokens_per_s")
    assert v.tie and len(v.tied_with) == 7
    assert "and 2 more" in v.text and v.text.count("seed=") == 1 + tuning.TIE_LIST_MAX


# ------------------------------------------------------------------------------------------------ simulator
def test_a_dtype_the_profile_cannot_time_is_refused_at_construction():
    cpu = HardwareProfile(name="f32-cpu", kind="cpu", runner="cpu", memory_bytes=4 << 30,
                          peak_flops={"float32": 1e11}, memory_bandwidth=2e10, host_device_bandwidth=2e10,
                          step_overhead_s=1e-4, step_overhead_graph_s=1e-4, kernel_launch_s=1e-6)
    with pytest.raises(ValueError, match=r"dtype must be one profile 'f32-cpu' has FLOP/s for \(float32\); "
                                         r"got bfloat16.*dtype='float32'"):
        SimEngine("smollm2-135m", cpu)  # the shape's dtype is bfloat16
    sim = SimEngine("smollm2-135m", cpu, C(page_size=16, num_blocks=64), dtype="float32")
    assert sim.shape.dtype == "float32"
    run = run_workload(sim, get_workload("cpu-32", scale=0.1, engine=sim), log=False)
    assert run.metrics["requests_failed"] == 0


# ------------------------------------------------------------------------------------------------ no silent answer
def test_an_empty_workload_is_an_error_not_an_exact_tie_at_zero():
    from cbnb.lab.workloads import Workload

    sim = SimEngine("llama-3.1-8b", "h100-sxm", C(page_size=16, num_blocks=512))
    empty = Workload("empty", "llama-3.1-8b", [], [])
    res = sweep(sim, empty, {"page_size": [16, 32]}, repeats=1, progress=False)
    with pytest.raises(ValueError, match=r"every run has 0 requests: the workload is empty.*give it requests"):
        best(res, "output_tokens_per_s")
    # one empty point among real ones is skipped with the reason
    groups = [res.runs[:1], sweep(sim, _tiny(sim), {"page_size": [16, 32]}, repeats=1, progress=False).runs[:1],
              sweep(sim, _tiny(sim), {"page_size": [64]}, repeats=1, progress=False).runs]
    v = best(groups, "output_tokens_per_s")
    assert "no requests: its workload is empty" in v.text and len(v.ranking) == 2


def test_an_slo_no_run_met_says_so_and_which_slo():
    from cbnb.lab.metrics import SLO

    sim = SimEngine("llama-3.1-8b", "h100-sxm", C(page_size=16, num_blocks=512))
    res = sweep(sim, _tiny(sim), {"page_size": [16, 32]}, repeats=1, progress=False,
                slo=SLO(ttft_s=1e-6, tpot_s=1e-6))
    with pytest.warns(UserWarning, match="No run met the SLO"):
        v = best(res, "goodput_requests_per_s")
    assert v.winner is None and "Exact tie" not in v.text
    assert "No run met the SLO (TTFT <= 1e-06 s and TPOT <= 0.001 ms)" in v.text and "Loosen the SLO" in v.text


def test_an_unknown_figure_lists_the_valid_names():
    sim = SimEngine("llama-3.1-8b", "h100-sxm", C(page_size=16, num_blocks=512))
    res = sweep(sim, _tiny(sim), {"page_size": [16, 32]}, repeats=1, progress=False)
    with pytest.raises(ValueError, match=r"unknown figure 'ttft_p99'.*Did you mean 'ttft_s_p99'.*Valid names: .*"
                                         r"goodput_requests_per_s.*ttft_s_p99") as err:
        best(res, "ttft_p99")
    assert "failed request" not in str(err.value)  # not blamed on failed requests


def test_a_cpu_profile_calibrated_at_another_model_is_not_called_calibrated_for_this_one():
    from cbnb.lab.tuning import provenance

    cal = HardwareProfile(name="cpu", kind="cpu", runner="cpu", memory_bytes=16 << 30,
                          peak_flops={"float32": 1e11, "bfloat16": 1e11}, memory_bandwidth=2e10,
                          host_device_bandwidth=2e10, step_overhead_s=1e-4, step_overhead_graph_s=1e-4,
                          kernel_launch_s=1e-6, sources={"gemm_flops": "measured by cbnb.measure.calibrate (torch)"},
                          notes="calibrated at shape smollm2-135m (float32) with 2 threads, torch")
    same = SimEngine("smollm2-135m", cal, C(page_size=16, num_blocks=64), dtype="float32")
    t = provenance(same)
    assert t["kind"] == "calibrated" and t["error_pct"] is not None  # the validated band applies
    other = SimEngine("qwen3-0.6b", cal, C(page_size=16, num_blocks=64), dtype="float32")
    with pytest.warns(UserWarning, match=r"calibrated on this CPU at smollm2-135m \(float32\), used here for "
                                         r"qwen3-0.6b \(float32\).*calibrate\('qwen3-0.6b'\)"):
        t = provenance(other)
    assert t["error_pct"] is None and t["details"]["other_model"] == "smollm2-135m (float32)"
    with pytest.warns(UserWarning, match="used here for smollm2-135m \\(bfloat16\\)"):
        provenance(SimEngine("smollm2-135m", cal, C(page_size=16, num_blocks=64), dtype="bfloat16"))
    from cbnb.telemetry.runs import provenance_text
    assert provenance_text(t) == "calibrated at smollm2-135m (float32), not this model: unverified"
    # best applies no validated tie band to such runs
    with pytest.warns(UserWarning):
        res = sweep(other, get_workload("cpu-32", scale=0.1, engine=other), {"page_size": [16, 32]}, repeats=1,
                    progress=False)
    assert best(res, "output_tokens_per_s").model_error_pct is None
