"""`python -m cbnb.sim.validate`: argument errors, and one small real comparison (plans identical, figures present;
no accuracy is asserted: timing depends on the machine's load)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest


def test_unknown_workload_is_an_argument_error():
    out = subprocess.run([sys.executable, "-m", "cbnb.sim.validate", "--workloads", "cpu-32,nope"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unknown nope" in out.stderr and "long-gen" in out.stderr


@pytest.mark.slow
def test_validate_workload_small_cpu32_has_identical_plans():
    pytest.importorskip("torch")
    from cbnb.sim.validate import validate_workload

    from test_sim_decisions import TEST_CPU

    r = validate_workload("cpu-32", TEST_CPU, scale=0.1)
    assert r["plans_identical"]
    assert r["steps"] == len(r["per_step"]) > 0
    assert r["measured_wall_s"] > 0 and r["predicted_wall_s"] > 0
    assert all(math.isfinite(r[k]) for k in ("wall_error", "median_step_error", "p90_step_error"))
    step, measured, predicted, phases, parts = r["per_step"][0]
    assert measured > 0 and predicted > 0 and len(phases) == 4 and "linear" in parts
