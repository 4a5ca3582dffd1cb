"""Goodput and percentile arithmetic on hand-made latencies."""

from __future__ import annotations

import pytest

from cbnb.lab.driver import RequestRecord
from cbnb.lab.metrics import DEFINITIONS, SLO, engine_figures, higher_is_better, steady_window, summarize


def rec(i, arrival, ttft, tpot, n, state="FINISHED", late=0.0):
    """A finished request: queued at arrival + late, first token ttft later, then n - 1 tokens tpot apart."""
    q = arrival + late
    times = [q + ttft + k * tpot for k in range(n)] if state == "FINISHED" else []
    return RequestRecord(i, f"r{i}", arrival, submitted_s=q, state=state, output_tokens=len(times),
                         queued_s=q, scheduled_s=q, first_token_s=times[0] if times else None,
                         finished_s=times[-1] if times else q + 1.0, token_times_s=times)


def test_goodput_counts_requests_meeting_both_bounds():
    recs = [
        rec(0, 0.0, 0.5, 0.05, 11),   # ends 1.0: meets both
        rec(1, 1.0, 1.5, 0.05, 11),   # TTFT 1.5 > 1.0: misses
        rec(2, 2.0, 0.2, 0.20, 11),   # TPOT 0.2 > 0.125: misses
        rec(3, 3.0, 1.0, 0.125, 11),  # both exactly at the bound (binary-exact numbers): meets (<=)
        rec(4, 4.0, 0.3, 0.0, 1),     # one token: no TPOT, meets on TTFT
        rec(5, 5.0, 0, 0, 0, state="FAILED"),  # ends at 6.0 (finished_s), never counts
        rec(6, 9.0, 0.5, 0.05, 21),   # ends 9.0 + 0.5 + 1.0 = 10.5: meets
    ]
    m = summarize(recs, slo=SLO(ttft_s=1.0, tpot_s=0.125))
    assert m["duration_s"] == pytest.approx(10.5)
    assert m["slo_met"] == 4
    assert m["goodput_requests_per_s"] == pytest.approx(4 / 10.5)
    assert m["slo_attainment_pct"] == pytest.approx(100 * 4 / 7)
    assert m["requests_finished"] == 6 and m["requests_failed"] == 1
    assert m["requests_per_s"] == pytest.approx(6 / 10.5)
    assert m["output_tokens"] == 11 * 4 + 1 + 21
    assert m["output_tokens_per_s"] == pytest.approx(m["output_tokens"] / 10.5)
    # Looser TTFT bound: request 1 now counts; no TPOT bound: request 2 counts too.
    assert summarize(recs, slo=SLO(ttft_s=2.0, tpot_s=0.125))["slo_met"] == 5
    assert summarize(recs, slo=SLO(ttft_s=2.0, tpot_s=None))["slo_met"] == 6


def test_steady_state_goodput_leaves_out_warm_up_and_drain():
    # 20 requests a second apart: the first two (warm-up) and the last two (drain) miss the TTFT bound.
    recs = [rec(i, float(i), 2.0 if i in (0, 1, 18, 19) else 0.5, 0.05, 5) for i in range(20)]
    m = summarize(recs, slo=SLO(ttft_s=1.0, tpot_s=0.1))
    assert (m["steady_start_s"], m["steady_end_s"]) == (2.0, 17.0)  # starts at the 10th and 90th percentiles
    assert m["goodput_steady_requests_per_s"] == pytest.approx(15 / 15.0)  # requests 2..16 in [2, 17), all good
    assert m["goodput_requests_per_s"] == pytest.approx(16 / m["duration_s"])  # the whole run: diluted
    # Requests that all start at once (offline) or too few requests: no steady window.
    assert steady_window([rec(i, 0.0, 0.5, 0.05, 5) for i in range(20)]) is None
    assert summarize(recs[:9])["goodput_steady_requests_per_s"] is None
    assert "steady-state window" in DEFINITIONS["goodput_steady_requests_per_s"]


def test_percentiles_are_nearest_rank_over_finished_requests():
    recs = [rec(i, float(i), ttft=0.1 * (i + 1), tpot=0.01, n=3) for i in range(10)]
    m = summarize(recs)
    assert m["ttft_s_p50"] == pytest.approx(0.5) and m["ttft_s_p90"] == pytest.approx(0.9)
    assert m["ttft_s_p99"] == pytest.approx(1.0) and m["ttft_s_max"] == pytest.approx(1.0)
    assert m["itl_s_p50"] == pytest.approx(0.01)  # pooled gaps: 2 per request
    assert m["tpot_s_mean"] == pytest.approx(0.01)
    assert m["lateness_s_p99"] == 0.0


def test_lateness_and_empty_runs():
    recs = [rec(0, 0.0, 0.1, 0.01, 2, late=0.003), rec(1, 1.0, 0.1, 0.01, 2, late=0.010)]
    m = summarize(recs)
    assert m["lateness_s_max"] == pytest.approx(0.010, abs=1e-12)
    assert m["lateness_s_p50"] == pytest.approx(0.003, abs=1e-12)
    empty = summarize([])
    assert empty["goodput_requests_per_s"] == 0.0 and empty["ttft_s_p99"] is None


def test_slo_validation_and_text():
    assert str(SLO(ttft_s=0.5, tpot_s=0.05)) == "TTFT <= 0.5 s and TPOT <= 50 ms"
    for bad in (0, -1, float("inf"), True, "1"):
        with pytest.raises(ValueError, match="SLO.ttft_s"):
            SLO(ttft_s=bad)


def test_engine_figures_and_direction():
    f = engine_figures({"mean_kv_usage_blocks_frac": 0.5, "mean_kv_usage_tokens_frac": 0.375, "soft_resets": 2,
                        "other": 1})
    assert f == {"mean_kv_usage_blocks_frac": 0.5, "mean_kv_usage_tokens_frac": 0.375, "soft_resets": 2,
                 "mean_kv_fragmentation_frac": 0.125}
    assert engine_figures(None) == {}
    assert higher_is_better("goodput_requests_per_s") and higher_is_better("slo_attainment_pct")
    assert not higher_is_better("ttft_s_p99") and not higher_is_better("soft_resets")
