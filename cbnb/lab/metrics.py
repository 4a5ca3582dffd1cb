"""Serving metrics of a driven run: latency percentiles, throughput, goodput under an SLO (torch-free).

Definitions (the vocabulary of vLLM's ``bench serve`` and SGLang's ``bench_serving``):

- percentiles: nearest rank (`cbnb.telemetry.stats.percentiles`), over finished requests; ITL pools every gap between
  two consecutive tokens of every finished request;
- duration: the run's start (t = 0, the first arrival) to the last request's end;
- throughput: output tokens of finished requests / duration (``output_tokens_per_s``); finished requests / duration
  (``requests_per_s``);
- goodput: requests per second that finished *and* met the SLO: TTFT <= ``slo.ttft_s`` and TPOT <= ``slo.tpot_s``
  (a request with one output token has no TPOT and meets that half); ``goodput_requests_per_s = good / duration``,
  as vLLM's ``request_goodput``; ``slo_attainment_pct = 100 * good / requests`` (every request counts, failed ones
  as missed);
- steady-state goodput: the same count over the steady-state window only, which leaves out the warm-up (an empty
  cache and batch) and the drain (the last requests alone in the batch): the window runs from the start (submit
  time) of the request at the 10th percentile of starts to that of the 90th, and ``goodput_steady_requests_per_s``
  = requests that started in ``[steady_start_s, steady_end_s)``, finished and met the SLO / the window's length
  (None with fewer than 10 requests or when they all started at once, as an offline batch does);
- lateness: submitted - arrival time, the driver's accuracy (never negative).

`DEFINITIONS` states these in words; every run of the tuning lab carries them (`cbnb.telemetry.runs.Run.definitions`).

Names carry units: ``_s`` seconds, ``_per_s`` per second, ``_pct`` percent, ``_frac`` a fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..telemetry.runs import KEY_FIGURES  # noqa: F401 (re-exported: the figures the Runs panel and `best` talk about first)
from ..telemetry.stats import percentiles

__all__ = ["SLO", "summarize", "steady_window", "engine_figures", "KEY_FIGURES", "higher_is_better", "FIGURE_LABELS",
           "DEFINITIONS"]

#: The share of requests (by start time) left out at each end of a run for the steady-state window.
STEADY_TRIM = 0.1

#: What the goodput figures mean, in words (kept with every run: `cbnb.telemetry.runs.Run.definitions`).
DEFINITIONS: dict[str, str] = {
    "goodput_requests_per_s": "requests that finished with TTFT <= slo_ttft_s and TPOT <= slo_tpot_s, divided by "
                              "the run's duration (first arrival to last end), as vLLM's request_goodput",
    "goodput_steady_requests_per_s": "the same count over the steady-state window only: requests whose start "
                                     "(submit time) lies in [steady_start_s, steady_end_s), the starts of the "
                                     "requests at the 10th and 90th percentiles of start times, divided by the "
                                     "window's length; warm-up and drain left out",
    "slo_attainment_pct": "100 x requests that met the SLO / every request submitted (failed ones count as missed)",
}


@dataclass(frozen=True)
class SLO:
    """A latency objective: TTFT <= `ttft_s` and TPOT <= `tpot_s` (seconds; None: no bound on that one).

    Raises:
        ValueError: a bound that is not a number > 0 (or None).
    """

    ttft_s: float | None = 1.0
    tpot_s: float | None = 0.1

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                                  or v <= 0):
                raise ValueError(f"SLO.{name} must be a number of seconds > 0 or None; got {v!r}")

    def met(self, ttft_s: float | None, tpot_s: float | None) -> bool:
        """Whether a finished request with these latencies meets the objective."""
        if self.ttft_s is not None and (ttft_s is None or ttft_s > self.ttft_s):
            return False
        if self.tpot_s is not None and tpot_s is not None and tpot_s > self.tpot_s:
            return False
        return True

    def spec(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s}

    def __str__(self) -> str:
        parts = []
        if self.ttft_s is not None:
            parts.append(f"TTFT <= {self.ttft_s:g} s")
        if self.tpot_s is not None:
            parts.append(f"TPOT <= {self.tpot_s * 1000:g} ms")
        return " and ".join(parts) or "no SLO"


def _flat(name: str, values: Iterable[float]) -> dict[str, Any]:
    p = percentiles(values)
    return {f"{name}_p50": p["p50"], f"{name}_p90": p["p90"], f"{name}_p99": p["p99"], f"{name}_mean": p["mean"],
            f"{name}_max": p["max"]}


def _start(r: Any) -> float:
    return r.submitted_s if r.submitted_s is not None else r.arrival_s


def steady_window(records: Iterable[Any], trim: float = STEADY_TRIM) -> tuple[float, float] | None:
    """The steady-state window ``(start_s, end_s)`` of a run: the start times of the requests at the `trim` and
    ``1 - trim`` quantiles of starts (submit time, else arrival). None with fewer than 10 requests or an empty
    window (every request started at once)."""
    starts = sorted(_start(r) for r in records)
    n = len(starts)
    if n < 10:
        return None
    lo, hi = starts[math.floor(trim * n)], starts[math.ceil((1 - trim) * n) - 1]
    return (lo, hi) if hi > lo else None


def summarize(records: Iterable[Any], *, slo: SLO | None = None, duration_s: float | None = None) -> dict[str, Any]:
    """Flat figures of a run from its `RequestRecord`s (anything with the same attributes).

    Args:
        records: the run's records (every request, finished or not).
        slo: the goodput objective (default `SLO()`: TTFT <= 1 s, TPOT <= 100 ms).
        duration_s: override the run's duration (default: 0 -> the last request's end).

    Returns:
        {"requests", "requests_finished", "requests_failed", "requests_cancelled", "duration_s",
        "output_tokens", "output_tokens_per_s", "requests_per_s", "goodput_requests_per_s", "slo_met",
        "slo_attainment_pct", "slo_ttft_s", "slo_tpot_s", "steady_start_s", "steady_end_s",
        "goodput_steady_requests_per_s" (see the module doc; None when the run has no steady window), and
        p50/p90/p99/mean/max of ttft_s, tpot_s, itl_s, queue_s, e2e_s, lateness_s (e.g. "ttft_s_p99")};
        percentiles are None when no request finished.
    """
    slo = slo or SLO()
    recs = list(records)
    done = [r for r in recs if r.finished]
    ends = [r.finished_s for r in recs if r.finished_s is not None]
    dur = duration_s if duration_s is not None else (max(ends) if ends else 0.0)
    good = sum(1 for r in done if slo.met(r.ttft_s, r.tpot_s))
    out_tokens = sum(r.output_tokens for r in done)
    states = [r.state for r in recs]
    out: dict[str, Any] = {
        "requests": len(recs),
        "requests_finished": len(done),
        "requests_failed": states.count("FAILED"),
        "requests_cancelled": states.count("CANCELLED"),
        "duration_s": dur,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / dur if dur > 0 else 0.0,
        "requests_per_s": len(done) / dur if dur > 0 else 0.0,
        "goodput_requests_per_s": good / dur if dur > 0 else 0.0,
        "slo_met": good,
        "slo_attainment_pct": 100.0 * good / len(recs) if recs else 0.0,
        "slo_ttft_s": slo.ttft_s,
        "slo_tpot_s": slo.tpot_s,
    }
    win = steady_window(recs)
    if win is None:
        out.update(steady_start_s=None, steady_end_s=None, goodput_steady_requests_per_s=None)
    else:
        lo, hi = win
        good_steady = sum(1 for r in done if lo <= _start(r) < hi and slo.met(r.ttft_s, r.tpot_s))
        out.update(steady_start_s=lo, steady_end_s=hi, goodput_steady_requests_per_s=good_steady / (hi - lo))
    out.update(_flat("ttft_s", (r.ttft_s for r in done if r.ttft_s is not None)))
    out.update(_flat("tpot_s", (r.tpot_s for r in done if r.tpot_s is not None)))
    out.update(_flat("itl_s", (g for r in done for g in r.itl_s)))
    out.update(_flat("queue_s", (r.queue_s for r in done if r.queue_s is not None)))
    out.update(_flat("e2e_s", (r.e2e_s for r in done if r.e2e_s is not None)))
    out.update(_flat("lateness_s", (r.lateness_s for r in recs if r.lateness_s is not None)))
    return out


#: Engine-side figures taken from ``engine.stats()["run"]`` into a run's metrics (when the engine has them).
_ENGINE_KEYS = ("steps", "mean_kv_usage_blocks_frac", "mean_kv_usage_tokens_frac", "kv_fragmentation_frac",
                "swaps", "soft_resets", "restores", "recomputed_tokens", "prefix_hit_rate_pct", "prefix_hit_tokens",
                "mean_token_budget_fill_frac", "busy_s")


def engine_figures(run_stats: Mapping[str, Any] | None) -> dict[str, Any]:
    """KV usage by blocks and by tokens (and their mean difference, ``mean_kv_fragmentation_frac``), offloads,
    soft resets, recomputed tokens and prefix hits from an engine's ``stats()["run"]`` (empty when None)."""
    if not run_stats:
        return {}
    out = {k: run_stats[k] for k in _ENGINE_KEYS if k in run_stats}
    if "mean_kv_usage_blocks_frac" in out and "mean_kv_usage_tokens_frac" in out:
        out["mean_kv_fragmentation_frac"] = out["mean_kv_usage_blocks_frac"] - out["mean_kv_usage_tokens_frac"]
    return out



