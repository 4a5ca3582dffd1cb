"""Tuning: run a workload into the run log, sweep configs with interleaved repeats, and say what won (or that it
was a tie within noise).

::

    from cbnb.lab.tuning import run_workload, sweep, best
    run = run_workload(engine, get_workload("cpu-poisson"), slo=SLO(ttft_s=1.0, tpot_s=0.1))
    result = sweep(engine, wl, {"page_size": [16, 64]}, repeats=3)      # 6 runs: 16, 64, 16, 64, 16, 64
    result.summary()                                                      # median and min-max per figure
    print(best(result, "goodput_requests_per_s"))                         # winner, or "tie within noise"

Noise. On a shared machine one run can swing by a factor of 3, so a sweep repeats every point and interleaves the
points round-robin (a noisy minute hits every config alike), and `best` names a winner only when the best point's
min-max range over its repeats overlaps no other point's range; otherwise it says "tie within noise" and gives the
numbers. Every run starts on a fresh cache (the engine is reconfigured before each run), so a repeat never hits the
previous repeat's prefix cache. Torch-free.

Failures. A run in which requests failed warns (how many, the first error) and `best` never picks a point with such
runs (it names the points it skipped); a sweep point the engine cannot take (MemoryError / ValueError from
``reconfigure`` or the run) is kept in `SweepResult.failed` and the sweep goes on.

The engine protocol. Besides what `cbnb.lab.driver` needs (``submit`` and its handles and outputs), the helpers here
use, when the engine has them:

=========================  =============================================================================================
``start()``                called first by `run_workload` on a wall (threaded) clock, a no-op when running; never
                           on a virtual clock, where the caller's thread drives the engine through the clock
``reset_stats()``          called before each run, so ``stats()["run"]`` covers that run only
``stats()``                ``{"run": {...}}``: the keys of `cbnb.lab.metrics.engine_figures` found there (``steps``,
                           ``mean_kv_usage_blocks_frac``, ``mean_kv_usage_tokens_frac``, ``swaps``, ``soft_resets``,
                           ``recomputed_tokens``, ...) are copied into the run's metrics; others are ignored
``user_config``            the config recorded with each run (else ``config``; neither: an empty config); a
                           `ContinuousBatchingConfig` or a mapping of its fields. `sweep` needs it (or ``base=``)
                           to be a `ContinuousBatchingConfig` (``copy(**changes)``)
``reconfigure(config)``    required by `sweep` (called before every run, also with the same config: a fresh cache);
                           `measure_capacity` calls it between repeats when present
``records_reconfigures``   True: ``reconfigure`` writes its own "reconfigure" entry into ``engine.runs``
                           (`cbnb.Engine` does); otherwise `reconfigure` here writes it
``runs``                   the engine's `RunLog`; an object without one gets it set as an attribute on first use
                           (`cbnb.telemetry.runs.run_log`)
``engine_name``            how the run log names the engine (default "cbnb"; transformers' peer: "hf-cb"; the
                           simulator: "sim-<profile>", whose single runs `best` knows to be deterministic)
``driver_clock``           the clock the driver uses when none is passed (a simulator's virtual clock; see
                           `cbnb.lab.driver`); absent: the wall clock
``generate(...)``          the warm-up of `sweep`: ``generate([prompt], max_new_tokens=2, ignore_eos=True)`` on each
                           fresh cache (not recorded); skipped when absent
=========================  =============================================================================================

`best` and `cbnb.lab.metrics.summarize` read only runs and records, never the engine.
`tests/lab/test_tuning_protocol.py` drives every helper through an engine-like object that has nothing more than this protocol.
"""

from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from .driver import Driver, stop_guard
from ..engine.engine_like import marks_runs
from .metrics import DEFINITIONS, FIGURE_LABELS, SLO, engine_figures, higher_is_better, summarize
from ..telemetry.runs import Run, RunLog, change_text, provenance_text, run_log, spread, summary_frame

__all__ = ["run_workload", "measure_capacity", "sweep", "SweepResult", "best", "Verdict", "reconfigure",
           "workload_info"]


def engine_name(engine: Any) -> str:
    """"cbnb" for `cbnb.Engine`; an engine-like object names itself with an ``engine_name`` attribute."""
    return str(getattr(engine, "engine_name", "cbnb"))


