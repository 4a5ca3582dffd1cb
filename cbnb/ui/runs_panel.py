"""`RunsPanel`: the engine's run log as a table of config points with their spread, a side-by-side comparison of two
of them, a chart of one figure against one config field (median with min-max bars), and the chosen point's config
exported to transformers, vLLM, SGLang or `transformers serve`."""

from __future__ import annotations

import json
from typing import Any

import traitlets

from ..lab.metrics import FIGURE_LABELS, KEY_FIGURES, higher_is_better
from ..telemetry.runs import RunLog, change_text, run_log, spread
from . import _assets
from .base import Panel
from .poller import Frame

__all__ = ["RunsPanel", "group_rows", "chart_data", "EXPORT_TARGETS"]

#: Export choices: value -> label.
EXPORT_TARGETS = {"transformers": "transformers (Python)", "vllm": "vllm serve", "sglang": "SGLang",
                  "transformers-serve": "transformers serve"}


def _key(group: list) -> str:
    return "|".join(group[0].group_key())


def group_rows(log: RunLog, figures: list[str]) -> list[dict[str, Any]]:
    """One dict per group of repeats (see `RunLog.groups`), newest group last.

    Each: {"key", "engine", "workload", "arrivals", "change", "changes", "n", "ids", "config", "figures":
    {figure: [median, min, max]}}; numbers are None when no run of the group has the figure.
    """
    rows = []
    for g in log.groups():
        arr = g[0].workload.get("arrivals", {}) or {}
        rows.append({
            "key": _key(g), "engine": g[0].engine, "workload": g[0].workload.get("name", ""),
            "arrivals": _arrivals_text(arr), "change": g[0].change, "changes": dict(g[0].changes), "n": len(g),
            "ids": [r.id for r in g], "config": g[0].config,
            "figures": {f: list(spread(r.metrics.get(f) for r in g)) for f in figures},
        })
    return rows


def _arrivals_text(spec: dict[str, Any]) -> str:
    k = spec.get("kind", "offline")
    if k == "poisson":
        return f"Poisson {spec.get('rate', 0):g}/s"
    if k == "gamma":
        return f"gamma {spec.get('rate', 0):g}/s cv {spec.get('cv', 0):g}"
    return str(k)


