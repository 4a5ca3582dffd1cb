"""How many GPUs of which kind, at which tensor-parallel size, for this traffic and SLO: the cheapest simulated fleet
that meets it, with the profile's error band.

`plan_fleet` simulates each candidate (`cbnb.sim.fleet.Fleet`: GPU kind x tensor_parallel_size x replicas behind a
router) on the same traffic, cheapest first (cost = GPUs x `gpu_hour_usd` of the kind, or the GPU count when no
prices are given), and stops once a cost level has a candidate that meets the SLO (`exhaustive=True` runs them all).
A candidate *meets* the SLO when at least `attainment_pct` % of the requests finish with TTFT and TPOT within it
(`cbnb.lab.metrics`). The answer carries the profile's error band (`HardwareProfile.trust()`: the leave-one-out
error of a fitted profile, or "datasheet: unverified"), and says whether the chosen fleet still meets the SLO with
every latency that much higher (`robust`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from ..core.config import ContinuousBatchingConfig
from ..export.vllm import to_vllm
from ..sim.fleet import Fleet
from ..sim.profiles import load_profile
from .driver import RequestRecord
from .metrics import SLO, summarize

__all__ = ["FleetCandidate", "FleetRun", "FleetAnswer", "plan_fleet", "error_band"]


@dataclass(frozen=True)
class FleetCandidate:
    """One fleet: `replicas` engines of `tensor_parallel_size` GPUs of kind `gpu` behind `router`."""

    gpu: str
    tensor_parallel_size: int
    replicas: int
    router: str = "least_loaded"

    @property
    def gpus(self) -> int:
        return self.tensor_parallel_size * self.replicas

    def __str__(self) -> str:
        return f"{self.replicas} x TP{self.tensor_parallel_size} on {self.gpu} ({self.gpus} GPUs, {self.router})"


@dataclass
class FleetRun:
    """One simulated candidate. `meets` is None when it does not fit (weights or cache larger than the GPUs' memory:
    `error` says so); `robust`: it still meets the SLO with every latency raised by the error band (None: no band)."""

    candidate: FleetCandidate
    cost: float
    metrics: dict[str, Any] = field(default_factory=dict)
    meets: bool | None = None
    robust: bool | None = None
    error: str | None = None
    wall_s: float = 0.0
    fleet: Any = None


    def commands(self, model: str | None = None, *, port: int = 8000) -> list[str]:
        """The fleet as `vllm serve` commands, one per replica on its own GPUs and port (`cbnb.export.to_vllm` with
        ``--tensor-parallel-size``; the cache pinned as simulated), then a comment naming the router's choice."""
        if self.fleet is None:
            raise ValueError(f"{self.candidate} was not simulated ({self.error}): nothing to export")
        f, c = self.fleet, self.candidate
        e = f.engines[0]
        ex = to_vllm(e.user_config, model or e.model_id, resolved=e.config,
                     tensor_parallel_size=c.tensor_parallel_size)
        cmds = []
        for r in range(c.replicas):
            gpus = ",".join(str(g) for g in range(r * c.tensor_parallel_size, (r + 1) * c.tensor_parallel_size))
            cmds.append(f"CUDA_VISIBLE_DEVICES={gpus} {ex.command} --port {port + r}")
        how = {"round_robin": "request i to replica i mod N",
               "least_loaded": "each request to the replica with the fewest requests in flight"}[c.router]
        ports = f"{port}" if c.replicas == 1 else f"{port}-{port + c.replicas - 1}"
        cmds.append(f"# router: {c.router} ({how}) over ports {ports}")
        return cmds


@dataclass
class FleetAnswer:
    """`plan_fleet`'s answer: `best` (None: no candidate met the SLO), every candidate run, the SLO, the attainment
    asked, the error band in words and the band in % (None: unverified), and the host seconds it took."""

    best: FleetRun | None
    runs: list[FleetRun]
    slo: SLO
    attainment_pct: float
    band: str
    band_pct: float | None
    wall_s: float

    def table(self) -> list[dict[str, Any]]:
        """One row per candidate run (for a DataFrame or a print)."""
        rows = []
        for r in self.runs:
            m = r.metrics
            rows.append({"fleet": str(r.candidate), "gpus": r.candidate.gpus, "cost": r.cost,
                         "meets_slo": r.meets, "robust": r.robust, "slo_attainment_pct": m.get("slo_attainment_pct"),
                         "ttft_s_p90": m.get("ttft_s_p90"), "tpot_s_p90": m.get("tpot_s_p90"),
                         "output_tokens_per_s": m.get("output_tokens_per_s"), "note": r.error or ""})
        return rows

    def __str__(self) -> str:
        if self.best is None:
            tried = ", ".join(str(r.candidate) for r in self.runs)
            return (f"No simulated fleet met {self.slo} for {self.attainment_pct:g} % of the requests (tried: {tried}); "
                    f"allow more GPUs or replicas, or relax the SLO. Error band: {self.band}.")
        b, m = self.best, self.best.metrics
        robust = ("" if b.robust is None else
                  " It still meets the SLO with every latency raised by the band." if b.robust else
                  " With every latency raised by the band it would miss the SLO: the next larger fleet is safer.")
        return (f"Cheapest fleet meeting {self.slo} for {self.attainment_pct:g} % of the requests: {b.candidate} "
                f"(simulated: {m['slo_attainment_pct']:.1f} % met, TTFT p90 {m['ttft_s_p90']:.3f} s, TPOT p90 "
                f"{1000 * m['tpot_s_p90']:.1f} ms, {m['output_tokens_per_s']:.0f} output tok/s). Error band: "
                f"{self.band}.{robust}")


