"""``python -m cbnb.measure.validate``: the simulator's predictions against the real engine on this machine.

Offline workloads (cpu-32, long-gen, shared-prefix; smollm2-135m, float32): the real `cbnb.Engine` runs with every
request submitted before the first step; each step's measured time is from its StepPlanned record to its
StepTiming record (schedule through update), the wall time from the first step's start to the last step's end.
`SimEngine` runs the same requests with the same config on the ``cpu`` profile; the table says whether the two
sequences of step plans are identical, and gives the median and p90 absolute per-step error (step N against step
N) and the wall-time error.

The timed workload (cpu-poisson, arrival times): both engines are driven by the tuning lab's driver
(`cbnb.lab.tuning.run_workload`: the real one on the wall clock, the simulator on its virtual clock). Which requests
share a step then depends on how long the steps took, so the plans are not compared ("timed" in the table); the
per-step error is the cost model's prediction for each of the real engine's own steps (its plan from the
StepPlanned record: query tokens, KV start, whether it samples, prefix tokens another row read first) against that
step's measured time, and the wall time is the run's duration (first arrival to last request end) on each engine.

The profile comes from `cbnb.measure.calibrate()` only (run fresh unless ``--profile`` names a saved one; its cost
factors are fitted to its own synthetic engine runs, `cbnb.measure._torch_fit._FIT_RUNS`, none of them a
validation workload); nothing is fitted to these runs.

Noise. ``--repeat N`` runs each workload N times on the real engine: an offline workload compares the per-step and
wall medians (its plans are the same each time), a timed one its run of median wall time, and the ``spread`` column
is (slowest - fastest) / median wall of those runs, the measurement's own noise. The ``speed`` column times the
model's 8-token forward before and after each workload against the same probe right after the calibration (`+`:
the machine was faster than when it was calibrated).

``--predict PROFILE`` prints the simulator's prediction for nanovllm-256 (shape qwen3-0.6b, bf16, all requests at
0) on a datasheet profile, e.g. ``h200``, with no torch and no run to compare against (GPU fidelity unverified until
a GPU runs `cbnb.bench` on the same workload).

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

WORKLOADS = ("cpu-32", "long-gen", "shared-prefix", "cpu-poisson")
TIMED = ("cpu-poisson",)
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
    from ..sim.engine import SimEngine

    sim = SimEngine(shape, profile, cfg)
    for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new_tokens)):
        sim.submit(p, n, request_id=f"w{i}")
    sim.run()
    steps = {s.step_id: s.cost.total_s for s in sim.steps}
    return steps, sim.now, _plans(sim.events), sim


def _steps_of(events: Any) -> tuple[dict[int, float], dict[int, Any], dict[int, Any]]:
    """Measured seconds per step (StepPlanned -> StepTiming), the StepTiming and StepPlanned records by step."""
    planned = {e.step: e for e in events.events("step_planned")}
    timing = {e.step: e for e in events.events("step_timing") if e.step in planned}
    return {s: e.t - planned[s].t for s, e in timing.items()}, timing, planned


def _real_timed(model: Any, tokenizer: Any, wl: Any, cfg: Any) -> tuple[dict[int, float], float, Any, Any]:
    import cbnb
    from cbnb.lab.tuning import run_workload

    eng = cbnb.Engine(model, tokenizer, cfg)
    try:
        run = run_workload(eng, wl, log=False, timeout=3600)
    finally:
        eng.stop()
    steps, timing, planned = _steps_of(eng.events)
    phases = {s: (e.prepare_s, e.forward_s, e.sample_s, e.schedule_s + e.update_s) for s, e in timing.items()}
    return steps, run.metrics["duration_s"], (eng.config, phases, eng.memory.free_bytes, planned), run


def _replay_costs(planned: dict[int, Any], steps: dict[int, float], prompt_len: dict[str, int], cost: Any) -> dict:
    """The cost model's seconds for each measured step of the real engine, from its own plan."""
    from ..sim.cost import StepLoad

    out = {}
    for s in steps:
        rows = []
        e = planned[s]
        for (rid, phase, n, start, _hit), shared in zip(e.taken, e.shared_tokens or [0] * len(e.taken)):
            # a prefill chunk samples when it reaches the end of the prompt (a resumed request's longer sequence
            # is approximated by its prompt: at most one sampled row off)
            rows.append((start, n, phase == "decode" or start + n >= prompt_len.get(rid, 0), shared))
        out[s] = cost.step(StepLoad.of(rows)).total_s
    return out


