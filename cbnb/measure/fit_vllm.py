"""Fit a hardware profile to the user's own ``vllm bench serve`` runs (torch-free).

::

    from cbnb.measure.fit_vllm import fit_profile
    fit = fit_profile(["c8.json", "c32.json", "r4.json"], shape="llama-3.1-8b", profile="h100-sxm")
    print(fit.report())                      # error per run (fitted) and leave-one-out over the files
    sim = SimEngine("llama-3.1-8b", fit.profile)

The files. ``vllm bench serve ... --save-result --save-detailed`` writes one JSON object per run (vLLM 0.33's
``vllm/benchmarks/serve.py``; without ``--save-detailed`` the per-request lists are removed and a run cannot be
replayed). Read here (`read_vllm_result`), all times in seconds:

=======================  ========================================================================================
``input_lens``           prompt tokens per request
``output_lens``          output tokens per request (0 for a failed one)
``ttfts``                per request: start -> first token
``itls``                 per request: the gaps between consecutive tokens (a list each)
``start_times``          per request: when it started (after the client's concurrency semaphore), perf_counter s
``queue_times``          optional: per request, the time spent waiting for that semaphore
``errors``               per request: "" when it succeeded
``duration``             the benchmark's duration (first start to the last request's end)
``max_concurrency``      the client's ``--max-concurrency`` (null: unbounded)
``request_rate``         ``--request-rate`` (a number, or the string "inf": every request at 0)
``burstiness``           the gamma shape of the arrivals (1: Poisson); only informative
=======================  ========================================================================================

The replay (`VllmRun.workload`): the same prompt and output lengths (random token ids), arriving at
``start_time - queue_time`` relative to the first (all at 0 for ``request_rate: "inf"``), closed loop at
``max_concurrency`` when it is set (`cbnb.lab.driver`), on `SimEngine` with the given config. Failed requests are left
out.

The fit. Three factors of the profile: ``flops_efficiency`` (compute), ``bandwidth_efficiency`` (memory
bandwidth) and the fixed step cost (``step_overhead_s`` and ``step_overhead_graph_s`` scaled together), found by
Nelder-Mead over their logarithms (bounded: efficiencies in [0.02, 1], the step cost in [1 us, 1 s]) minimising the
sum over runs and figures of ``log(predicted / measured) ** 2``. With async batching (GPU profiles) the host's step
cost hides behind the device's unless it is the longer one, so the fitted step cost is then poorly determined
(any value below the device time fits): read the fit's error, not the factors. The figures (`FIGURES`): duration,
median TTFT and median TPOT (per request ``mean(itls)``, vLLM's TPOT). The error of a run is the mean absolute
relative error of its figures, in percent; `FitResult` gives it on the fitted runs and, with ``leave_one_out=True``, for each file
predicted by a profile fitted on the other files.

What it is not: the simulator replays cbnb's scheduler (transformers' policy), not vLLM's; the fitted factors absorb
the difference on traffic like the runs, so a fitted profile predicts vLLM-like figures for such traffic, not vLLM's
scheduling decisions.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..sim.profiles import HardwareProfile, load_profile

__all__ = ["VllmRun", "read_vllm_result", "predict", "fit_profile", "FitResult", "FIGURES"]

#: The figures compared per run: (name, how it is read from a run's metrics / a vLLM file).
FIGURES = ("duration_s", "ttft_s_p50", "tpot_s_p50")


@dataclass
class VllmRun:
    """One ``vllm bench serve`` result file, successful requests only (see the module doc for the fields)."""

    path: str
    input_lens: list[int]
    output_lens: list[int]
    ttfts: list[float]
    itls: list[list[float]]
    arrival_s: list[float]
    duration_s: float
    max_concurrency: int | None
    request_rate: float
    failed: int = 0
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def measured(self) -> dict[str, float]:
        """`FIGURES` of the run as vLLM measured it (seconds)."""
        return _figures(self.duration_s, self.ttfts, self.itls)

    def workload(self, vocab_size: int, seed: int = 0) -> Any:
        """The replay workload (random ids below `vocab_size`, the run's lengths and arrival times)."""
        import random

        from ..lab.workloads import FIRST_ID, Workload

        rng = random.Random(f"vllm:{os.path.basename(self.path)}:{seed}")
        prompts = [[rng.randrange(FIRST_ID, vocab_size) for _ in range(n)] for n in self.input_lens]
        return Workload(os.path.splitext(os.path.basename(self.path))[0], "vllm-replay", prompts,
                        [max(1, n) for n in self.output_lens], arrival_s=list(self.arrival_s),
                        traffic={"arrivals": {"kind": "vllm-bench", "path": self.path,
                                              "request_rate": self.request_rate,
                                              "max_concurrency": self.max_concurrency}, "seed": seed})


def _figures(duration_s: float, ttfts: Sequence[float], itls: Sequence[Sequence[float]]) -> dict[str, float]:
    """`FIGURES` the same way for a vLLM file and a replay: medians as `statistics.median` (the mean of the two
    middle values, as numpy's median that vLLM reports), TPOT of a request = mean of its ITLs (vLLM's)."""
    tpots = [statistics.fmean(g) for g in itls if g]
    return {"duration_s": duration_s, "ttft_s_p50": statistics.median(ttfts) if ttfts else float("nan"),
            "tpot_s_p50": statistics.median(tpots) if tpots else float("nan")}


def _field(data: dict, key: str, path: str) -> Any:
    if key not in data:
        hint = " (per-request fields are only saved with --save-detailed)" if key in (
            "input_lens", "output_lens", "ttfts", "itls", "start_times", "errors") else ""
        raise ValueError(f"{path}: no {key!r} field{hint}")
    return data[key]


def read_vllm_result(path: str | os.PathLike) -> VllmRun:
    """Read one ``vllm bench serve --save-result --save-detailed`` JSON file.

    Raises:
        ValueError: not a JSON object, a field missing (the message names it), per-request lists of different
            lengths, or no successful request.
    """
    p = os.fspath(path)
    with open(p, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{p}: not valid JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{p}: must be a JSON object (one run of vllm bench serve)")
    cols = {k: list(_field(data, k, p)) for k in ("input_lens", "output_lens", "ttfts", "itls", "start_times")}
    n = len(cols["input_lens"])
    for k, v in cols.items():
        if len(v) != n:
            raise ValueError(f"{p}: {k!r} has {len(v)} entries for {n} requests")
    errors = list(data.get("errors") or [""] * n)
    queue = list(data.get("queue_times") or [0.0] * n)
    ok = [i for i in range(n) if not errors[i] and cols["ttfts"][i] and cols["output_lens"][i] > 0]
    if not ok:
        raise ValueError(f"{p}: no successful request")
    rate_raw = _field(data, "request_rate", p)
    rate = math.inf if rate_raw in ("inf", None) else float(rate_raw)
    conc = data.get("max_concurrency")
    if conc is not None and (not isinstance(conc, int) or conc < 1):
        raise ValueError(f"{p}: max_concurrency must be null or an integer >= 1; got {conc!r}")
    if math.isinf(rate):
        arrivals = [0.0] * len(ok)
    else:
        arr = [float(cols["start_times"][i]) - float(queue[i] or 0.0) for i in ok]
        a0 = min(arr)
        arrivals = [a - a0 for a in arr]
    return VllmRun(p, [int(cols["input_lens"][i]) for i in ok], [int(cols["output_lens"][i]) for i in ok],
                   [float(cols["ttfts"][i]) for i in ok], [[float(x) for x in cols["itls"][i]] for i in ok],
                   arrivals, float(_field(data, "duration", p)), conc, rate, failed=n - len(ok),
                   meta={k: data.get(k) for k in ("model_id", "backend", "date", "burstiness", "num_prompts")})


def _runs(files: Iterable[Any]) -> list[VllmRun]:
    out = [f if isinstance(f, VllmRun) else read_vllm_result(f) for f in files]
    if not out:
        raise ValueError("no vLLM result files")
    return out


def predict(run: VllmRun, shape: Any, profile: Any, config: Any = None, *, dtype: Any = None) -> dict[str, float]:
    """`FIGURES` of `run` replayed on `SimEngine(shape, profile, config)` (simulated seconds)."""
    from ..lab.tuning import run_workload
    from ..sim.engine import SimEngine

    sim = SimEngine(shape, profile, config, dtype=dtype)
    wl = run.workload(sim.vocab_size)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a failed replay shows as missing figures below
        r = run_workload(sim, wl, log=False, max_concurrency=run.max_concurrency)
    done = [x for x in r.records if x.finished and x.ttft_s is not None]
    if len(done) < len(r.records):
        return {k: None for k in FIGURES}  # a replay that fails requests predicts nothing
    return _figures(r.metrics["duration_s"], [x.ttft_s for x in done], [x.itl_s for x in done])


def _err_pct(pred: dict[str, float], meas: dict[str, float]) -> float:
    errs = [abs(pred[k] / meas[k] - 1.0) for k in FIGURES
            if pred.get(k) is not None and meas.get(k) and math.isfinite(meas[k]) and pred[k] > 0]
    return 100.0 * statistics.fmean(errs) if errs else float("inf")


def _loss(preds: list[dict[str, float]], meas: list[dict[str, float]]) -> float:
    tot = 0.0
    for p, m in zip(preds, meas):
        for k in FIGURES:
            if not (m.get(k) and math.isfinite(m[k])):
                continue
            if p.get(k) is None or not p[k] > 0:
                return float("inf")
            tot += math.log(p[k] / m[k]) ** 2
    return tot


_BOUNDS = {"flops_efficiency": (0.02, 1.0), "bandwidth_efficiency": (0.02, 1.0), "step_overhead_s": (1e-6, 1.0)}


def _apply(base: HardwareProfile, x: dict[str, float]) -> HardwareProfile:
    scale = x["step_overhead_s"] / base.step_overhead_s if base.step_overhead_s > 0 else 1.0
    return base.replace(flops_efficiency=x["flops_efficiency"], bandwidth_efficiency=x["bandwidth_efficiency"],
                        step_overhead_s=x["step_overhead_s"], step_overhead_graph_s=base.step_overhead_graph_s * scale)


@dataclass
class FitResult:
    """What `fit_profile` found.

    Attributes:
        profile: the fitted `HardwareProfile` (its ``provenance``: kind "fitted", runs, error_pct, loo_error_pct).
        factors: {"flops_efficiency", "bandwidth_efficiency", "step_overhead_s", "step_overhead_graph_s"}.
        base: the profile it started from (its name).
        per_run: [{"path", "measured", "predicted", "error_pct", "loo_error_pct"}] per file.
        error_pct: mean of the runs' errors with the fitted profile (on the runs it was fitted on).
        loo_error_pct: mean of the leave-one-out errors (None when not computed or fewer than 2 files).
        evaluations: simulator replays the search made (the fit's cost).
    """

    profile: HardwareProfile
    factors: dict[str, float]
    base: str
    per_run: list[dict[str, Any]]
    error_pct: float
    loo_error_pct: float | None
    evaluations: int

    def report(self) -> str:
        lines = [f"profile {self.profile.name} fitted from {len(self.per_run)} vLLM run(s) on {self.base}: "
                 + ", ".join(f"{k} {v:.4g}" for k, v in self.factors.items()),
                 f"error on the fitted runs: {self.error_pct:.1f} % (mean |rel. error| of duration, TTFT p50, "
                 f"TPOT p50)" + ("" if self.loo_error_pct is None else
                                 f"; leave-one-out: {self.loo_error_pct:.1f} %")]
        for r in self.per_run:
            loo = "" if r.get("loo_error_pct") is None else f", held out {r['loo_error_pct']:.1f} %"
            m, p = r["measured"], r["predicted"]
            lines.append(f"  {os.path.basename(r['path'])}: fitted {r['error_pct']:.1f} %{loo}  (" + ", ".join(
                f"{k} {m[k]:.4g} -> {p[k]:.4g}" for k in FIGURES if p.get(k) is not None) + ")")
        return "\n".join(lines)


def _search(runs: list[VllmRun], shape: Any, base: HardwareProfile, config: Any, dtype: Any,
            max_evals: int) -> tuple[dict[str, float], list[dict[str, float]], int]:
    """Nelder-Mead (Nelder and Mead, Computer Journal 7, 1965; standard coefficients 1, 2, 1/2, 1/2) over the
    logarithms of the three factors, clipped to `_BOUNDS`, from the base profile's values."""
    meas = [r.measured for r in runs]
    keys = list(_BOUNDS)
    x0 = [base.flops_efficiency, base.bandwidth_efficiency, base.step_overhead_s or 1e-4]
    lo = [math.log(_BOUNDS[k][0]) for k in keys]
    hi = [math.log(_BOUNDS[k][1]) for k in keys]
    cache: dict[tuple, tuple[float, list[dict[str, float]]]] = {}

    def as_x(v: list[float]) -> dict[str, float]:
        return {k: math.exp(min(h, max(l_, c))) for k, c, l_, h in zip(keys, v, lo, hi)}

    def f(v: list[float]) -> float:
        key = tuple(round(min(h, max(l_, c)), 9) for c, l_, h in zip(v, lo, hi))
        if key not in cache:
            prof = _apply(base, as_x(v))
            preds = [predict(r, shape, prof, config, dtype=dtype) for r in runs]
            cache[key] = (_loss(preds, meas), preds)
        return cache[key][0]

    start = [math.log(c) for c in x0]
    simplex = [start] + [[c + (-0.7 if c + 0.7 > hi[i] else 0.7) * (i == j) for i, c in enumerate(start)]
                         for j in range(len(keys))]
    vals = [f(v) for v in simplex]
    while len(cache) < max_evals:
        order = sorted(range(len(simplex)), key=lambda i: vals[i])
        simplex, vals = [simplex[i] for i in order], [vals[i] for i in order]
        if vals[-1] - vals[0] < 1e-10 and max(abs(a - b) for v in simplex for a, b in zip(v, simplex[0])) < 1e-3:
            break
        n = len(keys)
        cen = [sum(v[i] for v in simplex[:-1]) / n for i in range(n)]
        worst = simplex[-1]
        xr = [c + (c - w) for c, w in zip(cen, worst)]
        fr = f(xr)
        if fr < vals[0]:
            xe = [c + 2 * (c - w) for c, w in zip(cen, worst)]
            fe = f(xe)
            simplex[-1], vals[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < vals[-2]:
            simplex[-1], vals[-1] = xr, fr
        else:
            xc = [c + 0.5 * (w - c) for c, w in zip(cen, worst)]
            fc = f(xc)
            if fc < vals[-1]:
                simplex[-1], vals[-1] = xc, fc
            else:  # shrink towards the best point
                simplex = [simplex[0]] + [[b + 0.5 * (c - b) for b, c in zip(simplex[0], v)] for v in simplex[1:]]
                vals = [vals[0]] + [f(v) for v in simplex[1:]]
    i = min(range(len(simplex)), key=lambda k: vals[k])
    best = simplex[i]
    f(best)
    key = tuple(round(min(h, max(l_, c)), 9) for c, l_, h in zip(best, lo, hi))
    return as_x(best), cache[key][1], len(cache)


def fit_profile(files: Sequence[Any], shape: Any, profile: Any = "h100-sxm", config: Any = None, *,
                dtype: Any = None, leave_one_out: bool = True, max_evals: int = 60,
                name: str | None = None) -> FitResult:
    """Fit `profile`'s compute and bandwidth efficiencies and fixed step cost to vLLM benchmark files.

    Args:
        files: paths of ``vllm bench serve --save-result --save-detailed`` JSON files (or `VllmRun`s).
        shape: the served model's shape (`cbnb.sim.load_shape` name or object).
        profile: the profile to start from (its memory, peaks and other costs are kept).
        config: the `ContinuousBatchingConfig` to replay with (closest to the server's: max_batch_tokens as
            ``--max-num-batched-tokens``, max_batch_requests as ``--max-num-seqs``).
        leave_one_out: also fit once per file on the others and predict it (len(files) more fits).
        max_evals: replays per fit (each replays every file once).
        name: the fitted profile's name (default "<base>-fitted").

    Raises:
        ValueError: no file, or a file `read_vllm_result` refuses.
    """
    runs = _runs(files)
    base = load_profile(profile)
    x, preds, evals = _search(runs, shape, base, config, dtype, max_evals)
    per_run = [{"path": r.path, "measured": r.measured, "predicted": p, "error_pct": _err_pct(p, r.measured),
                "loo_error_pct": None} for r, p in zip(runs, preds)]
    loo = None
    if leave_one_out and len(runs) > 1:
        for i, r in enumerate(runs):
            xi, _, e = _search(runs[:i] + runs[i + 1:], shape, base, config, dtype, max_evals)
            evals += e
            per_run[i]["loo_error_pct"] = _err_pct(predict(r, shape, _apply(base, xi), config, dtype=dtype),
                                                   r.measured)
        loo = statistics.fmean(p["loo_error_pct"] for p in per_run)
    err = statistics.fmean(p["error_pct"] for p in per_run)
    fitted = _apply(base, x)
    factors = {"flops_efficiency": fitted.flops_efficiency, "bandwidth_efficiency": fitted.bandwidth_efficiency,
               "step_overhead_s": fitted.step_overhead_s, "step_overhead_graph_s": fitted.step_overhead_graph_s}
    src = f"fitted by cbnb.measure.fit_vllm to {len(runs)} vllm bench serve run(s)"
    fitted = fitted.replace(
        name=name or f"{base.name}-fitted",
        sources={**dict(base.sources), **{k: src for k in ("flops_efficiency", "bandwidth_efficiency",
                                                           "step_overhead_s", "step_overhead_graph_s")}},
        provenance={"kind": "fitted", "runs": len(runs), "error_pct": err, "loo_error_pct": loo,
                    "details": {"base": base.name, "files": [r.path for r in runs], "figures": list(FIGURES)}})
    return FitResult(fitted, factors, base.name, per_run, err, loo, evals)