def error_band(profile: Any) -> tuple[str, float | None]:
    """(the profile's error band in words, in % or None): a fitted or calibrated profile's leave-one-out (else
    in-sample) error, or "datasheet: unverified"."""
    p = load_profile(profile)
    t = p.trust()
    pct = t.get("loo_error_pct")
    how = "leave-one-out"
    if pct is None:
        pct, how = t.get("error_pct"), "in-sample"
    if pct is None:
        return f"{t['kind']}: unverified (no measured error for profile {p.name!r})", None
    runs = t.get("runs")
    on = f" on {runs} points" if runs else ""
    return f"±{float(pct):.0f} % ({how}{on}, profile {p.name!r}, {t['kind']})", float(pct)


def _records(outs: list[tuple[int, Any]], arrivals: list[float], max_new: list[int]) -> list[RequestRecord]:
    recs = []
    for i, ((_, out), a, m) in enumerate(zip(outs, arrivals, max_new)):
        tm = out.timings
        rec = RequestRecord(i, out.request_id, a, submitted_s=a, max_new_tokens=m,
                            prompt_tokens=len(out.prompt_token_ids or []) or None)
        rec.state = out.state.name
        rec.error = out.error
        rec.output_tokens = len(out.token_ids)
        rec.queued_s, rec.scheduled_s = tm.queued, tm.scheduled
        rec.first_token_s, rec.finished_s = tm.first_token, tm.finished
        times = list(out.token_times or [])
        rec.token_times_s = times if len(times) == rec.output_tokens else []
        recs.append(rec)
    return recs


class _Raised:
    """A record with its latencies raised by a factor (the robustness check against the error band)."""

    def __init__(self, rec: RequestRecord, k: float) -> None:
        self.rec, self.k = rec, k

    def __getattr__(self, name: str) -> Any:
        v = getattr(self.rec, name)
        return v * self.k if name in ("ttft_s", "tpot_s") and v is not None else v


def _attainment(recs: list[Any], slo: SLO) -> float:
    met = sum(1 for r in recs if r.finished and slo.met(r.ttft_s, r.tpot_s))
    return 100.0 * met / len(recs) if recs else 0.0


def _candidates(gpus: Iterable[str], tp: Iterable[int], replicas: Iterable[int], router: str,
                prices: Mapping[str, float] | None) -> list[tuple[float, FleetCandidate]]:
    out = []
    for g in gpus:
        if prices is not None and g not in prices:
            raise ValueError(f"gpu_hour_usd has no price for {g!r}; give one for every GPU kind ({', '.join(gpus)})")
        for t in tp:
            for n in replicas:
                c = FleetCandidate(g, int(t), int(n), router)
                out.append((c.gpus * (prices[g] if prices is not None else 1.0), c))
    return sorted(out, key=lambda x: (x[0], x[1].replicas, x[1].tensor_parallel_size, x[1].gpu))