def provenance(engine: Any) -> dict[str, Any]:
    """Where an engine's figures come from: a simulator's profile's `HardwareProfile.trust()` for the simulator's
    shape and dtype (kind "datasheet", "calibrated" or "fitted", its error, what it can be trusted for, and that the
    simulator predicts cbnb's scheduler, not vLLM's); {"kind": "measured"} for any other engine.

    Warns:
        UserWarning: a CPU profile calibrated at another model or dtype than the simulator's (its error does not
            apply: the provenance has none, and says to calibrate at this model)."""
    prof = getattr(engine, "profile", None)
    trust = getattr(prof, "trust", None)
    if callable(trust):
        shape = getattr(engine, "shape", None)
        out = dict(trust(shape, getattr(shape, "dtype", None)) if shape is not None else trust())
        out["profile"] = getattr(prof, "name", "")
        out["scheduler"] = SIM_SCHEDULER_NOTE
        if (out.get("details") or {}).get("other_model"):
            warnings.warn(f"profile {out['profile']!r}: {out['what']}", UserWarning, stacklevel=3)
        return out
    return {"kind": "measured"}


#: Said wherever a simulated prediction is read.
SIM_SCHEDULER_NOTE = ("the simulator replays cbnb's own scheduler (transformers' policy), not vLLM's or SGLang's: "
                      "its figures predict cbnb on that hardware")


def workload_info(workload: Any, time_scale: float = 1.0, label: str = "",
                  max_concurrency: int | None = None) -> dict[str, Any]:
    """What the run log stores about a workload (`label`: a sweep's name for it, e.g. "load 0.9";
    `max_concurrency`: the closed loop's bound, None for open loop)."""
    tr = dict(getattr(workload, "traffic", {}) or {})
    return {"name": workload.name, "label": label, "requests": workload.num_requests,
            "prompt_tokens": workload.prompt_tokens, "output_tokens": sum(workload.max_new_tokens),
            "arrivals": tr.get("arrivals", {"kind": "offline"}), "traffic": tr, "time_scale": time_scale,
            "max_concurrency": max_concurrency}


def reconfigure(engine: Any, config: Any, *, log: RunLog | None = None) -> Any:
    """`engine.reconfigure(config)`, with a "reconfigure" entry in `log` (default: the engine's run log).

    An engine with ``records_reconfigures = True`` (`cbnb.Engine`) writes that entry into ``engine.runs`` itself;
    this writes one only for other engine-like objects, or when `log` is another log than ``engine.runs``.
    """
    old = getattr(engine, "user_config", None)
    resolved = engine.reconfigure(config)
    own = getattr(engine, "runs", None) if getattr(engine, "records_reconfigures", False) else None
    target = log if log is not None else run_log(engine)
    if target is not own:
        target.record_reconfigure(old, config, engine=engine_name(engine))
    return resolved


def _reset_stats(engine: Any, label: str) -> None:
    """`engine.reset_stats()`, labelled as a workload run where the engine marks runs (cbnb's live plots start a
    segment there, `cbnb.telemetry.events.RunStarted`); engine-likes without run markers take no arguments."""
    if marks_runs(engine):  # declared by the engine (`cbnb.engine.engine_like`)
        engine.reset_stats(label, cause="workload")
    else:
        engine.reset_stats()