def _timed_workload(name: str, profile: Any, model: Any, tokenizer: Any, wl: Any, cfg: Any) -> dict[str, Any]:
    from cbnb.lab.tuning import run_workload

    from ..sim.cost import CostModel
    from ..sim.engine import SimEngine
    from ..sim.shapes import load_shape

    t0 = time.perf_counter()
    measured, wall, (real_cfg, phases, real_free, planned), run = _real_timed(model, tokenizer, wl, cfg)
    real_s = time.perf_counter() - t0
    shape = load_shape(model.config, dtype=str(next(model.parameters()).dtype))
    room = real_free + shape.weight_bytes() + profile.reserved_bytes
    if profile.memory_bytes < room:
        profile = profile.replace(memory_bytes=room)
    sim = SimEngine(shape, profile, cfg.copy(num_blocks=real_cfg.num_blocks))
    srun = run_workload(sim, wl, log=False)
    prompt_len = {r.request_id: r.prompt_tokens for r in run.records if r.request_id}
    predicted = _replay_costs(planned, measured, prompt_len, CostModel(shape, profile, sim.config))
    common = sorted(measured)
    pre = {s for s in common if any(t[1] == "prefill" for t in planned[s].taken)}
    return _row(name, measured, predicted, common, pre, None, wall, srun.metrics["duration_s"], real_s, sim.wall_s,
                [(s, measured[s], predicted[s], phases.get(s), None) for s in common])


def _row(name: str, measured: dict, predicted: dict, common: list[int], prefill: set[int], same: bool | None,
         wall: float, pwall: float, real_s: float, sim_s: float, per_step: list) -> dict[str, Any]:
    def err(keep: Any) -> list[float]:
        return [abs(predicted[s] - measured[s]) / measured[s] for s in common if measured[s] > 0 and keep(s)]

    errs, e_pre, e_dec = err(lambda s: True), err(lambda s: s in prefill), err(lambda s: s not in prefill)
    med = statistics.median(errs) if errs else float("nan")
    return {
        "workload": name, "steps": len(measured), "plans_identical": same,
        "measured_wall_s": wall, "predicted_wall_s": pwall, "wall_error": abs(pwall - wall) / wall,
        "median_step_error": med, "p90_step_error": _pct(errs, 0.9),
        "median_prefill_step_error": statistics.median(e_pre) if e_pre else float("nan"),
        "median_decode_step_error": statistics.median(e_dec) if e_dec else float("nan"),
        "signed_wall_error": (pwall - wall) / wall, "real_run_s": real_s, "sim_run_s": sim_s,
        "within_targets": med <= STEP_TARGET and abs(pwall - wall) / wall <= WALL_TARGET,
        # (step, measured s, predicted s, measured prepare/forward/sample/host s, predicted parts)
        "per_step": per_step,
    }