def plan_fleet(shape: Any, workload: Any, slo: SLO, *, gpus: Iterable[str] = ("h100-sxm",),
               tensor_parallel: Iterable[int] = (1, 2, 4, 8), replicas: Iterable[int] = (1, 2, 3, 4),
               router: str = "least_loaded", config: Any = None, attainment_pct: float = 90.0,
               gpu_hour_usd: Mapping[str, float] | None = None, exhaustive: bool = False) -> FleetAnswer:
    """The cheapest simulated fleet that serves `workload` within `slo` (see the module docstring).

    Args:
        shape: the model (a name `cbnb.sim.load_shape` takes, e.g. "llama-3.1-70b").
        workload: a `cbnb.lab.workloads.Workload` (token-id prompts, max_new_tokens, arrival_s).
        slo: the latency objective; `attainment_pct`: the share of requests that must meet it.
        gpus, tensor_parallel, replicas: the candidates (every combination).
        router: "round_robin" or "least_loaded".
        config: the engine config of every replica (a `ContinuousBatchingConfig`; None: the defaults with vLLM's
            policy, ``scheduler_type="vllm", prefix_eviction="lru"``, since the answer is exported to vLLM).
        gpu_hour_usd: price per GPU-hour by kind (None: cost = GPU count).
        exhaustive: simulate every candidate, not only up to the first cost level that meets the SLO.

    Raises:
        ValueError: an empty workload, an attainment outside (0, 100], a missing price, a bad router or TP size.
    """
    if not getattr(workload, "prompts", None):
        raise ValueError("workload has no requests: nothing to size a fleet for")
    if isinstance(attainment_pct, bool) or not 0 < attainment_pct <= 100:
        raise ValueError(f"attainment_pct must be in (0, 100]; got {attainment_pct!r}")
    gpus = list(gpus)
    if config is None:
        config = ContinuousBatchingConfig(scheduler_type="vllm", prefix_eviction="lru")
    t_start = time.perf_counter()
    arrivals = list(workload.arrival_s) or [0.0] * len(workload.prompts)
    max_new = [int(m) for m in workload.max_new_tokens]
    band, band_pct = error_band(gpus[0]) if len(gpus) == 1 else _bands(gpus)
    runs: list[FleetRun] = []
    best: FleetRun | None = None
    for cost, cand in _candidates(gpus, tensor_parallel, replicas, router, gpu_hour_usd):
        if best is not None and cost > best.cost and not exhaustive:
            break
        t0 = time.perf_counter()
        run = FleetRun(cand, cost)
        try:
            fleet = Fleet(shape, cand.gpu, config, tensor_parallel_size=cand.tensor_parallel_size,
                          replicas=cand.replicas, router=cand.router)
        except MemoryError as e:
            run.error = f"does not fit: {e}"
        except ValueError as e:
            run.error = str(e)
        else:
            recs = _records(fleet.serve(workload.prompts, max_new, arrivals), arrivals, max_new)
            run.metrics = summarize(recs, slo=slo)
            run.meets = _attainment(recs, slo) >= attainment_pct
            pct = error_band(cand.gpu)[1]
            if pct is not None:
                run.robust = _attainment([_Raised(r, 1 + pct / 100) for r in recs], slo) >= attainment_pct
            run.fleet = fleet
        run.wall_s = time.perf_counter() - t0
        runs.append(run)
        if run.meets and (best is None or (cost, -run.metrics["slo_attainment_pct"]) <
                          (best.cost, -best.metrics["slo_attainment_pct"])):
            best = run
    return FleetAnswer(best, runs, slo, float(attainment_pct), band, band_pct, time.perf_counter() - t_start)


def _bands(gpus: list[str]) -> tuple[str, float | None]:
    parts = [error_band(g) for g in gpus]
    pcts = [p for _, p in parts]
    return "; ".join(t for t, _ in parts), (None if any(p is None for p in pcts) else max(pcts))


def main(argv: list[str] | None = None) -> None:
    """``python -m cbnb.lab.fleet``: the cheapest fleet for a Poisson chat traffic (prints the table and the answer)."""
    import argparse

    from . import traffic as tr
    from .workloads import synthetic

    ap = argparse.ArgumentParser(description="The cheapest simulated fleet (GPU kind x TP x replicas) meeting an SLO.")
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--gpu", action="append", help="GPU profile (repeatable; default h100-sxm)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals per second")
    ap.add_argument("--ttft", type=float, default=0.5, help="SLO: TTFT seconds")
    ap.add_argument("--tpot", type=float, default=0.05, help="SLO: TPOT seconds")
    ap.add_argument("--attainment", type=float, default=90.0, help="percent of requests that must meet the SLO")
    ap.add_argument("--exhaustive", action="store_true", help="simulate every candidate")
    a = ap.parse_args(argv)
    wl = synthetic("chat", a.requests, tr.Poisson(a.rate), tr.LogNormal(1000, 0.8, 32, 8000),
                   tr.LogNormal(200, 0.8, 16, 1000), vocab_size=32000, seed=0)
    ans = plan_fleet(a.model, wl, SLO(ttft_s=a.ttft, tpot_s=a.tpot), gpus=a.gpu or ("h100-sxm",),
                     attainment_pct=a.attainment, exhaustive=a.exhaustive)
    for row in ans.table():
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()))
    print(ans)
    if ans.best is not None:
        print("\n".join(ans.best.commands()))
    print(f"answered in {ans.wall_s:.1f} s (host)")


if __name__ == "__main__":
    main()
