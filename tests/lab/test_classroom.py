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
