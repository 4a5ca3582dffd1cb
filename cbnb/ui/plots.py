"""`LivePlotsPanel`: plotly charts of the scheduler, the KV cache and the engine's speed, in one widget.

Why not `plotly.graph_objects.FigureWidget` (measured here, plotly 7.1, 2 CPU cores):

- a FigureWidget ships its 4.96 MB ESM bundle as widget state *per instance* and took 4.4-5.2 s to construct;
- a `batch_update` of 18 traces x 300 points cost 12-15 ms of Python per update (plotly validates every array),
  i.e. 12-15 % of a core at 10 Hz, against 0.05 ms to set the same data as float32 bytes in an anywidget traitlet;
- its synced state (`_widget_data`) keeps the data of the time it was displayed, so a reloaded page shows stale
  plots until the next change.

So the plots are drawn by plotly.js inside this panel's own ES module, from traitlets that always hold the current
series (float32 bytes): a reloaded page restores them like any widget state. plotly.js itself (plotly's
`package_data/plotly.min.js`, 4.8 MB) is sent once per kernel by a hidden `PlotlyLib` widget that every plots panel
refers to, and evaluated once per page.

One widget, six small plotly figures rather than one figure of six subplots: redrawing the single figure took
200-900 ms of the page's main thread on a loaded 2-core machine, during which no widget message is handled (the
token stream stalls). The front-end redraws one small chart right after each update, round-robin, skips charts
that are off screen, and catches up on the rest once updates pause.
"""

from __future__ import annotations

import importlib.resources
import threading
import time
from typing import Any

import anywidget
import traitlets

from . import _assets
from .base import Panel
from .poller import Frame
from .series import SKIP_REASONS, RunSegments, StepSeries, TimeSeries

__all__ = ["LivePlotsPanel", "PlotlyLib", "plotly_lib"]


class PlotlyLib(anywidget.AnyWidget):
    """Carries plotly.js (bytes) to the front-end once per kernel; never displayed. Use `plotly_lib()`."""

    _esm = "export default {};"
    source = traitlets.Bytes(b"").tag(sync=True)
    version = traitlets.Unicode("").tag(sync=True)


_lib: PlotlyLib | None = None
_lib_lock = threading.Lock()


def _plotly_js() -> tuple[bytes, str]:
    """plotly.min.js from the installed plotly package, and its version."""
    ref = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
    data = ref.read_bytes()
    head = data[:200].decode("utf-8", "replace")
    version = head.split("plotly.js v", 1)[1].split()[0] if "plotly.js v" in head else ""
    return data, version


def plotly_lib() -> PlotlyLib:
    """The process-wide `PlotlyLib` widget (re-created if it was closed)."""
    global _lib
    with _lib_lock:
        if _lib is None or getattr(_lib, "comm", None) is None:
            data, version = _plotly_js()
            _lib = PlotlyLib(source=data, version=version)
        return _lib


