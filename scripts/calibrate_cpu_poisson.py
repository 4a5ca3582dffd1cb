"""Measure this machine's capacity on cpu-poisson's requests and print the Poisson rate for a target load.

    .venv/bin/python scripts/calibrate_cpu_poisson.py --repeats 5 --load 0.7

Capacity = finished requests per second with every request submitted at 0 (the engine's service rate when it is
never idle), measured `--repeats` times on a fresh cache. Rate = load * capacity, printed for the median and for the
fastest run (on a machine shared with other jobs, contention only slows runs down: the fastest is the engine's own).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--load", type=float, default=0.7)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)

    import cbnb
    from cbnb.lab.tuning import measure_capacity
    from cbnb.lab.workloads import get_workload

    wl = get_workload("cpu-poisson", scale=args.scale)
    model, tok = cbnb.load_model(wl.model)
    eng = cbnb.Engine(model, tok, cbnb.ContinuousBatchingConfig(**wl.config_hints))
    with eng:
        eng.generate([wl.prompts[0][:8]], max_new_tokens=2, ignore_eos=True)  # warm-up
        cap = measure_capacity(eng, wl, repeats=args.repeats)
    import os as _os

    out = {"load": args.load, "rate_from_median": round(args.load * cap["capacity_requests_per_s"], 3),
           "rate_from_max": round(args.load * cap["max_requests_per_s"], 3), **cap,
           "load_average": _os.getloadavg(),
           "threads": torch.get_num_threads(), "config": wl.config_hints, "scale": args.scale,
           "date": datetime.date.today().isoformat(),
           "command": f"scripts/calibrate_cpu_poisson.py --repeats {args.repeats} --load {args.load}"}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
