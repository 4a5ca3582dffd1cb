"""The live plots' series, free of widgets: per-step batch composition, stats samples, and run segments.

Every chart shares one x axis, the engine's step number (it keeps counting across `engine.reconfigure`), so a spike
of left-out requests lines up with the KV peak of the same step. Stats samples (KV usage, hits, throughput...) are
placed at the step the engine had reached when they were read.

A run segment starts at every `RunStarted` event (a reconfigure, `engine.reset_stats()`, a standard workload);
`RunSegments` keeps the markers, and every row of both series carries its segment in the column "run". Lines are
broken (a row of NaN) where a segment starts, and where the engine sat idle for `IDLE_GAP_S` seconds or more.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..core.plan import SkipReason

__all__ = ["SKIP_REASONS", "IDLE_GAP_S", "RunSegments", "StepSeries", "TimeSeries"]

#: The scheduler's skip reasons (`cbnb.core.plan.SkipReason`, plain data), which name the stacked bars.
SKIP_REASONS: tuple[str, ...] = tuple(r.value for r in SkipReason)

#: Seconds without a new step after which the time charts break their lines (an idle engine, or a paused one).
IDLE_GAP_S = 5.0


class _Ring:
    """Fixed-size float32 columns, appended row by row (oldest dropped); `arrays()` gives each column's bytes in
    time order (NaN = missing). Stored column-major so that a column's bytes are one contiguous slice."""

    def __init__(self, columns: Sequence[str], size: int) -> None:
        self.columns = tuple(columns)
        self._index = {c: i for i, c in enumerate(self.columns)}
        self.size = size
        self._data = np.full((len(self.columns), size), np.nan, dtype=np.float32)
        self._n = 0  # rows held
        self._head = 0  # next write position

    def append(self, row: Mapping[str, float | None]) -> None:
        self._data[:, self._head] = [_num(row.get(c)) for c in self.columns]
        self._head = (self._head + 1) % self.size
        self._n = min(self._n + 1, self.size)

    def append_break(self) -> None:
        """A row of NaN: plotly breaks every line there."""
        self.append({})

    def clear(self) -> None:
        self._data[:] = np.nan
        self._n = self._head = 0

    def __len__(self) -> int:
        return self._n

    def _ordered(self, i: int) -> np.ndarray:
        col = self._data[i]
        if self._n < self.size:
            return col[: self._n]
        return np.concatenate((col[self._head:], col[: self._head]))

    def column(self, name: str) -> np.ndarray:
        return self._ordered(self._index[name]).astype(np.float64)

    def arrays(self) -> dict[str, bytes]:
        return {c: self._ordered(i).tobytes() for i, c in enumerate(self.columns)}


def _num(v: Any) -> float:
    if v is None:
        return math.nan
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


class RunSegments:
    """Run markers: segment 0 from the start, then one per `RunStarted` event.

    Each marker is {"index", "step" (the new run starts after this step), "cause", "label", "t" (seconds since
    `t0`, perf_counter scale)}.

    Args:
        label: what segment 0 is (e.g. the config at the start).
        t0: perf_counter seconds of "time 0".
        keep: markers kept at most (the oldest are dropped; indices keep counting).
    """

    def __init__(self, label: str = "", t0: float = 0.0, keep: int = 64) -> None:
        self.t0 = t0
        self.markers: deque[dict[str, Any]] = deque(
            [{"index": 0, "step": 0, "cause": "start", "label": label, "t": 0.0}], maxlen=keep)

    @property
    def current(self) -> int:
        return self.markers[-1]["index"]

    @property
    def last(self) -> dict[str, Any]:
        return self.markers[-1]

    def add(self, event: Any) -> None:
        """A `RunStarted` event. One right after another at the same step merges into it (its label joined)."""
        last = self.markers[-1]
        if last["index"] > 0 and last["step"] == event.step:
            if event.label and event.label not in last["label"]:
                last["label"] = "; ".join(x for x in (last["label"], event.label) if x)
            return
        self.markers.append({"index": last["index"] + 1, "step": int(event.step), "cause": event.cause,
                             "label": event.label, "t": round(event.t - self.t0, 3)})

    def to_list(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self.markers]