class LivePlotsPanel(Panel):
    """Live plots over a running engine, six charts in one panel, all against the engine's step number:

    1. tokens per step, prefill vs decode, against `max_batch_tokens` (decode tokens also on their own right axis,
       so that they stay visible beside long prefills);
    2. requests left out per step, stacked by reason (`cbnb.core.plan.SkipReason`; the meanings in `reason_info`);
    3. KV usage by blocks and by tokens (% of the cache);
    4. prefix-cache hits in this run: tokens served, and their share of prompt tokens (%);
    5. offloads (swaps), soft resets and restores in this run, and CUDA-graph captures and replays (0 on CPU), with
       the failed captures (their shapes run eagerly) when there are any;
    6. throughput (output and prefill tokens/s) and the median TTFT and TPOT (ms).

    The charts follow the last `steps` steps. Every `RunStarted` event (the Config panel's Apply, `reset_stats`,
    this panel's "New run" button, a standard workload) starts a run segment, drawn with a labelled marker; earlier
    segments are shown faded, and "this run" figures are those of the newest segment.

    Args:
        engine: the engine.
        steps: steps kept (and shown) for every chart.
        samples: stats samples kept for plots 3-6 (one per poll while the engine works).
        poller, autostart: see `Panel`.

    Synced state: `steps` and `series` (column name -> float32 bytes; NaN marks a missing value or a line
    break), `runs` (the segment markers, `series.RunSegments`), `reasons`,
    `reason_info` (reason -> {label, meaning, fields}), `summary` (latest figures for the header line), `_lib` (the
    `PlotlyLib` model id).
    """

    _esm = _assets.esm("plots.js")
    steps = traitlets.Dict().tag(sync=True)
    series = traitlets.Dict().tag(sync=True)
    runs = traitlets.List().tag(sync=True)
    reasons = traitlets.List(traitlets.Unicode(), default_value=list(SKIP_REASONS)).tag(sync=True)
    reason_info = traitlets.Dict().tag(sync=True)
    summary = traitlets.Dict().tag(sync=True)
    window = traitlets.Int(240).tag(sync=True)
    _lib = traitlets.Unicode("").tag(sync=True)

    def __init__(self, engine: Any, *, steps: int = 240, samples: int = 600, **kwargs: Any) -> None:
        self._t0 = time.perf_counter()
        self._runs = RunSegments(_config_label(engine), t0=self._t0)
        self._step_series = StepSeries(steps, runs=self._runs, t0=self._t0)
        self._time_series = TimeSeries(time.time(), samples)
        self._last_stats_key: tuple | None = None
        # Offloads of each request seen as events since its RequestAdded ([swaps, soft resets]): a request's own
        # counters move when its step is planned, the run's when that step's events are published, so the summary
        # adds the difference and agrees with the board at every refresh.
        self._offloads_seen: dict[str, list[int]] = {}
        super().__init__(engine, **kwargs)
        self.window = steps

    def _setup(self) -> None:
        from ..telemetry.explain import REASONS

        self._lib = plotly_lib().model_id
        self.reason_info = {r: {"label": i.label, "meaning": i.meaning, "fields": list(i.fields)}
                            for r, i in REASONS.items()}
        self.runs = self._runs.to_list()

    def _needs(self) -> set[str]:
        return {"stats", "requests"}

    def _track_offloads(self, events: list) -> None:
        seen = self._offloads_seen
        for e in events:
            kind = getattr(e, "kind", "")
            if kind == "request_added":
                seen[e.request_id] = [0, 0]
            elif kind == "offload" and e.request_id in seen:
                seen[e.request_id][0 if e.path == "swap" else 1] += 1
            elif kind == "request_done":
                seen.pop(e.request_id, None)

    def _unpublished_offloads(self, requests: Any) -> tuple[int, int]:
        """(swaps, soft resets) the requests' own counters already show but the run's events do not yet."""
        swaps = resets = 0
        for r in requests or ():
            got = self._offloads_seen.get(r.request_id)
            if got is not None:
                swaps += max(0, int(r.num_offloads) - got[0])
                resets += max(0, int(r.num_soft_resets) - got[1])
        return swaps, resets

    def _values(self, frame: Frame) -> dict[str, Any]:
        out: dict[str, Any] = {}
        self._track_offloads(frame.events)
        if self._step_series.add_events(frame.events):
            out["steps"] = self._step_series.arrays()
        runs = self._runs.to_list()
        if runs != self.runs:
            out["runs"] = runs
        st = frame.stats
        if st is not None:
            run = st["run"]
            extra = self._unpublished_offloads(frame.requests)
            key = (run["steps"], run["requests_finished"], run["requests_failed"], run["requests_cancelled"],
                   run["prefix_hit_tokens"], round(run["kv_usage_blocks_frac"], 6), self._runs.current, extra)
            # Idle engine: nothing moved, so add no flat sample (keeps the charts on the activity).
            if key != self._last_stats_key or frame.events:
                self._last_stats_key = key
                step = self._step_series.last_step or None
                row = self._time_series.add_stats(frame.wall, st, step=step, run=self._runs.current)
                out["series"] = self._time_series.arrays()
                out["summary"] = self._summary(st, row, frame.requests, extra)
        return out

    def _summary(self, st: dict, row: dict, requests: Any = None, extra: tuple[int, int] = (0, 0)) -> dict[str, Any]:
        run = st["run"]
        ttft, ttft_of = row["ttft_p50_ms"], "finished"
        if ttft is None and requests:
            # No request of the run has finished yet: the p50 over those that have their first token (what the
            # board shows), said as such, rather than "-" next to a board full of TTFTs.
            firsts = sorted(r.timings.ttft_s for r in requests
                            if getattr(r.state, "name", "") in ("DECODING", "PREFILLING")
                            and r.timings.ttft_s is not None)
            if firsts:
                ttft, ttft_of = 1000 * firsts[(len(firsts) - 1) // 2], f"{len(firsts)} running"
        cfg = self.engine.config
        device = getattr(getattr(self.engine, "device", None), "type", "cpu")
        marker = self._runs.last
        return {
            "max_batch_tokens": cfg.max_batch_tokens, "device": device,
            "graphs_enabled": bool(any(cfg.cuda_graph_booleans)),
            "out_tok_s": row["out_tok_s"], "run_out_tok_s": run["output_tokens_per_s"],
            "ttft_p50_ms": ttft, "ttft_of": ttft_of, "tpot_p50_ms": row["tpot_p50_ms"],
            "prefix_hit_tokens": run["prefix_hit_tokens"], "prefix_hit_pct": run["prefix_hit_rate_pct"],
            "swaps": run["swaps"] + extra[0], "soft_resets": run["soft_resets"] + extra[1],
            "restores": run["restores"],
            "graph_captures": run["cuda_graph_captures"], "graph_replays": run["cuda_graph_replays"],
            "graph_capture_failures": run.get("cuda_graph_capture_failures", 0),
            "kv_blocks_pct": row["kv_blocks_pct"], "kv_tokens_pct": row["kv_tokens_pct"],
            "steps": run["steps"], "finished": run["requests_finished"],
            "run_index": marker["index"], "run_label": marker["label"], "run_cause": marker["cause"],
        }

    def new_run(self, label: str = "New run button") -> None:
        """Start a new run: reset the engine's run statistics; the plots start a new segment at this step."""
        self.engine.reset_stats(label)
        self.show("New run: statistics reset; the plots start a new segment.", "ok")
        self.poller.poke()

    def _on_new_run(self, _msg: dict) -> None:
        self.new_run()

    # For tests and notebooks: the latest series as NumPy arrays.
    def series_arrays(self) -> dict[str, Any]:
        """{"steps": {col: np.ndarray}, "series": {col: np.ndarray}} of what the plots show now."""
        import numpy as np

        return {"steps": {k: np.frombuffer(v, dtype=np.float32) for k, v in self.steps.items()},
                "series": {k: np.frombuffer(v, dtype=np.float32) for k, v in self.series.items()}}


def _config_label(engine: Any) -> str:
    """The first segment's label: the main sizes of the engine's config."""
    cfg = getattr(engine, "config", None)
    if cfg is None:
        return "start"
    return (f"page_size={cfg.page_size}, num_blocks={cfg.num_blocks}, max_batch_tokens={cfg.max_batch_tokens}, "
            f"{cfg.scheduler_type}")
