"""`GET /metrics`: the engine's and the server's figures in Prometheus' text format (via `prometheus_client`).

Everything is read at scrape time through the engine's public API: `engine.stats()["cumulative"]` and
`engine.latency_samples(cumulative=True)` (so counters and histograms never go back, also across
`engine.reset_stats()`), `engine.requests_snapshot()` for the live requests, and the server's `ServerCounters`.
Names follow Prometheus' conventions (`cbnb_` prefix, base units, `_total` counters, `_ratio` fractions in [0, 1]):

- gauges: `cbnb_engine_up`, `cbnb_requests{state}` (live requests by state), `cbnb_kv_usage_blocks_ratio`,
  `cbnb_kv_usage_tokens_ratio`, `cbnb_kv_fragmentation_ratio`, `cbnb_kv_cached_ratio`, `cbnb_kv_blocks`,
  `cbnb_kv_page_size_tokens`, `cbnb_http_requests_in_flight`, `cbnb_http_clients`, `cbnb_http_connections`;
- counters: `cbnb_requests_ended_total{state}`, `cbnb_prefill_tokens_total`, `cbnb_decode_tokens_total`,
  `cbnb_output_tokens_total`, `cbnb_prefix_hit_tokens_total`, `cbnb_prefix_hits_total`,
  `cbnb_offloads_total{path}`, `cbnb_restores_total`, `cbnb_recomputed_tokens_total`, `cbnb_steps_total`,
  `cbnb_http_responses_total{route,status}`;
- histograms (seconds, finished requests): `cbnb_time_to_first_token_seconds`, `cbnb_time_per_output_token_seconds`,
  `cbnb_e2e_request_latency_seconds`, `cbnb_request_queue_time_seconds`.
"""

from __future__ import annotations

import bisect
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .counters import ServerCounters

__all__ = ["EngineCollector", "render", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds in seconds (vLLM's TTFT/TPOT bounds, trimmed to what a CPU or one GPU produces).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)


def _histogram(name: str, doc: str, values: Iterable[float], bounds: tuple[float, ...]) -> HistogramMetricFamily:
    xs = sorted(values)
    buckets = [(repr(float(b)), bisect.bisect_right(xs, b)) for b in bounds] + [("+Inf", len(xs))]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=float(sum(xs)))


class EngineCollector:
    """A `prometheus_client` collector over one engine and one server's counters.

    Args:
        engine: the `cbnb.Engine`.
        counters: the server's `ServerCounters`.
        connections: returns the number of open HTTP connections (None when unknown).
    """

    def __init__(self, engine: Any, counters: ServerCounters, connections: Callable[[], int | None]) -> None:
        self.engine = engine
        self.counters = counters
        self.connections = connections

    def collect(self) -> Iterable[Metric]:
        eng = self.engine
        st = eng.stats()["cumulative"]
        yield GaugeMetricFamily("cbnb_engine_up", "1 while the engine loop runs", value=float(eng.state == "running"))
        live = GaugeMetricFamily("cbnb_requests", "Live requests by state", labels=["state"])
        by_state: dict[str, int] = {s: 0 for s in ("PENDING", "PREFILLING", "DECODING")}
        for out in eng.requests_snapshot():
            if not out.finished:
                by_state[out.state.name] = by_state.get(out.state.name, 0) + 1
        for s, n in by_state.items():
            live.add_metric([s], n)
        yield live
        for key, name, doc in (
            ("kv_usage_blocks_frac", "kv_usage_blocks_ratio", "KV cache bytes in referenced blocks / usable bytes"),
            ("kv_usage_tokens_frac", "kv_usage_tokens_ratio", "KV cache bytes of filled token slots / usable bytes"),
            ("kv_fragmentation_frac", "kv_fragmentation_ratio", "blocks ratio minus tokens ratio"),
            ("kv_cached_frac", "kv_cached_ratio", "KV cache bytes in cached (reusable) prefix blocks / usable bytes"),
        ):
            yield GaugeMetricFamily(f"cbnb_{name}", doc, value=float(st.get(key, 0.0)))
        cfg = eng.config
        yield GaugeMetricFamily("cbnb_kv_blocks", "KV cache blocks (config.num_blocks)",
                                value=float(cfg.num_blocks or 0))
        yield GaugeMetricFamily("cbnb_kv_page_size_tokens", "tokens per KV block", value=float(cfg.page_size))
        ended = CounterMetricFamily("cbnb_requests_ended", "Requests that ended, by final state", labels=["state"])
        for s in ("finished", "failed", "cancelled"):
            ended.add_metric([s.upper()], st.get(f"requests_{s}", 0))
        yield ended
        for key, name, doc in (
            ("prefill_tokens", "prefill_tokens", "Prompt (and recomputed) tokens run through the model"),
            ("decode_tokens", "decode_tokens", "Decode tokens run through the model"),
            ("output_tokens", "output_tokens", "Tokens sampled"),
            ("prefix_hit_tokens", "prefix_hit_tokens", "Prompt tokens served from the prefix cache"),
            ("prefix_hits", "prefix_hits", "Scheduled chunks that hit the prefix cache"),
            ("restores", "restores", "Requests restored from the host swap pool"),
            ("recomputed_tokens", "recomputed_tokens", "Tokens to recompute after soft resets"),
            ("steps", "steps", "Engine steps run"),
        ):
            yield CounterMetricFamily(f"cbnb_{name}", doc, value=float(st.get(key, 0)))
        off = CounterMetricFamily("cbnb_offloads", "Offloads by path (swap to host or soft reset)", labels=["path"])
        for path in ("swap", "soft_reset"):
            off.add_metric([path], float(st.get("offloads_by_path", {}).get(path, 0)))
        yield off
        lat = eng.latency_samples(cumulative=True)
        yield _histogram("cbnb_time_to_first_token_seconds", "Queued to first token", lat["ttft_s"], TTFT_BUCKETS)
        yield _histogram("cbnb_time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1)",
                         lat["tpot_s"], TPOT_BUCKETS)
        yield _histogram("cbnb_e2e_request_latency_seconds", "Queued to finished", lat["e2e_latency_s"],
                         LATENCY_BUCKETS)
        yield _histogram("cbnb_request_queue_time_seconds", "Queued to first scheduled", lat["queue_time_s"],
                         LATENCY_BUCKETS)
        snap = self.counters.snapshot()
        yield GaugeMetricFamily("cbnb_http_requests_in_flight", "Generation requests in flight",
                                value=float(snap["in_flight"]))
        yield GaugeMetricFamily("cbnb_http_clients", "Distinct client addresses with a request in flight",
                                value=float(snap["clients"]))
        conns = self.connections()
        if conns is not None:
            yield GaugeMetricFamily("cbnb_http_connections", "Open HTTP connections", value=float(conns))
        resp = CounterMetricFamily("cbnb_http_responses", "HTTP responses by route and status",
                                   labels=["route", "status"])
        for (route, status), n in sorted(self.counters.routes().items()):
            resp.add_metric([route, str(status)], float(n))
        yield resp


def render(collector: EngineCollector) -> bytes:
    """The Prometheus text exposition of one collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
