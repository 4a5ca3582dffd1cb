"""`python -m cbnb.measure.validate`: argument errors, and one small real comparison (plans identical, figures present;
no accuracy is asserted: timing depends on the machine's load)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest


def test_unknown_workload_is_an_argument_error():
    out = subprocess.run([sys.executable, "-m", "cbnb.measure.validate", "--workloads", "cpu-32,nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown nope" in out.stderr and "long-gen" in out.stderr


def test_repeat_must_be_at_least_one():
    from cbnb.measure.validate import validate_workload

    with pytest.raises(ValueError, match="repeat must be an integer >= 1"):
        validate_workload("cpu-32", "cpu", repeat=0)


@pytest.mark.slow
def test_validate_workload_small_cpu32_has_identical_plans():
    pytest.importorskip("torch")
    from cbnb.measure.validate import validate_workload

    from helpers_sim import TEST_CPU

    r = validate_workload("cpu-32", TEST_CPU, scale=0.1, repeat=2)
    assert r["plans_identical"]
    walls = r["measured_walls_s"]
    assert len(walls) == 2 and r["measured_wall_s"] == pytest.approx(sum(walls) / 2)  # the median of two
    assert r["steps"] == len(r["per_step"]) > 0
    assert r["measured_wall_s"] > 0 and r["predicted_wall_s"] > 0
    assert all(math.isfinite(r[k]) for k in ("wall_error", "median_step_error", "p90_step_error"))
    step, measured, predicted, phases, parts = r["per_step"][0]
    assert measured > 0 and predicted > 0 and len(phases) == 4 and "linear" in parts


def test_predict_prints_the_gpu_prediction_without_torch():
    code = ("import sys\nfor m in ('torch', 'transformers'): sys.modules[m] = None\n"
            "from cbnb.measure.validate import main\nmain(['--predict', 'h200'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "nanovllm-256 (256 requests at t=0) on h200" in text and "qwen3-0.6b bfloat16" in text
    from cbnb.sim.profiles import load_profile
    assert f"Profile h200: {load_profile('h200').error_band()}" in text and "output tok/s" in text  # the profile's error band


def test_predict_names_an_unknown_profile():
    from cbnb.measure.validate import predict

    with pytest.raises(ValueError, match="h900"):
        predict("nanovllm-256", "h900", scale=0.05)


def test_predict_figures_come_from_the_simulation():
    from cbnb.sim import SimEngine
    from cbnb.measure.validate import predict
    from cbnb.lab.workloads import get_workload

    p = predict("nanovllm-256", "h200", scale=0.05)
    wl = get_workload("nanovllm-256", scale=0.05)
    sim = SimEngine("qwen3-0.6b", "h200")
    for pr, n in zip(wl.prompts, wl.max_new_tokens):
        sim.submit(pr, n)
    sim.run()
    assert p["requests"] == wl.num_requests and p["steps"] == len(sim.steps) and p["wall_s"] == sim.now
    assert p["output_tokens_per_s"] == pytest.approx(sum(wl.max_new_tokens) / sim.now)


def test_replay_costs_a_real_plan_step_by_step():
    from types import SimpleNamespace

    from cbnb.sim import CostModel, StepLoad, load_shape
    from cbnb.measure.validate import _replay_costs

    from helpers_sim import TEST_CPU

    cost = CostModel(load_shape("smollm2-135m", dtype="float32"), TEST_CPU)
    # step 1: a's first chunk (no sample: the prompt is 100 long) and b's last chunk; step 2: a decodes
    # step 3: both decode, b reading 96 tokens of a prefix a read first
    planned = {1: SimpleNamespace(taken=[("a", "prefill", 64, 0, 0), ("b", "prefill", 36, 64, 0)], shared_tokens=[]),
               2: SimpleNamespace(taken=[("a", "decode", 1, 100, 0)], shared_tokens=[]),
               3: SimpleNamespace(taken=[("a", "decode", 1, 101, 0), ("b", "decode", 1, 100, 0)],
                                  shared_tokens=[0, 96])}
    got = _replay_costs(planned, {1: 0.1, 2: 0.01, 3: 0.01}, {"a": 100, "b": 100}, cost)
    assert got[1] == cost.step(StepLoad.of([(0, 64, False), (64, 36, True)])).total_s
    assert got[2] == cost.step(StepLoad.of([(100, 1, True)])).total_s
    assert got[3] == cost.step(StepLoad.of([(101, 1, True, 0), (100, 1, True, 96)])).total_s


@pytest.mark.slow
def test_validate_timed_workload_replays_the_real_plans():
    pytest.importorskip("torch")
    from cbnb.measure.validate import validate_workload

    from helpers_sim import TEST_CPU

    r = validate_workload("cpu-poisson", TEST_CPU, scale=0.1)
    assert r["plans_identical"] is None  # timed: plans depend on step times, not compared
    assert r["steps"] == len(r["per_step"]) > 0 and r["measured_wall_s"] > 0 and r["predicted_wall_s"] > 0
    assert all(math.isfinite(r[k]) for k in ("wall_error", "median_step_error"))