STEP_TARGET, WALL_TARGET = 0.15, 0.10


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def validate_workload(name: str, profile: Any, *, model: Any = None, tokenizer: Any = None, scale: float = 1.0,
                      seed: int = 0, repeat: int = 1) -> dict[str, Any]:
    """Run one workload on the real engine (`repeat` times) and on the simulator; return the comparison (errors as
    fractions). With repeats, an offline workload's measured step and wall times are the medians over its runs (the
    plans are the same every time); a timed one reports its run of median wall time. ``measured_walls_s`` lists every
    run's wall time (their spread is the measurement's own noise).

    Raises:
        ValueError: `repeat` < 1.
    """
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be an integer >= 1; got {repeat!r}")
    import cbnb
    from cbnb.lab.workloads import get_workload

    from ..sim.shapes import load_shape

    if model is None:
        model, tokenizer = cbnb.load_model(MODEL)
    wl = get_workload(name, vocab_size=model.config.vocab_size, seed=seed, scale=scale)
    cfg = cbnb.ContinuousBatchingConfig(**wl.config_hints)
    if name in TIMED:
        rows = sorted((_timed_workload(name, profile, model, tokenizer, wl, cfg) for _ in range(repeat)),
                      key=lambda r: r["measured_wall_s"])
        row = rows[(len(rows) - 1) // 2]
        row["measured_walls_s"] = [r["measured_wall_s"] for r in rows]
        return row
    t0 = time.perf_counter()
    runs = [_real_run(model, tokenizer, wl, cfg) for _ in range(repeat)]
    real_s = (time.perf_counter() - t0) / repeat
    measured, wall, real_plans, (real_cfg, phases, real_free) = runs[0]
    walls = [r[1] for r in runs]
    if repeat > 1 and all(r[2] == real_plans for r in runs[1:]):
        measured = {s: statistics.median(r[0][s] for r in runs) for s in measured if all(s in r[0] for r in runs)}
        wall = statistics.median(walls)
    shape = load_shape(model.config, dtype=str(next(model.parameters()).dtype))
    # The real engine sized its cache from free RAM; the simulator takes that size (same decisions to compare), on
    # a profile with at least the memory the engine saw (RAM in use by others changes between calibration and now).
    room = real_free + shape.weight_bytes() + profile.reserved_bytes
    if profile.memory_bytes < room:
        profile = profile.replace(memory_bytes=room)
    predicted, pwall, sim_plans, sim = _sim_run(shape, profile, wl, cfg.copy(num_blocks=real_cfg.num_blocks))
    common = sorted(set(measured) & set(predicted))
    sim_parts = {s.step_id: dict(s.cost.parts, host=s.cost.host_s, launch=s.cost.launch_s) for s in sim.steps}
    prefill_steps = {p[0] for p in real_plans if any(t[1] == "prefill" for t in p[1])}
    row = _row(name, measured, predicted, common, prefill_steps, real_plans == sim_plans, wall, pwall, real_s,
               sim.wall_s, [(s, measured[s], predicted[s], phases.get(s), sim_parts.get(s)) for s in common])
    row["measured_walls_s"] = walls
    return row


def predict(workload: str = "nanovllm-256", profile: str = "h200", *, shape: str | None = None,
            dtype: str | None = None, seed: int = 0, scale: float = 1.0) -> dict[str, Any]:
    """The simulator's prediction for a standard workload on a profile (all requests at 0), no real run (torch-free).

    Returns:
        {"workload", "profile", "shape", "dtype", "requests", "steps", "wall_s" (simulated), "output_tokens_per_s",
        "ttft_s_p50", "tpot_s_p50", "num_blocks", "page_size", "async_batching", "sim_host_s"}.
    """
    from cbnb.lab.workloads import get_workload

    from ..sim.engine import SimEngine
    from ..sim.shapes import load_shape

    wl = get_workload(workload, seed=seed, scale=scale)
    sh = load_shape(shape or wl.model, dtype=dtype or wl.dtype)
    sim = SimEngine(sh, profile)
    if shape is not None:  # another model's shape: draw the ids within its vocabulary
        wl = get_workload(workload, seed=seed, scale=scale, engine=sim)
    for i, (p, n) in enumerate(zip(wl.prompts, wl.max_new_tokens)):  # caller-driven: all in before the first step
        sim.submit(p, n, request_id=f"w{i}")
    sim.run()
    outs = sim.outputs()
    ttft = sorted(o.timings.first_token - o.timings.queued for o in outs)
    tpot = sorted((o.timings.finished - o.timings.first_token) / (len(o.token_ids) - 1) for o in outs
                  if len(o.token_ids) > 1)
    return {"workload": workload, "profile": sim.profile.name, "shape": sh.name, "dtype": sh.dtype,
            "requests": wl.num_requests, "steps": len(sim.steps), "wall_s": sim.now,
            "output_tokens_per_s": sum(len(o.token_ids) for o in outs) / sim.now if sim.now else float("nan"),
            "ttft_s_p50": _pct(ttft, 0.5), "tpot_s_p50": _pct(tpot, 0.5), "num_blocks": sim.config.num_blocks,
            "page_size": sim.config.page_size, "async_batching": sim.async_batching, "sim_host_s": sim.wall_s}


def speed_probe(model: Any, reps: int = 9) -> float:
    """This machine's speed now, as the engine feels it: forwards per second of `model` over 8 tokens (every weight
    streamed once, about a decode step's work), the median of `reps` runs. Noisy neighbours move it by tens of % within
    minutes; `main` prints it beside each workload, relative to its value right after the calibration."""
    import torch

    ids = torch.arange(10, 18).unsqueeze(0)
    with torch.inference_mode():
        model(ids)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            model(ids)
            ts.append(time.perf_counter() - t0)
    return 1.0 / statistics.median(ts)


def _table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'workload':<14} {'steps':>5} {'plans':>6} {'wall meas':>9} {'wall pred':>9} {'wall err':>8} "
            f"{'step err p50':>12} {'p90':>6} {'prefill p50':>11} {'decode p50':>10} {'targets':>7} {'speed':>6} "
            f"{'spread':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        plans = "timed" if r["plans_identical"] is None else ("same" if r["plans_identical"] else "DIFF")
        lines.append(f"{r['workload']:<14} {r['steps']:>5} {plans:>6} "
                     f"{r['measured_wall_s']:>8.2f}s {r['predicted_wall_s']:>8.2f}s {100 * r['signed_wall_error']:>+7.1f}% "
                     f"{100 * r['median_step_error']:>11.1f}% {100 * r['p90_step_error']:>5.0f}% "
                     f"{100 * r['median_prefill_step_error']:>10.1f}% {100 * r['median_decode_step_error']:>9.1f}% "
                     f"{'yes' if r['within_targets'] else 'no':>7} {_speed(r.get('machine_speed')):>6} "
                     f"{_spread(r.get('measured_walls_s')):>6}")
    return "\n".join(lines)


