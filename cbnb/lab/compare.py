"""Predicted against measured: the same workload's `cbnb.lab.runs.Run` from a `SimEngine` and from a real engine, as a
table of latency percentiles and throughput (`compare_runs`) and a plotly figure (`compare_figure`: the percentiles
side by side, and each request's end-to-end latency predicted against measured). Torch-free; plotly is imported
only by `compare_figure`.

::

    measured = run_workload(engine, wl, slo=slo)     # the real engine (wall clock)
    predicted = run_workload(sim, wl, slo=slo)       # the simulator (virtual clock), same config and traffic
    compare_runs(predicted, measured)                 # rows: figure, predicted, measured, error
    compare_figure(predicted, measured).show()
"""

from __future__ import annotations

from typing import Any

from .metrics import FIGURE_LABELS
from ..telemetry.runs import provenance_text

__all__ = ["COMPARED", "compare_runs", "compare_figure"]

# The figures compared: latency percentiles (s) and throughput.
COMPARED = ("ttft_s_p50", "ttft_s_p90", "ttft_s_p99", "tpot_s_p50", "tpot_s_p90", "tpot_s_p99", "e2e_s_p50",
            "e2e_s_p99", "output_tokens_per_s", "goodput_requests_per_s", "duration_s")


def compare_runs(predicted: Any, measured: Any, figures: tuple[str, ...] = COMPARED) -> list[dict[str, Any]]:
    """One row per figure: {"figure", "label", "predicted", "measured", "error"}; error = (predicted - measured) /
    measured (None when either is missing or measured is 0).

    Raises:
        ValueError: the two runs are not of the same number of requests (not the same workload).
    """
    if len(predicted.records) != len(measured.records):
        raise ValueError(f"predicted has {len(predicted.records)} requests and measured {len(measured.records)}: "
                         "compare runs of the same workload")
    rows = []
    for f in figures:
        p, m = predicted.metrics.get(f), measured.metrics.get(f)
        err = (p - m) / m if isinstance(p, (int, float)) and isinstance(m, (int, float)) and m else None
        rows.append({"figure": f, "label": FIGURE_LABELS.get(f, f), "predicted": p, "measured": m, "error": err})
    return rows


def compare_figure(predicted: Any, measured: Any, *, title: str | None = None):
    """A plotly figure: left, TTFT/TPOT/e2e percentiles (ms) predicted and measured side by side; right, each
    request's e2e latency (s), predicted against measured, with the y = x line. Needs plotly.

    Raises:
        ValueError: as `compare_runs`. ImportError: plotly is not installed.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = [r for r in compare_runs(predicted, measured) if r["figure"].split("_s_")[0] in ("ttft", "tpot", "e2e")]
    fig = make_subplots(rows=1, cols=2, column_widths=[0.6, 0.4],
                        subplot_titles=("latency percentiles (ms)", "each request's e2e (s)"))
    names = [r["figure"].replace("_s_", " ") for r in rows]
    for key, label, color in (("predicted", "predicted (simulator)", "#636efa"),
                              ("measured", "measured (engine)", "#ef553b")):
        fig.add_trace(go.Bar(x=names, y=[None if r[key] is None else 1000 * r[key] for r in rows], name=label,
                             marker_color=color), 1, 1)
    pairs = [(m.e2e_s, p.e2e_s) for p, m in zip(predicted.records, measured.records)
             if p.e2e_s is not None and m.e2e_s is not None]
    if pairs:
        xs, ys = zip(*pairs)
        top = max(max(xs), max(ys))
        fig.add_trace(go.Scatter(x=list(xs), y=list(ys), mode="markers", name="requests",
                                 marker=dict(size=6, color="#00cc96")), 1, 2)
        fig.add_trace(go.Scatter(x=[0, top], y=[0, top], mode="lines", name="predicted = measured",
                                 line=dict(dash="dash", color="gray")), 1, 2)
    fig.update_xaxes(title_text="measured e2e (s)", row=1, col=2)
    fig.update_yaxes(title_text="predicted e2e (s)", row=1, col=2)
    prov = getattr(predicted, "provenance", None) or {}
    default = "predicted vs measured"
    if prov and prov.get("kind") != "measured":  # say how far the prediction goes, where it is read
        default = (f"predicted ({prov.get('profile', '')}: {provenance_text(prov)}; cbnb's scheduler, not vLLM's) "
                   "vs measured")
    fig.update_layout(barmode="group", height=380, title=title or default,
                      margin=dict(l=60, r=20, t=70, b=50))
    return fig