def run_workload(engine: Any, workload: Any, *, slo: SLO | None = None, clock: Any = None,
                 timeout: float | None = 3600.0, label: str = "", log: bool | RunLog = True,
                 reset_stats: bool = True, time_scale: float = 1.0, submit_kwargs: dict[str, Any] | None = None,
                 workload_label: str = "", max_concurrency: int | None = None, **extra: Any) -> Run:
    """Drive `workload` through `engine` at its arrival times and return the `Run` (also appended to the log).

    Args:
        slo: the goodput objective (default `SLO()`).
        clock: the driver's clock (default: the engine's ``driver_clock`` when it has one, else the wall clock).
        timeout: wall seconds for the whole run (unfinished requests are cancelled, then TimeoutError).
        label: a free-form label stored with the run.
        log: True: the engine's run log (`run_log(engine)`); a `RunLog`: that one; False: not recorded.
        reset_stats: start a new ``engine.stats()["run"]`` first (the run's KV / offload figures come from it).
        time_scale, submit_kwargs: passed to `Driver`.
        workload_label: stored with the workload (a sweep's name for it).
        max_concurrency: closed loop: at most this many requests in flight, the next one submitted when one ends
            (`cbnb.lab.driver`; vLLM's ``bench serve --max-concurrency``); None: open loop at the arrival times.
        extra: stored on the run (sweep, point, repeat, note).

    Warns:
        UserWarning: some requests FAILED (how many, and the first one's error): the run's figures cover the
            others only, and `best` will not pick a point with such runs.

    Raises:
        TimeoutError: the run did not end within `timeout`.
    """
    driver = Driver(engine, workload, clock=clock if clock is not None else getattr(engine, "driver_clock", None),
                    time_scale=time_scale, submit_kwargs=submit_kwargs, max_concurrency=max_concurrency)
    if driver.clock.threaded and hasattr(engine, "start"):
        engine.start()  # on a virtual clock the caller's thread drives the engine: no thread of its own
    if reset_stats and hasattr(engine, "reset_stats"):
        _reset_stats(engine, f"workload {workload_label or getattr(workload, 'name', '')}".strip())
    records = driver.run(timeout)
    metrics = summarize(records, slo=slo, duration_s=driver.duration_s)
    _warn_failed(records, workload)
    stats = engine.stats() if hasattr(engine, "stats") else None
    metrics.update(engine_figures(stats.get("run") if isinstance(stats, Mapping) else None))
    config = getattr(engine, "user_config", None) or getattr(engine, "config", None)
    target = log if isinstance(log, RunLog) else (run_log(engine) if log else RunLog(base=config))
    return target.add("run", engine=engine_name(engine), config=config, provenance=provenance(engine),
                      definitions=dict(DEFINITIONS),
                      workload=workload_info(workload, time_scale, workload_label, max_concurrency), metrics=metrics,
                      records=records,
                      label=label, **extra)


def _warn_failed(records: list[Any], workload: Any) -> None:
    failed = [r for r in records if getattr(r, "state", None) == "FAILED"]
    if failed:
        first = failed[0]
        warnings.warn(f"{len(failed)} of {len(records)} requests of workload {getattr(workload, 'name', '?')!r} "
                      f"FAILED; the run's figures cover the others only. First: request {first.index}: "
                      f"{first.error}", UserWarning, stacklevel=3)


def measure_capacity(engine: Any, workload: Any, *, repeats: int = 3, timeout: float | None = 3600.0,
                     clock: Any = None) -> dict:
    """The engine's service capacity on `workload`'s requests: all submitted at 0, finished requests per second
    (`clock`: as `run_workload`'s).

    Returns:
        {"capacity_requests_per_s": median, "max_requests_per_s": fastest run, "runs_requests_per_s": [per run],
        "output_tokens_per_s": median}. A Poisson rate of ``load * capacity`` loads the engine to about ``load``
        (utilisation = rate / capacity). On a machine shared with other jobs, contention only slows a run down, so
        the fastest run is the better estimate of the engine's own capacity.
    """
    from .traffic import Offline
    from .workloads import with_arrivals

    offline = with_arrivals(workload, Offline())
    rps, tps = [], []
    for _ in range(repeats):
        with stop_guard(engine, "measure_capacity"):  # an interrupt between its runs is said too
            cfg = getattr(engine, "user_config", None)
            if cfg is not None and hasattr(engine, "reconfigure"):
                reconfigure(engine, cfg)  # a fresh cache: no prefix hits from the previous repeat
            run = run_workload(engine, offline, log=False, timeout=timeout, clock=clock)
        rps.append(run.metrics["requests_per_s"])
        tps.append(run.metrics["output_tokens_per_s"])
    return {"capacity_requests_per_s": spread(rps)[0], "max_requests_per_s": max(rps), "runs_requests_per_s": rps,
            "output_tokens_per_s": spread(tps)[0]}


