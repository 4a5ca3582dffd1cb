"""Load sweeps: one workload at rising load, the throughput-latency curve, and its knee (torch-free; plotly to draw).

::

    from cbnb.lab.load_sweep import load_sweep, plot_load
    real = load_sweep(engine, wl, concurrencies=[1, 2, 4, 8])        # closed loop, as vllm bench --max-concurrency
    sim = load_sweep(sim_engine, wl, concurrencies=[1, 2, 4, 8])
    plot_load(real, sim)                                             # side by side on the same axes, knees marked

A point is one `cbnb.lab.tuning.run_workload` of the workload either open loop at a Poisson rate (``rates=``: the
workload's requests re-timed with `cbnb.lab.workloads.with_arrivals`) or closed loop at a concurrency
(``concurrencies=``: every request ready at 0, at most C in flight, see `cbnb.lab.driver`). Each point starts on a
fresh cache (``reconfigure`` with the engine's own config, when it has one), so no point hits the previous one's
prefix cache.

The knee (`knee`). Two definitions, both computed on (throughput, latency) with throughput on x:

- ``"threshold"`` (default): the last point, in order of load, whose latency is at most ``k`` times the latency at
  the lowest load (k = 2 by default): past it, waiting in the queue dominates. This is the operating-point rule of
  thumb of capacity planning ("run where latency is still within k x of the unloaded latency"; e.g. Jain, *The Art
  of Computer Systems Performance Analysis*, 1991, ch. 33, where the knee capacity is the load beyond which
  response time rises sharply);
- ``"kneedle"``: the point of maximum curvature by the Kneedle method (Satopaa, Albrecht, Irwin, Raghavan, "Finding
  a 'Kneedle' in a Haystack: Detecting Knee Points in System Behavior", ICDCS workshops 2011): both axes normalised
  to [0, 1], the knee is where the normalised latency lies furthest below the chord from the first to the last
  point (``x_n - y_n`` largest, for a rising convex curve).

The curve carries which definition it used (`LoadCurve.knee_rule`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from .metrics import SLO

__all__ = ["LoadCurve", "load_sweep", "knee", "plot_load", "CURVE_FIGURES"]

#: The figures a load curve keeps per point.
CURVE_FIGURES = ("output_tokens_per_s", "requests_per_s", "ttft_s_p50", "ttft_s_p99", "tpot_s_p50", "tpot_s_p99",
                 "e2e_s_p99", "requests_failed", "duration_s")


def knee(throughput: Sequence[float], latency: Sequence[float | None], *, method: str = "threshold",
         k: float = 2.0) -> int | None:
    """Index of the knee of a latency-vs-throughput curve (points in order of rising load).

    Args:
        throughput: x (e.g. output tokens/s), one per point.
        latency: y (e.g. TTFT p99 seconds), one per point; None (no finished request) ends the usable curve.
        method: "threshold" (last point with latency <= k x the first point's) or "kneedle" (maximum curvature,
            Satopaa et al. 2011); see the module doc.
        k: the threshold's factor (> 1).

    Returns:
        The index, or None with fewer than 2 usable points (for "kneedle": 3).

    Raises:
        ValueError: lengths differ, an unknown method, or k <= 1.
    """
    if len(throughput) != len(latency):
        raise ValueError(f"throughput has {len(throughput)} points and latency {len(latency)}")
    if method not in ("threshold", "kneedle"):
        raise ValueError(f"method must be 'threshold' or 'kneedle'; got {method!r}")
    if not (isinstance(k, (int, float)) and k > 1):
        raise ValueError(f"k must be a number > 1; got {k!r}")
    pts: list[tuple[float, float]] = []
    for x, y in zip(throughput, latency):
        if y is None or x is None or not math.isfinite(y):
            break
        pts.append((float(x), float(y)))
    if method == "threshold":
        if len(pts) < 2:
            return None
        base = pts[0][1]
        last = 0
        for i, (_, y) in enumerate(pts):
            if y > k * base:
                break  # the first point past k x ends the search (a noisy dip later does not move the knee)
            last = i
        return last
    if len(pts) < 3:
        return None
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x1 <= x0 or y1 <= y0:
        return None
    diff = [(x - x0) / (x1 - x0) - (y - y0) / (y1 - y0) for x, y in pts]
    return max(range(len(pts)), key=lambda i: diff[i])


@dataclass
class LoadCurve:
    """The points of one load sweep on one engine.

    Attributes:
        engine: the engine's run-log name ("cbnb", "sim-h100-sxm", ...).
        kind: "rate" (open loop, requests/s) or "concurrency" (closed loop, requests in flight).
        loads: the load of each point, rising.
        runs: the `cbnb.lab.runs.Run` of each point.
        points: per point {"load", and `CURVE_FIGURES`}.
        knee_rule: {"method", "k", "figure"}: how `knee_index` was found.
        knee_index: the knee's point (None: too few usable points).
        provenance: where the engine's figures come from (`cbnb.lab.tuning.provenance`: "measured" for a real engine,
            the simulator profile's kind and error).
    """

    engine: str
    kind: str
    loads: list[float]
    runs: list[Any] = field(default_factory=list)
    points: list[dict[str, Any]] = field(default_factory=list)
    knee_rule: dict[str, Any] = field(default_factory=dict)
    knee_index: int | None = None
    provenance: dict[str, Any] = field(default_factory=dict)

    def frame(self):
        """One row per point (pandas)."""
        import pandas as pd

        df = pd.DataFrame(self.points)
        df.insert(0, "engine", self.engine)
        df["knee"] = [i == self.knee_index for i in range(len(self.points))]
        return df

    @property
    def knee_point(self) -> dict[str, Any] | None:
        return None if self.knee_index is None else self.points[self.knee_index]

    def find_knee(self, figure: str = "ttft_s_p99", *, method: str = "threshold", k: float = 2.0) -> int | None:
        """Recompute the knee on another figure or rule; sets and returns `knee_index`."""
        xs = [p["output_tokens_per_s"] for p in self.points]
        ys = [p.get(figure) for p in self.points]
        self.knee_rule = {"method": method, "k": k, "figure": figure}
        self.knee_index = knee(xs, ys, method=method, k=k)
        return self.knee_index


def _loads(rates: Iterable[float] | None, concurrencies: Iterable[int] | None) -> tuple[str, list[float]]:
    if (rates is None) == (concurrencies is None):
        raise ValueError("give exactly one of rates= (requests/s, open loop) or concurrencies= (closed loop)")
    if rates is not None:
        vals = [float(r) for r in rates]
        for r in vals:
            if not (math.isfinite(r) and r > 0):
                raise ValueError(f"rates must be numbers of requests/s > 0; got {r!r}")
        kind = "rate"
    else:
        vals = list(concurrencies)  # type: ignore[arg-type]
        for c in vals:
            if not isinstance(c, int) or isinstance(c, bool) or c < 1:
                raise ValueError(f"concurrencies must be integers >= 1; got {c!r}")
        kind = "concurrency"
    if not vals:
        raise ValueError(f"no {kind} to run")
    return kind, sorted(vals)


def load_sweep(engine: Any, workload: Any, *, rates: Iterable[float] | None = None,
               concurrencies: Iterable[int] | None = None, slo: SLO | None = None, figure: str = "ttft_s_p99",
               knee_method: str = "threshold", k: float = 2.0, timeout: float | None = 3600.0,
               log: Any = False, progress: bool = False, warmup: bool = True) -> LoadCurve:
    """Run `workload` on `engine` at each load (one run per point) and find the knee.

    Args:
        rates: Poisson arrival rates (requests/s), open loop; or
        concurrencies: closed-loop concurrencies (requests in flight; arrivals all at 0).
        slo: the goodput objective stored with every run.
        figure: the latency the knee is found on (default TTFT p99).
        knee_method, k: see `knee`.
        timeout: wall seconds per run.
        log: as `run_workload`'s (default False: the points are not recorded in the engine's run log).
        progress: print one line per point.
        warmup: one short unrecorded request on each point's fresh cache before its run (`cbnb.lab.tuning.warm_up`,
            as `sweep` does): without it the process's first forwards land on the lowest load, whose latencies the
            threshold knee is relative to (cpu-poisson on the real engine, 2026-12-05: concurrency 1 TTFT p99 1.64 s
            cold against 0.35 s warm, which moved the knee from 4 to 8).

    Returns:
        A `LoadCurve`; a point whose requests failed is kept (its ``requests_failed`` says so) but ends the curve the
        knee is searched on, as its latencies cover the other requests only.

    Raises:
        ValueError: neither or both of rates / concurrencies, or a bad value in them.
    """
    from .traffic import Offline, Poisson
    from .tuning import engine_name, provenance, reconfigure, run_workload, warm_up
    from .workloads import with_arrivals

    kind, loads = _loads(rates, concurrencies)
    curve = LoadCurve(engine_name(engine), kind, loads, provenance=provenance(engine))
    offline = with_arrivals(workload, Offline()) if kind == "concurrency" else None
    for load in loads:
        cfg = getattr(engine, "user_config", None)
        if cfg is not None and hasattr(engine, "reconfigure"):
            reconfigure(engine, cfg)  # a fresh cache per point
        if warmup:
            warm_up(engine, workload)
        if kind == "rate":
            wl = with_arrivals(workload, Poisson(load))
            run = run_workload(engine, wl, slo=slo, timeout=timeout, log=log, label=f"rate {load:g}")
        else:
            run = run_workload(engine, offline, slo=slo, timeout=timeout, log=log, max_concurrency=int(load),
                               label=f"concurrency {int(load)}")
        curve.runs.append(run)
        m = run.metrics
        curve.points.append({"load": load, **{f: m.get(f) for f in CURVE_FIGURES}})
        if progress:
            print(f"{curve.engine} {kind} {load:g}: {m['output_tokens_per_s']:.1f} out tok/s, TTFT p99 "
                  f"{m['ttft_s_p99']}, TPOT p99 {m['tpot_s_p99']}")
    usable = []
    for p in curve.points:
        if p.get("requests_failed"):
            break
        usable.append(p)
    xs = [p["output_tokens_per_s"] for p in usable]
    ys = [p.get(figure) for p in usable]
    curve.knee_rule = {"method": knee_method, "k": k, "figure": figure}
    curve.knee_index = knee(xs, ys, method=knee_method, k=k)
    return curve


def plot_load(*curves: LoadCurve, title: str | None = None):
    """Throughput (output tok/s, x) vs TTFT and TPOT (p50 dashed, p99 solid; log y), one colour per curve, each
    curve's knee marked with a star on both panels; real engine and simulator side by side when both are given.

    Raises:
        ValueError: no curve.
        ImportError: plotly is not installed.
    """
    if not curves:
        raise ValueError("plot_load needs at least one LoadCurve")
    import plotly.graph_objects as go
    from plotly.colors import DEFAULT_PLOTLY_COLORS
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=("TTFT", "TPOT"), horizontal_spacing=0.1)
    for ci, c in enumerate(curves):
        color = DEFAULT_PLOTLY_COLORS[ci % len(DEFAULT_PLOTLY_COLORS)]
        xs = [p["output_tokens_per_s"] for p in c.points]
        text = [f"{c.kind} {p['load']:g}" for p in c.points]
        for col, base in ((1, "ttft_s"), (2, "tpot_s")):
            for pct, dash in (("p50", "dash"), ("p99", "solid")):
                fig.add_trace(go.Scatter(
                    x=xs, y=[p.get(f"{base}_{pct}") for p in c.points], text=text, mode="lines+markers",
                    name=f"{c.engine} {pct}", legendgroup=f"{c.engine} {pct}", showlegend=col == 1,
                    line={"color": color, "dash": dash},
                    hovertemplate="%{text}<br>%{x:.1f} tok/s<br>%{y:.4g} s<extra>" + f"{c.engine} {base} {pct}"
                                  "</extra>"), row=1, col=col)
            if c.knee_index is not None:
                kp = c.points[c.knee_index]
                rule = c.knee_rule
                how = (f"p99 within {rule.get('k', 2):g}x of lowest load" if rule.get("method") == "threshold"
                       else "max curvature (Kneedle)")
                fig.add_trace(go.Scatter(
                    x=[kp["output_tokens_per_s"]], y=[kp.get(f"{base}_p99")], mode="markers",
                    marker={"symbol": "star", "size": 16, "color": color, "line": {"width": 1, "color": "black"}},
                    name=f"{c.engine} knee ({how}, on {rule.get('figure')})", legendgroup=f"{c.engine} knee",
                    showlegend=col == 1,
                    hovertemplate=f"knee: {c.kind} {kp['load']:g}<br>%{{x:.1f}} tok/s<br>%{{y:.4g}} s<extra></extra>"),
                    row=1, col=col)
    for col in (1, 2):
        fig.update_xaxes(title_text="output tokens/s", row=1, col=col)
        fig.update_yaxes(type="log", title_text="seconds", row=1, col=col)
    names = " vs ".join(c.engine for c in curves)
    fig.update_layout(title=title or f"Throughput vs latency ({names}; star: knee)", height=420)
    return fig


def main(argv: list[str] | None = None) -> int:
    """``python -m cbnb.lab.load_sweep``: a workload's load curve on the real engine and/or the simulator, with the
    knee plot written as HTML (see ``--help``)."""
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser(prog="python -m cbnb.lab.load_sweep", description=main.__doc__)
    ap.add_argument("--workload", default="cpu-poisson", help="a standard workload (default cpu-poisson)")
    ap.add_argument("--scale", type=float, default=0.5, help="get_workload's scale (default 0.5)")
    ap.add_argument("--concurrencies", default="1,2,4,8", help="closed-loop concurrencies, comma-separated")
    ap.add_argument("--rates", default=None, help="open-loop Poisson rates (req/s) instead of concurrencies")
    ap.add_argument("--real", action="store_true", help="run the real engine (smollm2-135m, float32, CPU)")
    ap.add_argument("--profile", default=None, help="also simulate on this profile (a name or JSON path); "
                                                     "'calibrate': measure this CPU first (not saved)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for the real engine (default 1)")
    ap.add_argument("--html", default="load_curve.html", help="where to write the plot")
    ap.add_argument("--json", default=None, help="also write the curves' points as JSON")
    args = ap.parse_args(argv)
    from ..core.config import ContinuousBatchingConfig
    from .workloads import get_workload

    wl = get_workload(args.workload, scale=args.scale)
    cfg = ContinuousBatchingConfig(**wl.config_hints)
    loads: dict[str, Any] = ({"rates": [float(x) for x in args.rates.split(",")]} if args.rates else
                             {"concurrencies": [int(x) for x in args.concurrencies.split(",")]})
    curves = []
    model = None
    print(f"load average before: {os.getloadavg()}")
    if args.real:
        import torch

        import cbnb

        torch.set_num_threads(args.threads)
        model, tok = cbnb.load_model(wl.model)
        with cbnb.Engine(model, tok, cfg) as eng:
            curves.append(load_sweep(eng, wl, progress=True, **loads))
    if args.profile:
        from ..measure import calibrate
        from ..sim import SimEngine

        prof = (calibrate(wl.model, save=False, threads=args.threads, model=model) if args.profile == "calibrate"
                else args.profile)
        curves.append(load_sweep(SimEngine(wl.model, prof, cfg, dtype=wl.dtype), wl, progress=True, **loads))
    print(f"load average after: {os.getloadavg()}")
    if not curves:
        ap.error("nothing to run: give --real and/or --profile")
    for c in curves:
        kp = c.knee_point
        print(f"{c.engine} [{c.provenance.get('kind')}]: knee at {c.kind} {kp['load'] if kp else None} "
              f"({c.knee_rule})")
        print(c.frame().to_string(index=False))
    plot_load(*curves, title=f"{args.workload} (scale {args.scale}): throughput vs latency").write_html(args.html)
    print(f"wrote {args.html}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([{"engine": c.engine, "kind": c.kind, "points": c.points, "knee_index": c.knee_index,
                        "knee_rule": c.knee_rule, "provenance": c.provenance} for c in curves], f, indent=1,
                      default=str)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
