"""Class mode's helpers (cbnb.lab.classroom): the size variable, the machine's GEMM rate, the time estimates."""

from __future__ import annotations

import pytest

from cbnb.lab.classroom import REFERENCE_FLOPS, Machine, measure, size


def test_size_is_class_unless_full_is_asked(monkeypatch):
    monkeypatch.delenv("CBNB_SIZE", raising=False)
    assert size() == "class" and size("full") == "full"
    monkeypatch.setenv("CBNB_SIZE", " Full ")
    assert size() == "full"
    monkeypatch.setenv("CBNB_SIZE", "tiny")
    with pytest.raises(ValueError, match="CBNB_SIZE must be one of class, full"):
        size()


def test_estimates_scale_with_the_gemm_rate():
    twice = Machine(2 * REFERENCE_FLOPS, 2)
    assert twice.speed == pytest.approx(2.0) and twice.seconds(120) == pytest.approx(60)
    assert twice.estimate("The sweep below", 120) == ("The sweep below: about 60 s here (2.0 min on the 65 GFLOP/s "
                                                      "class laptop).")
    assert "2.0x the 65 GFLOP/s 2-core class laptop" in str(twice)


def test_measure_takes_about_the_time_asked_and_gives_a_rate():
    import time

    t0 = time.perf_counter()
    m = measure(seconds=0.2, n=256)
    assert m.gemm_flops > 1e8 and m.threads >= 1 and m.n == 256
    assert time.perf_counter() - t0 < 30  # (a loaded machine may be slow; 0.2 s of passes plus a warm-up)


def test_an_estimate_is_never_below_the_arrivals():
    """Found in the teacher's trial (issue 40): notebook 02 said "Sweep 1 (8 runs): about 35 s here" for runs that
    replay Poisson arrivals over 4 minutes of wall time."""
    m = Machine(REFERENCE_FLOPS, 2)
    assert m.estimate("Sweep 1 (8 runs)", 25, at_least_s=260) == (
        "Sweep 1 (8 runs): at least 4.3 min here (its arrivals alone take that long; its compute, 25 s on the "
        "65 GFLOP/s class laptop).")
    assert m.estimate("Sweep 1 (8 runs)", 25, at_least_s=10) == m.estimate("Sweep 1 (8 runs)", 25)


def test_measure_keeps_one_thread_where_busy_cores_make_small_ops_wait(monkeypatch):
    """Found in the teacher's trial (issue 40): on 2 cores held by other jobs, torch's 2 threads made each of a
    decode step's small matmuls wait for both to get a core (66x slower than 1 thread), so the notebooks ran 10x
    slower than their GEMM-based estimates. measure() now keeps 1 thread there, and says so; a quiet machine
    keeps its threads."""
    import torch

    from cbnb.lab import classroom

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.setattr(classroom.os, "cpu_count", lambda: 2)
        monkeypatch.setattr(classroom.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
        monkeypatch.setattr(classroom, "small_op_seconds", lambda: 1e-3 if torch.get_num_threads() > 1 else 1e-5)
        busy = measure(seconds=0.05, n=128)
        assert torch.get_num_threads() == 1 and busy.threads == 1
        assert busy.busy_from == 2 and busy.busy_ratio == pytest.approx(100)
        assert ("its cores are busy with other jobs (load average 0.5 on 2 cores): at 2 torch threads each of the "
                "model's small ops waits for every thread to get a core (here 100x slower than at 1)") in str(busy)
        torch.set_num_threads(2)
        monkeypatch.setattr(classroom, "small_op_seconds", lambda: 1e-4 if torch.get_num_threads() > 1 else 1.5e-4)
        quiet = measure(seconds=0.05, n=128)
        assert torch.get_num_threads() == 2 and quiet.threads == 2 and quiet.busy_from is None
        assert "busy" not in str(quiet)
        # The waits come in bursts a short timing can miss: more runnable jobs than cores is enough.
        monkeypatch.setattr(classroom.os, "getloadavg", lambda: (8.4, 8.0, 7.5))
        loaded = measure(seconds=0.05, n=128)
        assert torch.get_num_threads() == 1 and loaded.busy_from == 2 and "load average 8.4 on 2 cores" in str(loaded)
        assert "slower than at 1" not in str(loaded)  # this timing saw no wait: no "0x slower"
    finally:
        torch.set_num_threads(before)


def test_estimates_allow_for_other_jobs_on_the_cores():
    """Found in the teacher's trial (issue 40): notebook 05 (a Python-bound simulation) said about 70 s for its long
    cells at load 6.4 on 2 cores and its Run All took 266 s: the GEMM's fastest pass is a free core's speed, while a
    long cell gets about cores / load of the machine."""
    quiet = Machine(REFERENCE_FLOPS, 2, load=1.5, cores=2)
    assert quiet.shared == 1.0 and quiet.seconds(80) == pytest.approx(80) and "other jobs" not in str(quiet)
    busy = Machine(2 * REFERENCE_FLOPS, 1, load=6.4, cores=2)
    assert busy.shared == pytest.approx(3.2) and busy.seconds(80) == pytest.approx(128)
    assert "a long cell gets about 1/3.2 of the machine" in str(busy)
    assert Machine(REFERENCE_FLOPS, 2).shared == 1.0  # no load average (Windows): no allowance


def test_a_simulation_is_scaled_by_python_speed_not_the_gemm_rate():
    """Found on a Sapphire Rapids Xeon (5.5x the class laptop's GEMM rate): notebook 05's simulated sweep said
    "about 30 s here" and took 54 s, since a simulation runs no GEMM. Its cells now scale by the Python probe."""
    from cbnb.lab.classroom import REFERENCE_PYTHON_S, python_probe_seconds

    fast_gemm = Machine(5 * REFERENCE_FLOPS, 2, python_s=REFERENCE_PYTHON_S / 2)
    assert fast_gemm.python_speed == pytest.approx(2.0)
    assert fast_gemm.seconds(100) == pytest.approx(20) and fast_gemm.seconds(100, "python") == pytest.approx(50)
    assert fast_gemm.estimate("The sweep", 110, bound="python") == (
        "The sweep: about 55 s here (1.8 min on the 65 GFLOP/s class laptop).")
    assert "Python 2.0x its (assumed) speed" in str(fast_gemm)
    assert Machine(2 * REFERENCE_FLOPS, 2).python_speed == pytest.approx(2.0)  # not probed: the GEMM rate stands in
    with pytest.raises(ValueError, match="bound must be 'gemm' or 'python'"):
        fast_gemm.seconds(1, "disk")
    probe = python_probe_seconds(passes=2, n=6_400)
    assert 0 < probe < 5
