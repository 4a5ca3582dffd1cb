"""`calibrate()` on a busy machine: refuses (busy="refuse") before measuring anything, or marks the profile, whose
provenance then says so where predictions are read."""

from __future__ import annotations

import importlib

import pytest

from cbnb.sim.profiles import load_profile

# the module (``cbnb.measure.calibrate`` the attribute is the function `cbnb.measure` re-exports)
cal = importlib.import_module("cbnb.measure.calibrate")


def test_refuses_on_a_busy_machine_before_measuring(monkeypatch):
    monkeypatch.setattr(cal, "_loadavg", lambda: 99.0)
    with pytest.raises(RuntimeError, match="busy.*load average 99.0"):
        cal.calibrate(save=False, quick=True, busy="refuse")
    with pytest.raises(ValueError, match="busy must be"):
        cal.calibrate(save=False, busy="maybe")


def test_busy_rule_and_the_mark_on_the_profile():
    assert cal.machine_busy(2.0, 1.0, cores=2, threads=1)  # every core already taken before
    assert cal.machine_busy(0.5, 3.5, cores=2, threads=1)  # others ran alongside our thread
    assert not cal.machine_busy(0.4, 2.5, cores=2, threads=1)
    assert not cal.machine_busy(None, None, cores=2, threads=1)
    prof = load_profile("h100-sxm").replace(name="cpu", kind="cpu", runner="cpu", provenance={
        "kind": "calibrated", "details": {"busy": True, "load_average_before": 6.1}})
    t = prof.trust()
    assert t["kind"] == "calibrated" and "BUSY MACHINE (load average 6.1)" in t["what"]
    with pytest.raises(ValueError, match="provenance"):
        prof.replace(provenance={"kind": "guessed"}).trust()