class StepSeries(_Ring):
    """Per-step batch composition from `StepPlanned` events: prefill and decode tokens against the token budget,
    and how many requests were left out for each reason (columns ``skip_<reason>``), with the step's time ("t",
    seconds since `t0`) and its run segment ("run"). `RunStarted` events in the same stream start a new segment
    in `runs`. A step number that goes back (another engine) starts the series afresh."""

    def __init__(self, size: int = 240, runs: RunSegments | None = None, t0: float = 0.0) -> None:
        super().__init__(("step", "t", "run", "prefill", "decode", "budget", "requests")
                         + tuple(f"skip_{r}" for r in SKIP_REASONS), size)
        self.runs = runs if runs is not None else RunSegments(t0=t0)
        self.t0 = t0
        self._last_step = 0

    @property
    def last_step(self) -> int:
        """The newest step seen (0 before the first)."""
        return self._last_step

    def add_events(self, events: Iterable[Any]) -> int:
        """Append a row per `StepPlanned` event (and a marker per `RunStarted`). Returns the rows added."""
        n = 0
        for e in events:
            kind = getattr(e, "kind", "")
            if kind == "run_started":
                self.runs.add(e)
                continue
            if kind != "step_planned":
                continue
            if self._n and e.step <= self._last_step:
                self.clear()  # steps counted from 1 again: a different engine
            self._last_step = e.step
            row: dict[str, float] = {"step": e.step, "t": e.t - self.t0, "run": self.runs.current,
                                     "prefill": e.prefill_tokens, "decode": e.decode_tokens,
                                     "budget": e.token_budget, "requests": e.requests_used}
            for r in SKIP_REASONS:
                row[f"skip_{r}"] = 0.0
            for reason, ids, _detail in e.skipped:
                key = f"skip_{reason}"
                row[key] = row.get(key, 0.0) + len(ids)
            self.append(row)
            n += 1
        return n


class TimeSeries(_Ring):
    """Samples of `engine.stats()`: KV usage, prefix hits, offloads, graphs, throughput and latency, each at the
    step the engine had reached ("step") and its time ("t", seconds since `t0`), in run segment "run".
    Throughput is the rate of the cumulative output/prefill token counters between samples, averaged over the last
    `window_s` seconds. A NaN row breaks the lines where a segment starts and after an idle gap (`IDLE_GAP_S`
    seconds with no new step).

    Time is the engine's own clock when its stats carry one ("clock_s"; a simulator's is simulated seconds, so a
    simulation played faster than real time still shows its own tokens/s), aligned with the wall clock at the first
    sample; else the wall time of the read."""

    COLUMNS = ("t", "step", "run", "kv_blocks_pct", "kv_tokens_pct", "prefix_hit_tokens", "prefix_hit_pct", "swaps",
               "soft_resets", "restores", "graph_captures", "graph_replays", "out_tok_s", "prefill_tok_s",
               "ttft_p50_ms", "tpot_p50_ms")

    def __init__(self, t0: float, size: int = 600, window_s: float = 1.0) -> None:
        super().__init__(self.COLUMNS, size)
        self.t0 = t0
        self.window_s = window_s
        self._counters: deque[tuple[float, float, float]] = deque()
        self._last: tuple[float, float, int] | None = None  # (wall, step, run) of the newest sample
        self._clock0: float | None = None  # engine clock - seconds since t0, fixed at the first sample

    def add_stats(self, wall: float, stats: Mapping[str, Any], step: float | None = None,
                  run: int = 0) -> dict[str, float | None]:
        """Append one sample from `engine.stats()` read at `wall` (time.time()), taken at engine step `step`, in
        run segment `run`. Returns the row."""
        r, cum = stats["run"], stats["cumulative"]
        clock = stats.get("clock_s")
        if clock is not None:
            if self._clock0 is None:
                self._clock0 = clock - (wall - self.t0)
            wall = self.t0 + clock - self._clock0
        if step is None:
            step = cum.get("steps")
        last = self._last
        if last is not None:
            idle = wall - last[0] >= IDLE_GAP_S and step == last[1]
            if run != last[2] or idle:
                self.append_break()
            if run != last[2]:
                self._counters.clear()  # rates restart with the segment
        self._last = (wall, step, run)
        self._counters.append((wall, float(cum["output_tokens"]), float(cum["prefill_tokens"])))
        while len(self._counters) > 2 and wall - self._counters[1][0] >= self.window_s:
            self._counters.popleft()
        (ta, oa, pa), (tb, ob, pb) = self._counters[0], self._counters[-1]
        dt = tb - ta
        out_rate = (ob - oa) / dt if dt > 0 else 0.0
        pre_rate = (pb - pa) / dt if dt > 0 else 0.0
        ttft, tpot = r["ttft_s"].get("p50"), r["tpot_s"].get("p50")
        row = {
            "t": wall - self.t0, "step": step, "run": run,
            "kv_blocks_pct": 100.0 * r["kv_usage_blocks_frac"],
            "kv_tokens_pct": 100.0 * r["kv_usage_tokens_frac"],
            "prefix_hit_tokens": r["prefix_hit_tokens"],
            "prefix_hit_pct": r["prefix_hit_rate_pct"],
            "swaps": r["swaps"], "soft_resets": r["soft_resets"], "restores": r["restores"],
            "graph_captures": r["cuda_graph_captures"], "graph_replays": r["cuda_graph_replays"],
            "out_tok_s": out_rate, "prefill_tok_s": pre_rate,
            "ttft_p50_ms": None if ttft is None else 1000 * ttft,
            "tpot_p50_ms": None if tpot is None else 1000 * tpot,
        }
        self.append(row)
        return row
