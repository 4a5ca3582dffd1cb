"""Experiments for notebooks and workshops: run a workload under a config, sweep configs, tabulate the figures.

::

    from cbnb.experiments import run_workload, sweep
    row = run_workload(engine, get_workload("cpu-32", scale=0.25))          # one run on a live engine
    table = sweep(engine, workload, {"page_size": [16, 64], "safety_margin": [0.0, 0.15]}, base=config)

`sweep` reconfigures one engine between runs (`engine.reconfigure`), so the dashboard attached to it shows every
run live. Rows hold the figures of `engine.stats()["run"]` flattened (units in the names), the config values that
changed, and the run's wall time.

Importing this module also makes plotly's default template include cbnb's (`cbnb.plot_theme`): transparent
backgrounds and grey text, so the notebooks' summary charts read in JupyterLab's dark theme as in its light one
(unless another default template was chosen).
"""

from __future__ import annotations

import itertools
import time
from typing import Any, Iterable, Mapping

from .config import ContinuousBatchingConfig
from .plot_theme import use_theme_template

__all__ = ["run_workload", "sweep", "flatten_stats"]

use_theme_template()  # the notebooks' plotly charts follow JupyterLab's light / dark theme


def flatten_stats(stats: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """`{"ttft_s": {"p50": x}}` -> `{"ttft_s_p50": x}`; other nested dicts flattened the same way."""
    out: dict[str, Any] = {}
    for k, v in stats.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten_stats(v, key + "_"))
        else:
            out[key] = v
    return out


def run_workload(engine: Any, workload: Any, *, timeout: float | None = 3600.0) -> dict[str, Any]:
    """Submit every request of `workload` to a (started) engine, wait for all, and return the run's figures.

    Resets the engine's per-run stats first. The row also holds `wall_s`, `workload`, `requests`, and the number
    of requests that did not finish (`not_finished`).

    Raises:
        TimeoutError: when the run takes longer than `timeout` seconds.
    """
    engine.start()
    engine.reset_stats()
    t0 = time.perf_counter()
    handles = [engine.submit(p, max_new_tokens=n, ignore_eos=True)
               for p, n in zip(workload.prompts, workload.max_new_tokens)]
    deadline = None if timeout is None else time.monotonic() + timeout
    outs = []
    for h in handles:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        outs.append(h.result(left))
    wall = time.perf_counter() - t0
    row = flatten_stats(engine.stats()["run"])
    row.update(workload=workload.name, requests=len(outs), wall_s=wall,
               wall_output_tokens_per_s=sum(len(o.token_ids) for o in outs) / wall if wall > 0 else 0.0,
               not_finished=sum(o.state.name != "FINISHED" for o in outs))
    return row


def _grid(params: Mapping[str, Iterable[Any]]) -> list[dict[str, Any]]:
    keys = list(params)
    return [dict(zip(keys, vals)) for vals in itertools.product(*(list(params[k]) for k in keys))]


def sweep(engine: Any, workload: Any, params: Mapping[str, Iterable[Any]] | list[Mapping[str, Any]],
          *, base: ContinuousBatchingConfig | None = None, derive: Any = None, progress: bool = True):
    """Run `workload` once per config and return a pandas DataFrame (one row per run).

    Args:
        engine: a `cbnb.Engine`; it is reconfigured before each run and left on the last config.
        workload: a `cbnb.workloads.Workload`.
        params: a grid {field: values} (every combination) or an explicit list of {field: value} dicts.
        base: the config the changes apply to (default: the engine's current user config).
        derive: optional function(changes) -> extra changes (e.g. keep the cache's bytes fixed by setting
            num_blocks from page_size).
        progress: print one line per run.

    Raises:
        ImportError: without pandas.
    """
    import pandas as pd

    base = base or engine.user_config
    runs = _grid(params) if isinstance(params, Mapping) else [dict(p) for p in params]
    rows = []
    for i, changes in enumerate(runs):
        full = dict(changes)
        if derive is not None:
            full.update(derive(dict(changes)))
        engine.reconfigure(base.copy(**full))
        row = run_workload(engine, workload)
        rows.append({**changes, **{k: v for k, v in full.items() if k not in changes}, **row})
        if progress:
            desc = ", ".join(f"{k}={v}" for k, v in full.items())
            print(f"[{i + 1}/{len(runs)}] {desc}: {row['output_tokens_per_s']:.1f} out tok/s, "
                  f"TTFT p50 {row['ttft_s_p50'] or 0:.2f} s, swaps {row['swaps']}, soft resets {row['soft_resets']}")
    return pd.DataFrame(rows)
