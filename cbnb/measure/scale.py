"""``python -m cbnb.measure.scale``: how long this machine takes to simulate production traffic (the issue's scale target).

Default: 10,000 requests arriving as a Poisson process (exponential gaps, ``--rate`` requests per simulated second)
on llama-3.1-8b / h100-sxm with transformers' default config resolved for the GPU: `production_poisson`, the
tuning lab's generators (`cbnb.lab.traffic`: Poisson arrivals; lognormal prompt and output lengths with means 550 and
200 tokens, sigma 0.8, clipped to [16, 4096] and [8, 1024]), random ids, EOS ignored.
It prints the host seconds of the whole simulation, the scheduler's share of them (`EngineCore.schedule`), and the
simulated figures (span, output tok/s, TTFT/TPOT p50/p99). Target: <= 60 s for 10,000 requests.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

__all__ = ["production_poisson", "poisson_requests", "simulate", "main"]


def production_poisson(n: int = 10_000, rate: float = 20.0, *, vocab: int = 128256, seed: int = 0,
                       model: str = "shape:llama-3.1-8b") -> Any:
    """A `cbnb.lab.workloads.Workload` of `n` random-id requests: Poisson arrivals at `rate` per second, lognormal
    prompt (mean 550, sigma 0.8, [16, 4096]) and output (mean 200, sigma 0.8, [8, 1024]) lengths; seeded."""
    from ..lab import traffic as tr
    from ..lab.workloads import synthetic

    return synthetic("production-poisson", n, tr.Poisson(rate), tr.LogNormal(550, 0.8, 16, 4096),
                     tr.LogNormal(200, 0.8, 8, 1024), model=model, vocab_size=vocab, seed=seed,
                     description=f"{n} requests, Poisson {rate:g}/s, lognormal lengths (means 550 in, 200 out)")


def poisson_requests(n: int, rate: float, *, vocab: int, seed: int = 0) -> list[tuple[float, list[int], int]]:
    """`production_poisson`'s requests as (arrival_s, prompt ids, max_new_tokens)."""
    wl = production_poisson(n, rate, vocab=vocab, seed=seed)
    return list(zip(wl.arrival_s, wl.prompts, wl.max_new_tokens))


def simulate(n: int = 10_000, rate: float = 20.0, *, shape: str = "llama-3.1-8b", profile: str = "h100-sxm",
             telemetry: bool = True, seed: int = 0, config: Any = None) -> dict[str, Any]:
    """Simulate the traffic; return host seconds (total, scheduler, submission) and the simulated figures."""
    from ..sim.engine import SimEngine

    sim = SimEngine(shape, profile, config, telemetry=telemetry)
    reqs = poisson_requests(n, rate, vocab=sim.vocab_size, seed=seed)
    t0 = time.perf_counter()
    for i, (t, ids, g) in enumerate(reqs):
        sim.submit(ids, g, request_id=f"p{i}", arrival_s=t)
    t1 = time.perf_counter()
    st = sim.run()["run"]
    t2 = time.perf_counter()
    s = sim.sim_stats()
    return {"requests": n, "rate_per_s": rate, "shape": shape, "profile": profile, "telemetry": telemetry,
            "num_blocks": sim.config.num_blocks, "host_s": t2 - t0, "submit_s": t1 - t0, "run_s": t2 - t1,
            "schedule_s": s["schedule_wall_s"], "schedule_share": s["schedule_wall_s"] / (t2 - t0),
            "steps": s["steps"], "sim_span_s": s["sim_time_s"], "finished": st["requests_finished"],
            "output_tokens_per_s": st["output_tokens_per_s"], "ttft_p50_s": st["ttft_s"]["p50"],
            "ttft_p99_s": st["ttft_s"]["p99"], "tpot_p50_s": st["tpot_s"]["p50"], "tpot_p99_s": st["tpot_s"]["p99"],
            "swaps": st["swaps"], "soft_resets": st["soft_resets"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cbnb.measure.scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--rate", type=float, default=20.0, help="requests per simulated second (default %(default)s)")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--profile", default="h100-sxm")
    ap.add_argument("--no-telemetry", action="store_true", help="record no events (stats only)")
    ap.add_argument("--profile-host", action="store_true", help="also print the top functions (cProfile)")
    args = ap.parse_args(argv)
    if args.requests < 1 or not args.rate > 0:
        ap.error("--requests must be >= 1 and --rate > 0")
    kw = dict(shape=args.shape, profile=args.profile, telemetry=not args.no_telemetry)
    load0 = os.getloadavg()[0]
    if args.profile_host:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        r = prof.runcall(simulate, args.requests, args.rate, **kw)
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    else:
        r = simulate(args.requests, args.rate, **kw)
    print(f"{r['requests']} requests at {r['rate_per_s']:g}/s on {r['shape']} / {r['profile']} "
          f"(num_blocks {r['num_blocks']}, telemetry {'on' if r['telemetry'] else 'off'}): "
          f"{r['host_s']:.1f} s on this machine (submit {r['submit_s']:.1f} s, run {r['run_s']:.1f} s), "
          f"scheduler {r['schedule_s']:.1f} s = {100 * r['schedule_share']:.0f} %")
    print(f"simulated: {r['steps']} steps over {r['sim_span_s']:.1f} s, {r['finished']} finished, "
          f"{r['output_tokens_per_s']:.0f} output tok/s, TTFT p50 {r['ttft_p50_s']:.3f} s p99 {r['ttft_p99_s']:.3f} s, "
          f"TPOT p50 {1000 * r['tpot_p50_s']:.1f} ms p99 {1000 * r['tpot_p99_s']:.1f} ms, "
          f"swaps {r['swaps']}, soft resets {r['soft_resets']}")
    print(f"load average {load0:.1f} before, {os.getloadavg()[0]:.1f} after ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