FIGURE_LABELS: dict[str, str] = {
    "goodput_requests_per_s": "goodput (req/s)", "slo_attainment_pct": "SLO met (%)",
    "ttft_s_p50": "TTFT p50 (s)", "ttft_s_p90": "TTFT p90 (s)", "ttft_s_p99": "TTFT p99 (s)",
    "tpot_s_p50": "TPOT p50 (s)", "tpot_s_p99": "TPOT p99 (s)", "itl_s_p50": "ITL p50 (s)", "itl_s_p99": "ITL p99 (s)",
    "e2e_s_p50": "e2e p50 (s)", "e2e_s_p99": "e2e p99 (s)", "queue_s_p99": "queue p99 (s)",
    "output_tokens_per_s": "output tok/s", "requests_per_s": "req/s", "lateness_s_p99": "lateness p99 (s)",
    "mean_kv_fragmentation_frac": "KV fragmentation", "mean_kv_usage_blocks_frac": "KV used (blocks)",
    "mean_kv_usage_tokens_frac": "KV used (tokens)", "soft_resets": "soft resets", "swaps": "swaps",
    "recomputed_tokens": "recomputed tokens",
}


def higher_is_better(figure: str) -> bool:
    """Direction of a figure from its name: rates, attainment and hit rates up; latencies and counts of trouble
    (soft resets, swaps, recomputed tokens, fragmentation, lateness) down."""
    if figure.endswith("_per_s") or figure.startswith(("slo_attainment", "prefix_hit", "mean_kv_usage")):
        return True
    if figure in ("slo_met", "requests_finished", "output_tokens"):
        return True
    return False
