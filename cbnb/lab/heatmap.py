"""A sweep's figure as a heatmap over two config fields (one panel per value of a third): `heatmap_grid` (the
numbers, no dependencies) and `heatmap` (a plotly figure; plotly is imported only when it is called).

::

    result = sweep(sim, workload, {"page_size": [16, 64, 256], "safety_margin": [0.0, 0.2],
                                   "max_batch_tokens": [2048, 8192]}, repeats=1)
    heatmap(result, x="page_size", y="max_batch_tokens", facet="safety_margin").show()

Each cell is the median of the point's repeats (`cbnb.lab.runs.spread`); min and max are kept for the hover text. Works
for any `cbnb.lab.tuning.SweepResult` (real engine or simulator).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .metrics import FIGURE_LABELS, higher_is_better
from ..telemetry.runs import provenance_text, spread

__all__ = ["HeatmapGrid", "heatmap_grid", "heatmap"]


@dataclass
class HeatmapGrid:
    """A figure on an x by y grid per facet value.

    Attributes:
        figure, x, y, facet: the figure and the config fields (facet None: one panel).
        xs, ys, facets: the sorted values of each field (facets ``[None]`` without a facet field).
        median, low, high: ``[facet][y][x]`` -> float, or None where no point ran (or it lacks the figure).
        runs: ``[facet][y][x]`` -> number of runs in the cell.
        best: (facet value, y value, x value, median) of the best cell (by `higher_is_better`); None if empty.
    """

    figure: str
    x: str
    y: str
    facet: str | None
    xs: list[Any]
    ys: list[Any]
    facets: list[Any]
    median: list[list[list[float | None]]]
    low: list[list[list[float | None]]]
    high: list[list[list[float | None]]]
    runs: list[list[list[int]]]
    best: tuple[Any, Any, Any, float] | None


def _sorted(values: set[Any]) -> list[Any]:
    try:
        return sorted(values)
    except TypeError:  # mixed types (e.g. None and ints): keep a stable order by text
        return sorted(values, key=repr)


def heatmap_grid(result: Any, x: str, y: str, figure: str = "goodput_requests_per_s", *, facet: str | None = None,
                 workload: str | None = None) -> HeatmapGrid:
    """Arrange a sweep's medians of `figure` on the grid `x` by `y` (by `facet`).

    Args:
        result: a `cbnb.lab.tuning.SweepResult`.
        x, y, facet: config fields that the sweep's points set (``result.points``).
        figure: a run metric (e.g. "goodput_requests_per_s", "ttft_s_p99").
        workload: for a sweep over several workloads, the one to show (its label).

    Raises:
        ValueError: a field that no point sets (named, with the fields that are), or two points that fall in
            the same cell (a varying field that is not x, y or facet).
    """
    fields = [f for f in (x, y, facet) if f is not None]
    known = sorted({k for p in result.points for k in p})
    for name, f in (("x", x), ("y", y), ("facet", facet)):
        if f is not None and any(f not in p for p in result.points):
            raise ValueError(f"{name}={f!r} is not set by every point of the sweep; its fields: {', '.join(known)}")
    if len(set(fields)) != len(fields):
        raise ValueError(f"x, y and facet must be different fields; got {fields}")
    if workload is None and len(getattr(result, "workloads", []) or []) > 1:
        raise ValueError(f"this sweep ran {len(result.workloads)} workloads: name one with workload= "
                         f"({', '.join(result.workloads)})")
    cells: dict[tuple[Any, Any, Any], tuple[int, list[Any]]] = {}
    for group in result.groups(workload):
        p = int(group[0].point or 0)
        point = result.points[p]
        key = (point[facet] if facet else None, point[y], point[x])
        if key in cells and cells[key][0] != p:
            other = result.points[cells[key][0]]
            diff = sorted(k for k in set(point) | set(other) if point.get(k) != other.get(k))
            raise ValueError(f"points {other} and {point} fall in the same cell: they differ in {diff}, which is "
                             "not x, y or facet")
        cells[key] = (p, [r.metrics.get(figure) for r in group])
    xs = _sorted({k[2] for k in cells})
    ys = _sorted({k[1] for k in cells})
    facets = _sorted({k[0] for k in cells}) if facet else [None]
    up = higher_is_better(figure)

    def empty() -> list[list[list[Any]]]:
        return [[[None] * len(xs) for _ in ys] for _ in facets]

    med, lo, hi, n = empty(), empty(), empty(), [[[0] * len(xs) for _ in ys] for _ in facets]
    best = None
    for (fv, yv, xv), (_, values) in cells.items():
        i, j, k = facets.index(fv), ys.index(yv), xs.index(xv)
        m, a, b = spread(values)
        med[i][j][k], lo[i][j][k], hi[i][j][k] = m, a, b
        n[i][j][k] = sum(v is not None for v in values)
        if m is not None and (best is None or (m > best[3] if up else m < best[3])):
            best = (fv, yv, xv, m)
    return HeatmapGrid(figure, x, y, facet, xs, ys, facets, med, lo, hi, n, best)


def _band(result: Any) -> str:
    """The error band of a simulated sweep's profile(s), for the title ("" for measured runs): every simulated
    figure a user sees carries it."""
    labels = sorted({f"{r.provenance.get('profile', '')}: {provenance_text(r.provenance)}"
                     for r in getattr(result, "runs", []) or []
                     if (getattr(r, "provenance", None) or {}).get("kind", "measured") != "measured"})
    return f"<br><sup>simulated on {'; '.join(labels)}</sup>" if labels else ""


def heatmap(result: Any, x: str, y: str, figure: str = "goodput_requests_per_s", *, facet: str | None = None,
            workload: str | None = None, title: str | None = None, digits: int = 2):
    """A plotly figure of `heatmap_grid(...)`: one heatmap per facet value, medians written in the cells, the
    best cell outlined, min-max and run count in the hover text; a simulated sweep's title carries its profile's
    error band ("datasheet: unverified", "±5.6 % on 6 held-out public points"). Needs plotly (``pip install
    plotly``).

    Raises:
        ValueError: as `heatmap_grid`. ImportError: plotly is not installed.
    """
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    g = heatmap_grid(result, x, y, figure, facet=facet, workload=workload)
    label = FIGURE_LABELS.get(figure, figure)
    names = [f"{facet}={v}" for v in g.facets] if facet else [""]
    fig = make_subplots(rows=1, cols=len(g.facets), subplot_titles=names if facet else None, shared_yaxes=True,
                        horizontal_spacing=0.04)
    vals = [v for f in g.median for row in f for v in row if v is not None]
    zmin, zmax = (min(vals), max(vals)) if vals else (0.0, 1.0)
    xt, yt = [str(v) for v in g.xs], [str(v) for v in g.ys]
    for i, _ in enumerate(g.facets):
        hover = [[(f"{x}={xt[k]}<br>{y}={yt[j]}<br>{label}: "
                   + ("n/a" if g.median[i][j][k] is None else
                      f"{g.median[i][j][k]:.{digits}f} [{g.low[i][j][k]:.{digits}f}-{g.high[i][j][k]:.{digits}f}]")
                   + f"<br>runs: {g.runs[i][j][k]}") for k in range(len(xt))] for j in range(len(yt))]
        fig.add_trace(go.Heatmap(z=g.median[i], x=xt, y=yt, zmin=zmin, zmax=zmax, coloraxis="coloraxis",
                                 text=hover, hoverinfo="text", texttemplate=f"%{{z:.{digits}f}}"), 1, i + 1)
        fig.update_xaxes(title_text=x, type="category", row=1, col=i + 1)
    fig.update_yaxes(title_text=y, type="category", row=1, col=1)
    if g.best is not None:
        fv, yv, xv, m = g.best
        col = g.facets.index(fv) + 1
        fig.add_trace(go.Scatter(x=[str(xv)], y=[str(yv)], mode="markers", name="best",
                                 marker=dict(symbol="square-open", size=38, line=dict(width=3), color="black"),
                                 hoverinfo="skip", showlegend=False), 1, col)
    best_txt = "" if g.best is None else (f" (best: {x}={g.best[2]}, {y}={g.best[1]}"
                                          + (f", {facet}={g.best[0]}" if facet else "") + f": {g.best[3]:.{digits}f})")
    fig.update_layout(title=title or f"{label} by {x} x {y}" + (f" x {facet}" if facet else "") + best_txt
                      + _band(result),
                      coloraxis=dict(colorscale="Viridis" if higher_is_better(figure) else "Viridis_r",
                                     colorbar=dict(title=label)),
                      height=380, margin=dict(l=60, r=20, t=80, b=50))
    return fig