def _points(params: Mapping[str, Iterable[Any]] | Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(params, Mapping):
        keys = list(params)
        return [dict(zip(keys, v)) for v in itertools.product(*(list(params[k]) for k in keys))]
    return [dict(p) for p in params]


@dataclass
class SweepResult:
    """The runs of one sweep: `points` (config changes), `runs` (in the order they ran), and `failed`: the
    (point, repeat) pairs that could not run, e.g. a config whose cache does not fit (``{"point", "repeat",
    "workload", "change", "error"}``, in order; not in the run log)."""

    sweep_id: str
    points: list[dict[str, Any]]
    runs: list[Run] = field(default_factory=list)
    log: RunLog | None = None
    failed: list[dict[str, Any]] = field(default_factory=list)

    def frame(self):
        """One row per run (point, repeat, the changes, the figures)."""
        import pandas as pd

        return pd.DataFrame([{"point": r.point, "repeat": r.repeat, "change": r.change, **r.changes, **r.metrics}
                             for r in self.runs])

    workloads: list[str] = field(default_factory=list)

    def groups(self, workload: str | None = None) -> list[list[Run]]:
        """Runs by (workload, point), in that order; `workload` keeps one workload's (by its sweep label)."""
        by: dict[tuple[int, int], list[Run]] = {}
        names = self.workloads or [""]
        for r in self.runs:
            wl = r.workload.get("label", "")
            if workload is not None and wl != workload:
                continue
            by.setdefault((names.index(wl) if wl in names else 0, int(r.point or 0)), []).append(r)
        return [by[k] for k in sorted(by)]

    def summary(self, figures: Iterable[str] | None = None, workload: str | None = None):
        """One row per point (and workload): its changes, n, ``<figure>_median/_min/_max``, and for simulated runs a
        ``prediction`` column (`cbnb.telemetry.runs.provenance_text`: datasheet / fitted from N runs +- error /
        calibrated)."""
        groups = self.groups(workload)
        df = summary_frame(groups, figures, [self.points[int(g[0].point or 0)] for g in groups])
        if self.workloads:
            df.insert(1, "load", [g[0].workload.get("label", "") for g in groups])
        return df

    @property
    def provenance(self) -> dict[str, Any]:
        """Where the sweep's figures come from (its first run's `Run.provenance`; empty before any run)."""
        return dict(self.runs[0].provenance) if self.runs else {}

    def best(self, figure: str, higher: bool | None = None, workload: str | None = None) -> "Verdict":
        """`best` over this sweep's points (one workload's, when the sweep ran several)."""
        return best(self, figure, higher=higher, workload=workload)


def sweep(engine: Any, workload: Any, params: Mapping[str, Iterable[Any]] | Iterable[Mapping[str, Any]], *,
          repeats: int = 3, base: Any = None, derive: Callable[[dict], Mapping[str, Any]] | None = None,
          slo: SLO | None = None, warmup: bool = True, progress: bool = True, timeout: float | None = 3600.0,
          log: RunLog | None = None, clock: Any = None, max_concurrency: int | None = None) -> SweepResult:
    """Run `workload` at every config point, `repeats` times, interleaved round-robin (p1, p2, ..., p1, p2, ...).

    Args:
        engine: an engine with ``reconfigure`` (left on the last point's config).
        workload: a `Workload`, or {label: Workload} to run several (e.g. two loads) interleaved with the points:
            every repeat runs every (workload, point) pair once.
        params: a grid {field: values} (every combination) or a list of {field: value} dicts.
        repeats: runs per point (>= 1); 3 or more gives a min-max range to judge noise by.
        base: the config the changes apply to (default: the engine's current user config).
        derive: function(changes) -> more changes (e.g. keep the cache's bytes fixed: num_blocks from page_size).
        slo: the goodput objective for every run.
        warmup: one short request on each fresh cache before its run (not recorded).
        progress: print one line per run.
        timeout: wall seconds for each run (`run_workload`).
        log: the run log to record into (default: the engine's, `run_log(engine)`).
        clock: the driver's clock for every run (default: as `run_workload`).
        max_concurrency: closed loop for every run (`run_workload`); None: open loop.

    A point the engine cannot take (``reconfigure``, the warm-up or the run raises MemoryError or ValueError, e.g.
    its cache does not fit) is recorded in `SweepResult.failed` with its error, and the sweep goes on with the next
    point (the engine keeps its previous config); a warning at the end says which points failed, and `best` names
    them. Other errors of a run (e.g. TimeoutError) propagate, with the partial result attached to the exception
    as ``exc.sweep_result``.

    Raises:
        ValueError: repeats < 1 or no points (or a point's change is not a valid config, before any run).
    """
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1; got {repeats!r}")
    points = _points(params)
    if not points:
        raise ValueError("params gives no config point")
    base = base if base is not None else engine.user_config
    log = log if log is not None else run_log(engine)  # (an empty RunLog is falsy)
    sid = f"sweep-{len(log) + 1}"
    wls = dict(workload) if isinstance(workload, Mapping) else {"": workload}
    configs = []
    for changes in points:
        full = dict(changes)
        if derive is not None:
            full.update(derive(dict(changes)))
        configs.append((full, base.copy(**full)))
    # points: the full changes (derived ones too)
    result = SweepResult(sid, [c[0] for c in configs], log=log, workloads=[k for k in wls if k])
    order = [(r, w, p) for r in range(repeats) for w in wls for p in range(len(configs))]
    if progress:  # what "goodput" below counts (the default SLO is strict: on a CPU it is often 0)
        print(f"{sid}: {len(order)} runs; goodput = requests/s that met {slo or SLO()}"
              + ("" if max_concurrency is None else f"; closed loop, {max_concurrency} in flight"))
        prov = provenance(engine)
        if prov.get("kind") != "measured":
            print(f"{sid}: predictions from profile {prov.get('profile', '?')}: {provenance_text(prov)}; "
                  f"{prov['what']}; {SIM_SCHEDULER_NOTE}")
    for k, (rep, wname, p) in enumerate(order):
        wl = wls[wname]
        full, cfg = configs[p]
        try:
            with stop_guard(engine, "sweep"):  # an interrupt between its runs (reconfigure, warm-up) is said too
                reconfigure(engine, cfg, log=log)
                if warmup:
                    warm_up(engine, wl)
                run = run_workload(engine, wl, slo=slo, timeout=timeout, log=log, label=change_text(full),
                                   workload_label=wname, sweep=sid, point=p, repeat=rep, clock=clock,
                                   max_concurrency=max_concurrency)
        except (MemoryError, ValueError) as e:
            result.failed.append({"point": p, "repeat": rep, "workload": wname, "change": change_text(full),
                                  "error": f"{type(e).__name__}: {e}"})
            if progress:
                print(f"[{k + 1}/{len(order)}] {change_text(full)} (repeat {rep + 1}/{repeats}): FAILED "
                      f"{type(e).__name__}: {e}")
            continue
        except BaseException as e:
            e.sweep_result = result  # type: ignore[attr-defined]  # the runs so far stay reachable
            raise
        result.runs.append(run)
        if progress:
            m = run.metrics
            where = f"{wname}: " if wname else ""
            print(f"[{k + 1}/{len(order)}] {where}{change_text(full)} (repeat {rep + 1}/{repeats}): "
                  f"goodput {m['goodput_requests_per_s']:.2f} req/s, TTFT p99 {_f(m['ttft_s_p99'])} s, "
                  f"TPOT p99 {_f(m['tpot_s_p99'], 3)} s, {m['output_tokens_per_s']:.1f} out tok/s, "
                  f"soft resets {m.get('soft_resets', 0)}")
    if result.failed:
        names = sorted({f["change"] for f in result.failed})
        warnings.warn(f"{sid}: {len(result.failed)} of {len(order)} runs could not run ({'; '.join(names)}); first "
                      f"error: {result.failed[0]['error']} (SweepResult.failed has them all)", UserWarning,
                      stacklevel=2)
    return result


def warm_up(engine: Any, workload: Any) -> bool:
    """One short request (the workload's first prompt, at most 8 of its tokens, 2 new tokens) on the engine's fresh
    cache, not recorded: a run's first forwards otherwise pay one-off costs (allocator, page faults, kernels' first
    calls) that land on whichever point runs first. Returns whether it ran (engines without ``generate`` and empty
    workloads are left alone)."""
    if not workload.num_requests or not hasattr(engine, "generate"):
        return False
    prompt = workload.prompts[0]
    engine.generate([prompt[:8] if not isinstance(prompt, str) else prompt], max_new_tokens=2, ignore_eos=True)
    return True


def _eps(a: float, b: float) -> float:
    return 1e-9 * max(abs(a), abs(b))


def _simulated(run: Run) -> bool:
    """A run of `cbnb.sim.SimEngine` (its ``engine_name`` is "sim-<profile>")."""
    return str(run.engine).startswith("sim-")


def _f(x: Any, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x:.{digits}f}"


@dataclass
class Verdict:
    """What `best` concluded.

    Attributes:
        figure: the figure compared; higher: whether higher is better.
        winner: the winning point's config change (None when it is a tie within noise).
        tie: True when the best point's range overlaps another point's range.
        ranking: [(change text, median, min, max, n)] best first.
        tied_with: change texts of the points whose ranges overlap the best one's (all of them; the text lists
            the first `TIE_LIST_MAX`).
        skipped: (change text, why) of the points left out: runs with failed requests, or points a sweep could not
            run (`SweepResult.failed`).
        model_error_pct: for simulated runs, the error their profile admits (`cbnb.lab.tuning.provenance`: a fitted
            profile's leave-one-out error, a calibrated CPU's validation error); points closer than that to the best
            are a tie. None: real runs, or a datasheet profile (no known error).
        text: the sentence to print.
    """

    figure: str
    higher: bool
    winner: dict[str, Any] | None
    tie: bool
    ranking: list[tuple[str, float | None, float | None, float | None, int]]
    tied_with: list[str]
    text: str
    skipped: list[tuple[str, str]] = field(default_factory=list)
    model_error_pct: float | None = None

    def __str__(self) -> str:
        return self.text


def _rng(m: float | None, lo: float | None, hi: float | None, digits: int) -> str:
    if m is None:
        return "n/a"
    return f"{m:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]"


#: How many tied points `best`'s text lists before "and N more" (`Verdict.tied_with` has them all).
TIE_LIST_MAX = 5


def _listed(items: list[str], limit: int = TIE_LIST_MAX) -> str:
    if len(items) <= limit:
        return "; ".join(items)
    return "; ".join(items[:limit]) + f"; and {len(items) - limit} more"


def _failed_requests(g: list[Run]) -> tuple[int, str]:
    """Failed requests over a group's runs, and the first error."""
    n, first = 0, ""
    for r in g:
        k = int(r.metrics.get("requests_failed") or 0)
        n += k
        if k and not first:
            first = next((getattr(x, "error", None) or (x.get("error") if isinstance(x, Mapping) else None)
                          for x in r.records if (getattr(x, "state", None) or
                                                 (x.get("state") if isinstance(x, Mapping) else None)) == "FAILED"),
                         None) or "no error recorded"
    return n, first


def best(result: SweepResult | RunLog | Iterable[Iterable[Run]], figure: str, *, higher: bool | None = None,
         digits: int = 3, workload: str | None = None) -> Verdict:
    """Name the point with the best median `figure`, but only when its min-max range overlaps no other point's.

    Args:
        result: a `SweepResult`, a `RunLog` (its groups of repeats), or groups of runs.
        figure: a metric name, e.g. "goodput_requests_per_s", "ttft_s_p99".
        higher: whether higher is better (default: from the name, `cbnb.lab.metrics.higher_is_better`).
        workload: for a sweep over several workloads, the one to judge (its label, e.g. "load 0.9").

    Simulated runs whose profile has a known error (`Verdict.model_error_pct`: a fitted profile's leave-one-out
    error, a calibrated CPU profile's validation error) tie when their medians differ by less than that error,
    even though a simulation has no noise; a datasheet profile has no known error and says so.

    A point any of whose runs had failed requests is not a candidate (its figures cover the other requests only):
    it is left out of the ranking, and the text says which points were skipped and why; so are the points a sweep
    could not run (`SweepResult.failed`). A tie lists at most `TIE_LIST_MAX` tied points in the text ("and N more").

    Points whose runs had no request (an empty workload) are skipped; when every run is empty it is an error. When
    `figure` counts requests meeting the SLO (`SLO_FIGURES`) and is 0 for every point, the verdict says that no run
    met the SLO, and which SLO, instead of calling it a tie (and warns).

    Raises:
        ValueError: an unknown figure (the message lists the runs' figures), every run empty, fewer than two
            points, no point without failures has the figure, or a multi-workload sweep without `workload`.
    """
    if isinstance(result, SweepResult):
        if workload is None and len(result.workloads) > 1:
            raise ValueError(f"this sweep ran {len(result.workloads)} workloads: name one with workload= "
                             f"({', '.join(result.workloads)})")
        groups = result.groups(workload)
    elif hasattr(result, "groups"):
        groups = result.groups()
    else:
        groups = [list(g) for g in result]
    points = getattr(result, "points", None)
    _check_figure(groups, figure)
    up = higher_is_better(figure) if higher is None else bool(higher)
    rows = []
    for g in groups:
        s = spread(r.metrics.get(figure) for r in g)
        # A sweep's point is named by its own changes (also those equal to the log's base); other runs by their
        # change against the log's base.
        changes = dict(points[g[0].point]) if points is not None and g[0].point is not None else dict(g[0].changes)
        name = change_text(changes)
        rows.append((name if g[0].engine == "cbnb" else f"{g[0].engine}: {name}", *s, len(g), changes))
    skipped: list[tuple[str, str]] = []
    clean = []
    for g, row in zip(groups, rows):
        n, first = _failed_requests(g)
        if all(_empty(r) for r in g):
            skipped.append((row[0], "no requests: its workload is empty"))
        elif n:
            skipped.append((row[0], f"{n} failed request{'s' if n > 1 else ''} over {len(g)} run"
                                    f"{'s' if len(g) > 1 else ''}; first: {first}"))
        else:
            clean.append(row)
    n_points = len(rows)
    if isinstance(result, SweepResult):
        named = {row[0] for row in rows}
        for f in result.failed:
            if (workload is None or f["workload"] == workload) and f["change"] not in named:
                named.add(f["change"])
                skipped.append((f["change"], f"could not run: {f['error']}"))
                n_points += 1
    skip_txt = (f" Skipped {len(skipped)} point{'s' if len(skipped) > 1 else ''}: "
                + _listed([f"{name} ({why})" for name, why in skipped]) + "." if skipped else "")
    have = [r for r in clean if r[1] is not None]
    if groups and all(_empty(r) for g in groups for r in g):
        raise ValueError("every run has 0 requests: the workload is empty, so every figure is 0 and nothing can win; "
                         "give it requests (e.g. get_workload('cpu-32'), or synthetic(name, n >= 1, ...))")
    if n_points < 2:
        raise ValueError(f"best needs at least two points to compare; got {n_points}.{skip_txt}")
    if not have:
        raise ValueError(f"no run without failed requests has the figure {figure!r}.{skip_txt}")
    if len(have) == 1:
        top = have[0]
        text = (f"{top[0]} is the only point left to judge on {FIGURE_LABELS.get(figure, figure)}: "
                f"{_rng(top[1], top[2], top[3], digits)}; not a comparison.{skip_txt}")
        return Verdict(figure, up, top[5], False, [top[:5]], [], text, skipped)
    have.sort(key=lambda r: r[1], reverse=up)
    ranking = [r[:5] for r in have]
    top = have[0]
    label = FIGURE_LABELS.get(figure, figure)
    if figure in SLO_FIGURES and all(r[3] == 0 for r in have):
        slo = _slo_text(groups)
        text = (f"No run met the SLO ({slo}): {label} is 0 for every point ({len(have)} points), so this is no "
                "comparison. Loosen the SLO (SLO(ttft_s=..., tpot_s=...) in run_workload / sweep), lower the load, "
                "or compare a latency figure instead (e.g. best(result, 'ttft_s_p99')).")
        warnings.warn(text, UserWarning, stacklevel=2)
        return Verdict(figure, up, None, True, ranking, [r[0] for r in have[1:]], text + skip_txt, skipped)
    # ranges overlap; values equal to float rounding count as equal (a simulation's repeats differ by ~1e-15)
    tied = [r for r in have[1:] if r[2] <= top[3] + _eps(r[2], top[3]) and top[2] <= r[3] + _eps(top[2], r[3])]
    ns = sorted({r[4] for r in have})
    runs_txt = f"{ns[0]} run{'s' if ns[0] > 1 else ''} each" if len(ns) == 1 else f"{ns[0]}-{ns[-1]} runs each"
    one_run = ns[-1] < 2
    simulated = one_run and all(_simulated(r) for g in groups for r in g)  # deterministic: no noise to measure
    err, err_src = _model_error(groups)
    by_error: list = []
    if err is not None and not tied:  # a simulation's figures are only as good as its profile
        by_error = [r for r in have[1:] if abs(r[1] - top[1]) <= err / 100.0 * max(abs(r[1]), abs(top[1]))]
    if by_error:
        others = _listed([f"{r[0]} {_rng(r[1], r[2], r[3], digits)}" for r in by_error])
        text = (f"Tie within the model's error on {label}: best {top[0]} {_rng(top[1], top[2], top[3], digits)} "
                f"differs from {others} by less than the profile's error of {err:.1f} % ({err_src}).")
        return Verdict(figure, up, None, True, ranking, [r[0] for r in by_error], text + skip_txt, skipped,
                       model_error_pct=err)
    if tied:
        others = _listed([f"{r[0]} {_rng(r[1], r[2], r[3], digits)}" for r in tied])
        if simulated:  # the figures are equal
            text = (f"Exact tie on {label} (a deterministic simulation, one run per point): {top[0]} "
                    f"{_rng(top[1], top[2], top[3], digits)} equals {others}.{_sim_band(groups)}")
        else:
            text = (f"Tie within noise on {label}: best median {top[0]} {_rng(top[1], top[2], top[3], digits)} "
                    f"overlaps {others} (median [min-max] over {runs_txt}).")
        return Verdict(figure, up, None, True, ranking, [r[0] for r in tied], text + skip_txt, skipped,
                       model_error_pct=err)
    second = have[1] if len(have) > 1 else None
    note = ""
    if one_run:
        note = (" One run per point of a simulation (deterministic: a repeat gives the same figures); its error "
                "against a real engine is not in these numbers." if simulated
                else " One run per point: the noise was not measured, so treat this as provisional.")
    if err is not None:
        note += f" The winner leads by more than the profile's error of {err:.1f} % ({err_src})."
    elif any(_simulated(r) for g in groups for r in g):
        kinds = {r.provenance.get("kind") for g in groups for r in g if _simulated(r)}
        if "datasheet" in kinds:
            note += (" A datasheet profile (never checked on the device): trust the ranking of configs, not the "
                     "absolute figures.")
        note += _sim_band(groups)
    vs = f" vs runner-up {second[0]} {_rng(second[1], second[2], second[3], digits)}" if second else ""
    text = (f"{top[0]} wins on {label}: {_rng(top[1], top[2], top[3], digits)}{vs} (median [min-max] over "
            f"{runs_txt}; no range overlaps the winner's).{note}{skip_txt}")
    return Verdict(figure, up, top[5], False, ranking, [], text, skipped, model_error_pct=err)


#: Figures that count requests meeting the SLO: all 0 means no run met it (`best` says so instead of a tie).
SLO_FIGURES = ("goodput_requests_per_s", "goodput_steady_requests_per_s", "slo_met", "slo_attainment_pct")


def _sim_band(groups: list[list[Run]]) -> str:
    """" Simulated on h100-sxm: <its error band>." for simulated runs ("" for measured ones)."""
    labels = sorted({f"{r.provenance.get('profile', '')}: {provenance_text(r.provenance)}" for g in groups for r in g
                     if _simulated(r) and getattr(r, "provenance", None)})
    return f" Simulated on {'; '.join(labels)}." if labels else ""


def _empty(run: Run) -> bool:
    """A run of an empty workload (its metrics count 0 requests; a run without the count is not judged empty)."""
    return (run.metrics or {}).get("requests", None) == 0


def _slo_text(groups: list[list[Run]]) -> str:
    """The SLO the runs were judged against, as text (from their metrics)."""
    slos = {(r.metrics.get("slo_ttft_s"), r.metrics.get("slo_tpot_s")) for g in groups for r in g}
    return "; ".join(str(SLO(ttft_s=a, tpot_s=b)) for a, b in sorted(slos, key=str))


def _check_figure(groups: list[list[Run]], figure: str) -> None:
    """A figure no run has is a misspelling, not a failed run: the error lists the names there are."""
    names = {k for g in groups for r in g for k in (r.metrics or {})}
    if names and figure not in names:
        import difflib

        close = difflib.get_close_matches(figure, sorted(names), n=3)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(f"unknown figure {figure!r}: the runs have no such metric.{hint} Valid names: "
                         f"{', '.join(sorted(names))}")


def _model_error(groups: list[list[Run]]) -> tuple[float | None, str]:
    """The largest error (percent) the simulated runs' profiles admit (leave-one-out when known), and where it comes
    from; (None, "") when a run is not simulated or a profile has no known error (a datasheet profile)."""
    errs, srcs = [], set()
    for g in groups:
        for r in g:
            prov = getattr(r, "provenance", None) or {}
            if not _simulated(r):
                return None, ""
            e = prov.get("loo_error_pct") if prov.get("loo_error_pct") is not None else prov.get("error_pct")
            if not isinstance(e, (int, float)) or not math.isfinite(e):
                return None, ""
            errs.append(float(e))
            srcs.add(provenance_text(prov))
    if not errs:
        return None, ""
    return max(errs), "; ".join(sorted(srcs))
