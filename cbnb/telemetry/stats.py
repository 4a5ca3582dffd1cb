"""Run statistics: throughput, latency percentiles, KV usage, prefix hits, offloads, batch fill (torch-free).

A `RunStats` accumulates per-step and per-request figures as the engine goes; `summary()` turns them into a flat
dict whose names carry their units (``_s`` seconds, ``_per_s`` per second, ``_frac`` a fraction in [0, 1],
``_pct`` percent, ``_tokens`` tokens). The engine keeps two: one per run (reset by `engine.reset_stats()`) and one
cumulative.

Definitions:

- throughput: tokens processed over the span from the first step's start to the last step's end (idle time before
  the first request does not count; idle gaps between requests do);
- TTFT: queued -> first token; TPOT: (end-to-end - TTFT) / (output tokens - 1); queue time: queued -> first
  scheduled; all per finished request;
- prefix hit rate: prompt tokens served from the cache / (those + prefill tokens computed);
- KV usage: see `cbnb.core.cache.snapshot.kv_usage` (by blocks, by tokens, and their difference, fragmentation);
- batch fill: per step, query tokens / `max_batch_tokens`, past tokens read / cache budget, requests / request
  cap, averaged over steps that ran.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from typing import Any, Iterable

__all__ = ["RunStats", "percentiles"]


def percentiles(values: Iterable[float]) -> dict[str, float | None]:
    """p50/p90/p99/mean/max of `values` (nearest-rank), or None entries when empty."""
    xs = sorted(values)
    if not xs:
        return {"p50": None, "p90": None, "p99": None, "mean": None, "max": None, "count": 0}

    def rank(p: float) -> float:  # the smallest value with at least p % of the values <= it
        k = max(0, min(len(xs) - 1, math.ceil(p / 100 * len(xs) - 1e-9) - 1))
        return xs[k]

    return {"p50": rank(50), "p90": rank(90), "p99": rank(99), "mean": sum(xs) / len(xs), "max": xs[-1],
            "count": len(xs)}


class RunStats:
    """Accumulates one run's figures."""

    def __init__(self) -> None:
        self.reset_t = time.perf_counter()
        self.first_step_t: float | None = None
        self.last_step_t: float | None = None
        self.steps = 0
        self.busy_s = 0.0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.sampled_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefix_hits = 0
        self.ttft: list[float] = []
        self.tpot: list[float] = []
        self.e2e: list[float] = []
        self.queue: list[float] = []
        self.done: Counter[str] = Counter()
        self.offloads_by_path: Counter[str] = Counter()
        self.offloads_by_reason: Counter[str] = Counter()
        self.restores = 0
        self.recomputed_tokens = 0
        self.graph_captures = 0
        self.graph_replays = 0
        self.graph_capture_failures = 0
        self.token_fill = 0.0
        self.cache_fill = 0.0
        self.request_fill = 0.0
        self.kv_samples = 0
        self.kv_blocks = 0.0
        self.kv_tokens = 0.0
        self.kv_last: dict[str, float] = {}
        self.phase_s: Counter[str] = Counter()

    def on_step(self, plan: Any, offloads: list[Any], restores: int, timings: dict[str, float],
                t_start: float, t_end: float, graph: tuple[int, ...] = (0, 0)) -> None:
        """Record one executed step (its plan, offload decisions, restores, phase timings and span); `graph` is the
        step's (graph captures, replays[, failed captures])."""
        if self.first_step_t is None:
            self.first_step_t = t_start
        self.last_step_t = t_end
        self.steps += 1
        self.busy_s += t_end - t_start
        for k, v in timings.items():
            self.phase_s[k] += v
        for s in plan.scheduled:
            if s.phase == "decode":
                self.decode_tokens += s.num_tokens
            else:
                self.prefill_tokens += s.num_tokens
            if s.samples:
                self.sampled_tokens += 1
            if s.prefix_hit_tokens:
                self.prefix_hit_tokens += s.prefix_hit_tokens
                self.prefix_hits += 1
        for d in offloads:
            self.offloads_by_path[d.path] += 1
            self.offloads_by_reason[getattr(d, "reason_code", None) or d.reason.split(":")[0]] += 1
            self.recomputed_tokens += d.tokens_to_recompute
        self.restores += restores
        if plan.scheduled:
            self.token_fill += plan.num_tokens / plan.token_budget if plan.token_budget else 0.0
            self.cache_fill += plan.cache_read_tokens / plan.cache_budget if plan.cache_budget else 0.0
            self.request_fill += len(plan.scheduled) / plan.request_cap if plan.request_cap else 0.0
        self.graph_captures += graph[0]
        self.graph_replays += graph[1]
        if len(graph) > 2:
            self.graph_capture_failures += graph[2]

    def on_kv(self, usage: dict[str, float]) -> None:
        """Record a KV usage sample (`kv_usage` output)."""
        self.kv_samples += 1
        self.kv_blocks += usage["blocks_frac"]
        self.kv_tokens += usage["tokens_frac"]
        self.kv_last = dict(usage)

    def on_done(self, req: Any) -> None:
        """Record a terminal request."""
        self.done[req.state.name] += 1
        if req.state.name != "FINISHED":
            return
        tm = req.timings
        if tm.ttft_s is not None:
            self.ttft.append(tm.ttft_s)
        if tm.e2e_s is not None:
            self.e2e.append(tm.e2e_s)
            n = len(req.output_ids)
            if n > 1 and tm.ttft_s is not None:
                self.tpot.append((tm.e2e_s - tm.ttft_s) / (n - 1))
        if tm.queue_s is not None:
            self.queue.append(tm.queue_s)

    def latency_samples(self) -> dict[str, list[float]]:
        """Copies of the per-request latencies behind the summary's percentiles, in seconds, in the order the
        requests finished: {"ttft_s", "tpot_s", "e2e_latency_s", "queue_time_s"} (FINISHED requests only; TPOT
        only for those with two tokens or more). For histograms (the server's `/metrics`) and custom percentiles."""
        return {"ttft_s": list(self.ttft), "tpot_s": list(self.tpot), "e2e_latency_s": list(self.e2e),
                "queue_time_s": list(self.queue)}

    def summary(self) -> dict[str, Any]:
        """Flat figures with units in the names."""
        span = (self.last_step_t - self.first_step_t) if self.first_step_t is not None else 0.0
        ran = max(1, self.steps)
        hit_den = self.prefix_hit_tokens + self.prefill_tokens
        return {
            "steps": self.steps,
            "span_s": span,
            "busy_s": self.busy_s,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
            "output_tokens": self.sampled_tokens,
            "prefill_tokens_per_s": self.prefill_tokens / span if span > 0 else 0.0,
            "decode_tokens_per_s": self.decode_tokens / span if span > 0 else 0.0,
            "output_tokens_per_s": self.sampled_tokens / span if span > 0 else 0.0,
            "ttft_s": percentiles(self.ttft),
            "tpot_s": percentiles(self.tpot),
            "e2e_latency_s": percentiles(self.e2e),
            "queue_time_s": percentiles(self.queue),
            "requests_finished": self.done.get("FINISHED", 0),
            "requests_failed": self.done.get("FAILED", 0),
            "requests_cancelled": self.done.get("CANCELLED", 0),
            "kv_usage_blocks_frac": self.kv_last.get("blocks_frac", 0.0),
            "kv_usage_tokens_frac": self.kv_last.get("tokens_frac", 0.0),
            "kv_fragmentation_frac": self.kv_last.get("fragmentation_frac", 0.0),
            "kv_cached_frac": self.kv_last.get("cached_frac", 0.0),
            "mean_kv_usage_blocks_frac": self.kv_blocks / self.kv_samples if self.kv_samples else 0.0,
            "mean_kv_usage_tokens_frac": self.kv_tokens / self.kv_samples if self.kv_samples else 0.0,
            "prefix_hit_tokens": self.prefix_hit_tokens,
            "prefix_hits": self.prefix_hits,
            "prefix_hit_rate_pct": 100.0 * self.prefix_hit_tokens / hit_den if hit_den else 0.0,
            "offloads_by_path": dict(self.offloads_by_path),
            "offloads_by_reason": dict(self.offloads_by_reason),
            "swaps": self.offloads_by_path.get("swap", 0),
            "soft_resets": self.offloads_by_path.get("soft_reset", 0),
            "restores": self.restores,
            "recomputed_tokens": self.recomputed_tokens,
            "cuda_graph_captures": self.graph_captures,
            "cuda_graph_replays": self.graph_replays,
            "cuda_graph_capture_failures": self.graph_capture_failures,
            "mean_token_budget_fill_frac": self.token_fill / ran,
            "mean_cache_budget_fill_frac": self.cache_fill / ran,
            "mean_request_cap_fill_frac": self.request_fill / ran,
            "time_by_phase_s": dict(self.phase_s),
        }