def _sort_key(v: Any) -> tuple:
    return (0, float(v), "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0.0, str(v))


def _x_text(v: Any) -> str:
    if v is None:
        return "None"  # the field left to its default (e.g. safety_margin: the scheduler's)
    return v if isinstance(v, str) else json.dumps(v)


def chart_data(rows: list[dict[str, Any]], figure: str, field: str) -> dict[str, Any]:
    """Points of `figure` against the config field `field`, one series per engine + workload + other changes.

    Returns:
        {"figure", "field", "label", "higher_is_better", "series": [{"name", "x": [str], "median", "lo", "hi",
        "n"}]}; x values are the field's values as text, sorted numerically when they are numbers. A group's x is
        its value of `field` in its full config (so the base config is a point too); "None" for a field left to its
        default.
    """
    series: dict[str, dict[str, Any]] = {}
    for r in rows:
        med, lo, hi = r["figures"].get(figure, [None, None, None])
        if med is None:
            continue
        xv = r["changes"].get(field, r["config"].get(field))
        # One series per engine, workload and the *other* config changes, so each x holds one group.
        others = {k: v for k, v in r["changes"].items() if k != field}
        name = f"{r['engine']} · {r['workload']} · {r['arrivals']}" + (f" · {change_text(others)}" if others else "")
        s = series.setdefault(name, {"name": name, "points": []})
        s["points"].append((xv, med, lo, hi, r["n"]))
    out = []
    for s in series.values():
        pts = sorted(s["points"], key=lambda p: _sort_key(p[0]))
        out.append({"name": s["name"], "x": [_x_text(p[0]) for p in pts],
                    "median": [p[1] for p in pts], "lo": [p[2] for p in pts], "hi": [p[3] for p in pts],
                    "n": [p[4] for p in pts]})
    return {"figure": figure, "field": field, "label": FIGURE_LABELS.get(figure, figure),
            "higher_is_better": higher_is_better(figure), "series": out}


class RunsPanel(Panel):
    """The run log (``engine.runs``) as a table, a comparison, a chart and an export.

    Python API (each also reachable from the panel's controls):
        `select(key_a, key_b=None)`: the groups to compare side by side (the first is the one exported);
        `set_chart(figure, field)`: what the chart shows; `export(target)`: the selected group's config as
        code / command text in `export_text`.

    Synced state:
        rows: `group_rows(...)` of the log; figures: [[name, label, higher_is_better]]; fields: config fields that
        vary across the rows (chart x choices); selected: up to two row keys; chart_figure, chart_field, chart:
        `chart_data(...)`; export_target; export_text; log_size: entries in the log.
    """

    _esm = _assets.esm("runs.js")
    _css = _assets.css() + "\n" + _assets.read_asset("runs.css")
    rows = traitlets.List().tag(sync=True)
    figures = traitlets.List().tag(sync=True)
    fields = traitlets.List(traitlets.Unicode()).tag(sync=True)
    selected = traitlets.List(traitlets.Unicode()).tag(sync=True)
    chart_figure = traitlets.Unicode("goodput_requests_per_s").tag(sync=True)
    chart_field = traitlets.Unicode("page_size").tag(sync=True)
    chart = traitlets.Dict().tag(sync=True)
    export_target = traitlets.Unicode("transformers").tag(sync=True)
    export_targets = traitlets.Dict(EXPORT_TARGETS).tag(sync=True)
    export_text = traitlets.Unicode("").tag(sync=True)
    log_size = traitlets.Int(0).tag(sync=True)

    def __init__(self, engine: Any, *, log: RunLog | None = None, figures: list[str] | None = None,
                 **kwargs: Any) -> None:
        self._log = log
        self._figs = list(figures or KEY_FIGURES)
        self._seen_version = -1
        super().__init__(engine, **kwargs)

    @property
    def log(self) -> RunLog:
        """The log shown (the engine's ``engine.runs`` unless one was given)."""
        return self._log if self._log is not None else run_log(self.engine)

    def _setup(self) -> None:
        self.figures = [[f, FIGURE_LABELS.get(f, f), higher_is_better(f)] for f in self._figs]
        self.observe(self._on_chart_choice, names=["chart_figure", "chart_field"])
        self.observe(self._on_selected, names=["selected"])
        self.observe(self._on_target, names=["export_target"])
        self.refresh()

    # ------------------------------------------------------------------------------------------ state
    def refresh(self) -> None:
        """Re-read the run log (the poller calls this whenever the log changed)."""
        log = self.log
        self._seen_version = log.version
        rows = group_rows(log, self._figs)
        varying = sorted({k for r in rows for k in r["changes"]})
        keys = {r["key"] for r in rows}
        with self._lock, self.hold_sync():
            self.rows = rows
            self.log_size = len(log)
            self.fields = varying or ["page_size"]
            if self.chart_field not in self.fields:
                self.chart_field = self.fields[0]
            sel = [k for k in self.selected if k in keys]
            if sel != list(self.selected):
                self.selected = sel
            self.chart = chart_data(rows, self.chart_figure, self.chart_field)
        self._render_export()

    def _on_chart_choice(self, _change: Any) -> None:
        if self.chart_figure not in self._figs:
            self.show(f"unknown figure {self.chart_figure!r}; choose one of {', '.join(self._figs)}", "error")
            return
        self.chart = chart_data(self.rows, self.chart_figure, self.chart_field)

    def _on_selected(self, _change: Any) -> None:
        if len(self.selected) > 2:
            self.selected = list(self.selected)[-2:]
            return
        self._render_export()

    def _on_target(self, _change: Any) -> None:
        self._render_export()

    # ------------------------------------------------------------------------------------------ actions
    def select(self, a: str, b: str | None = None) -> None:
        """Compare the groups with keys `a` and `b` (the key column of `rows`); `a` is the one exported.

        Raises:
            KeyError: an unknown key.
        """
        keys = {r["key"] for r in self.rows}
        for k in (a, b):
            if k is not None and k not in keys:
                raise KeyError(f"no run group with key {k!r}")
        self.selected = [a] if b is None else [a, b]

    def set_chart(self, figure: str, field: str) -> None:
        """Chart `figure` (a metric name) against the config field `field`."""
        with self.hold_sync():
            self.chart_figure = figure
            self.chart_field = field

    def export(self, target: str | None = None) -> str:
        """The selected group's config for `target` (see `EXPORT_TARGETS`); also shown on the panel.

        Raises:
            ValueError: an unknown target.
        """
        if target is not None:
            if target not in EXPORT_TARGETS:
                raise ValueError(f"export target must be one of {', '.join(EXPORT_TARGETS)}; got {target!r}")
            self.export_target = target
        self._render_export()
        return self.export_text

    def config_of(self, key: str) -> Any:
        """The `ContinuousBatchingConfig` of a group (its first run's config)."""
        from ..core.config import ContinuousBatchingConfig

        row = next(r for r in self.rows if r["key"] == key)
        fields = {k: (tuple(v) if isinstance(v, list) else v) for k, v in row["config"].items()}
        return ContinuousBatchingConfig(**fields)

    def _render_export(self) -> None:
        if not self.selected:
            self.export_text = ""
            return
        key = self.selected[0]
        row = next((r for r in self.rows if r["key"] == key), None)
        if row is None:
            self.export_text = ""
            return
        try:
            cfg = self.config_of(key)
            target = self.export_target
            if target == "transformers":
                text = f"# run(s) {', '.join(map(str, row['ids']))}: {change_text(row['changes'])}\n" + cfg.to_code()
            else:
                from ..export import TARGETS

                text = TARGETS[target](cfg, model=getattr(self.engine, "model_id", None) or "MODEL").report()
        except Exception as e:  # a config from an old log may not load: say so on the panel
            text = ""
            self.show(f"export failed: {type(e).__name__}: {e}", "error")
        self.export_text = text

    def _on_select(self, msg: dict) -> None:
        keys = [str(k) for k in (msg.get("keys") or [])][:2]
        self.selected = keys

    def _on_export(self, msg: dict) -> None:
        self.export(str(msg.get("target") or self.export_target))
        self.show(f"Exported run group {', '.join(map(str, self._selected_ids()))} to {self.export_target}.", "ok")

    def _selected_ids(self) -> list[int]:
        row = next((r for r in self.rows if self.selected and r["key"] == self.selected[0]), None)
        return row["ids"] if row else []

    # ------------------------------------------------------------------------------------------ poller
    def _update(self, frame: Frame) -> None:
        if self.log.version != self._seen_version:
            self.refresh()