def _speed(x: float | None) -> str:
    return "" if x is None else f"{100 * (x - 1):+.0f}%"


def _spread(walls: list[float] | None) -> str:
    if not walls or len(walls) < 2:
        return ""
    return f"{100 * (max(walls) - min(walls)) / statistics.median(walls):.0f}%"


def _prediction_text(p: dict[str, Any]) -> str:
    return (f"prediction (simulated, not measured): {p['workload']} ({p['requests']} requests at t=0) on {p['profile']}, "
            f"shape {p['shape']} {p['dtype']}, page_size {p['page_size']}, num_blocks {p['num_blocks']}, "
            f"async batching {'on' if p['async_batching'] else 'off'}: {p['steps']} steps, wall {p['wall_s']:.2f} s, "
            f"{p['output_tokens_per_s']:,.0f} output tok/s, TTFT p50 {p['ttft_s_p50']:.2f} s, "
            f"TPOT p50 {1000 * p['tpot_s_p50']:.1f} ms (simulated in {p['sim_host_s']:.1f} s here). "
            "GPU fidelity is unverified: no GPU run was compared.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cbnb.measure.validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated (default: %(default)s)")
    ap.add_argument("--profile", default=None, help="a saved profile (name or JSON); default: calibrate now")
    ap.add_argument("--scale", type=float, default=1.0, help="shrink the workloads (default 1.0)")
    ap.add_argument("--json", default=None, help="also write the results (with per-step times) to this file")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads for the engine and the calibration (default: torch's)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="real runs per workload; the medians are compared and their spread printed (default 1)")
    ap.add_argument("--predict", default=None, metavar="PROFILE",
                    help="only print the prediction for nanovllm-256 on PROFILE (e.g. h200): no real run, no torch")
    args = ap.parse_args(argv)
    if args.predict:
        print(_prediction_text(predict("nanovllm-256", args.predict)))
        return 0
    names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad:
        ap.error(f"--workloads: unknown {', '.join(bad)}; choose from {', '.join(WORKLOADS)}")
    if args.repeat < 1:
        ap.error(f"--repeat must be >= 1; got {args.repeat}")
    import torch

    import cbnb

    from .calibrate import calibrate
    from ..sim.profiles import load_profile

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = cbnb.load_model(MODEL)
    if args.profile:
        profile = load_profile(args.profile)
    else:
        t = time.perf_counter()
        profile = calibrate(MODEL, save=False, verbose=True, model=model)
        print(f"calibrated in {time.perf_counter() - t:.0f} s ({profile.notes})")
    ref = speed_probe(model)
    load0 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    rows = []
    for w in names:
        before = speed_probe(model)
        rows.append(validate_workload(w, profile, model=model, tokenizer=tok, scale=args.scale, repeat=args.repeat))
        rows[-1]["machine_speed"] = (before + speed_probe(model)) / 2 / ref
    load1 = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(_table(rows))
    print(f"threads {torch.get_num_threads()}, load average {load0:.1f} before, {load1:.1f} after "
          f"({os.cpu_count()} CPUs)")
    print("targets: median |step error| <= 15 %, |wall error| <= 10 %")
    print(f"speed: the model's 8-token forward ({1e3 / ref:.0f} ms after the calibration) timed before and after "
          "each real run, faster (+) or slower (-) than after the calibration: a machine that changed speed moves "
          "the errors with it; spread: (slowest - fastest) / median of a workload's real runs (--repeat)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": profile.to_dict(), "results": rows, "load_average": [load0, load1],
                       "threads": torch.get_num_threads()}, f, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
