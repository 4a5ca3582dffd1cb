"""``python -m cbnb.sim.validate``: the simulator's predictions against the real engine on this machine.

For each standard workload (cpu-32, long-gen, shared-prefix; smollm2-135m, float32), it runs the real `cbnb.Engine`
with every request submitted before the first step, records each step's measured time (from its StepPlanned record
to its StepTiming record, i.e. schedule through update) and the wall time (first step start to last step end), then
runs `SimEngine` with the same config and the ``cpu`` profile, and prints per workload: whether the step plans are
identical, the median and p90 absolute per-step error and the wall-time error. The profile comes from
`cbnb.sim.calibrate()` only (run fresh unless ``--profile`` names a saved one); nothing is fitted to these runs.

Targets (the design's): median absolute per-step error <= 15 %, wall-time error <= 10 %. The figures are only as
good as the machine is quiet: the table prints the load average before and after; on a busy 2-core machine,
``--threads 1`` avoids the stalls that 2 OpenMP threads suffer when another process holds a core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from ._together import submitted_together

__all__ = ["validate_workload", "main"]

WORKLOADS = ("cpu-32", "long-gen", "shared-prefix")
MODEL = "smollm2-135m"


def _plans(events: Any) -> list[tuple]:
    return [(e.step, e.taken, e.skipped, e.stalled) for e in events.events("step_planned")]


def _real_run(model: Any, tokenizer: Any, wl: Any, cfg: Any) -> tuple[dict[int, float], float, list[tuple], Any]:
    import cbnb

    eng = cbnb.Engine(model, tokenizer, cfg)
    try:
        with submitted_together(eng):  # every request reaches the core before the first step
            hs = [eng.submit(p, max_new_tokens=n, ignore_eos=True, request_id=f"w{i}")
                  for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new_tokens))]
        for h in hs:
            h.result(timeout=3600)
    finally:
        eng.stop()
    starts = {e.step: e.t for e in eng.events.events("step_planned")}
    timing = {e.step: e for e in eng.events.events("step_timing") if e.step in starts}
    steps = {s: e.t - starts[s] for s, e in timing.items()}
    wall = max(e.t for e in timing.values()) - min(starts[s] for s in steps)
    phases = {s: (e.prepare_s, e.forward_s, e.sample_s, e.schedule_s + e.update_s) for s, e in timing.items()}
    return steps, wall, _plans(eng.events), (eng.config, phases, eng.memory.free_bytes)


def _sim_run(shape: Any, profile: Any, wl: Any, cfg: Any) -> tuple[dict[int, float], float, list[tuple], Any]:
    from .engine import SimEngine

    sim = SimEngine(shape, profile, cfg)
    for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new_tokens)):
        sim.submit(p, n, request_id=f"w{i}")
    sim.run()
    steps = {s.step_id: s.cost.total_s for s in sim.steps}
    return steps, sim.now, _plans(sim.events), sim


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def validate_workload(name: str, profile: Any, *, model: Any = None, tokenizer: Any = None, scale: float = 1.0,
                      seed: int = 0) -> dict[str, Any]:
    """Run one workload on the real engine and on the simulator; return the comparison (errors as fractions)."""
    import cbnb
    from cbnb.workloads import get_workload

    from .shapes import load_shape

    if model is None:
        model, tokenizer = cbnb.load_model(MODEL)
    wl = get_workload(name, vocab_size=model.config.vocab_size, seed=seed, scale=scale)
    cfg = cbnb.ContinuousBatchingConfig(**wl.config_hints)
    t0 = time.perf_counter()
    measured, wall, real_plans, (real_cfg, phases, real_free) = _real_run(model, tokenizer, wl, cfg)
    real_s = time.perf_counter() - t0
    shape = load_shape(model.config, dtype=str(next(model.parameters()).dtype))
    # The real engine sized its cache from free RAM; the simulator takes that size (same decisions to compare), on
    # a profile with at least the memory the engine saw (RAM in use by others changes between calibration and now).
    room = real_free + shape.weight_bytes() + profile.reserved_bytes
    if profile.memory_bytes < room:
        profile = profile.replace(memory_bytes=room)
    predicted, pwall, sim_plans, sim = _sim_run(shape, profile, wl, cfg.copy(num_blocks=real_cfg.num_blocks))
    common = sorted(set(measured) & set(predicted))
    sim_parts = {s.step_id: dict(s.cost.parts, host=s.cost.host_s, launch=s.cost.launch_s) for s in sim.steps}
    errs = [abs(predicted[s] - measured[s]) / measured[s] for s in common if measured[s] > 0]
    prefill_steps = {p[0] for p in real_plans if any(t[1] == "prefill" for t in p[1])}
    e_pre = [abs(predicted[s] - measured[s]) / measured[s] for s in common if s in prefill_steps]
    e_dec = [abs(predicted[s] - measured[s]) / measured[s] for s in common if s not in prefill_steps]
    return {
        "workload": name, "steps": len(measured), "plans_identical": real_plans == sim_plans,
        "measured_wall_s": wall, "predicted_wall_s": pwall, "wall_error": abs(pwall - wall) / wall,
        "median_step_error": statistics.median(errs) if errs else float("nan"), "p90_step_error": _pct(errs, 0.9),
        "median_prefill_step_error": statistics.median(e_pre) if e_pre else float("nan"),
        "median_decode_step_error": statistics.median(e_dec) if e_dec else float("nan"),
        "signed_wall_error": (pwall - wall) / wall, "real_run_s": real_s, "sim_run_s": sim.wall_s,
        # (step, measured s, predicted s, measured prepare/forward/sample/host s, predicted parts)
        "per_step": [(s, measured[s], predicted[s], phases.get(s), sim_parts.get(s)) for s in common],
    }


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'workload':<14} {'steps':>5} {'plans':>6} {'wall meas':>9} {'wall pred':>9} {'wall err':>8} "
            f"{'step err p50':>12} {'p90':>6} {'prefill p50':>11} {'decode p50':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['workload']:<14} {r['steps']:>5} {'same' if r['plans_identical'] else 'DIFF':>6} "
                     f"{r['measured_wall_s']:>8.2f}s {r['predicted_wall_s']:>8.2f}s {100 * r['signed_wall_error']:>+7.1f}% "
                     f"{100 * r['median_step_error']:>11.1f}% {100 * r['p90_step_error']:>5.0f}% "
                     f"{100 * r['median_prefill_step_error']:>10.1f}% {100 * r['median_decode_step_error']:>9.1f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cbnb.sim.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--profile", default=None, help="a saved profile (name or JSON); default: calibrate now")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the workloads (default 1.0)")
    ap.add_argument("--json", default=None, help="also write the results (with per-step times) to this file")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for the engine and the calibration (default: torch's)")
    args = ap.parse_args(argv)
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        ap.error(f"--workloads: unknown {', '.join(bad)}; choose from {', '.join(WORKLOADS)}")
    import torch

    import cbnb

    from .calibrate import calibrate
    from .profiles import load_profile

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = cbnb.load_model(MODEL)
    if args.profile:
        profile = load_profile(args.profile)
    else:
        t = time.perf_counter()
        profile = calibrate(MODEL, save=False, verbose=True)
        print(f"calibrated in {time.perf_counter() - t:.0f} s ({profile.notes})")
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = [validate_workload(w, profile, model=model, tokenizer=tok, scale=args.scale) for w in names]
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(_table(rows))
    print(f"threads {torch.get_num_threads()}, load average {load0:.1f} before, {load1:.1f} after "
          f"({os.cpu_count()} CPUs)")
    print("targets: median |step error| <= 15 %, |wall error| <= 10 %")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": profile.to_dict(), "results": rows, "load_average": [load0, load1],
                       "threads": torch.get_num_threads()}, f, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
