"""The end-to-end fits behind `cbnb.measure.calibrate` (imported only when torch is installed): the engine's fixed
costs per step, layer, attention call and request (`_fixed_costs`) over tiny models, and the cost model's group
factors (`fit_factors`) over engine runs of a random-weight model of the shape."""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..sim.shapes import ModelShape
from ._together import submitted_together

def _tiny_model(s: ModelShape, layers: int) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    kw: dict[str, Any] = dict(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                              num_key_value_heads=2 if s.num_kv_heads > 1 else 1, head_dim=16, vocab_size=512,
                              max_position_embeddings=4096, tie_word_embeddings=s.tie_word_embeddings)
    if s.layer_types is not None:
        kw["layer_types"] = [s.layer_types[j % len(s.layer_types)] for j in range(layers)]
    if s.sliding_window is not None:
        kw["sliding_window"] = s.sliding_window
    try:
        cfg = AutoConfig.for_model(s.model_type, **kw)
    except (ValueError, KeyError):
        cfg = AutoConfig.for_model("llama", **{k: v for k, v in kw.items() if k not in ("layer_types",)})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.requires_grad_(False)
    return model.eval()


def _decode_step_s(model: Any, rows: int, steps: int) -> float:
    """Median seconds of a decode step of `rows` single-page requests, from the engine's own step events."""
    from ..core.config import ContinuousBatchingConfig
    from ..engine.engine import Engine

    cfg = ContinuousBatchingConfig(page_size=256, num_blocks=rows + 4, max_batch_tokens=512)
    eng = Engine(model, config=cfg)
    try:
        with submitted_together(eng, timeout=60):  # every request lands in the first loop turn
            handles = [eng.submit(list(range(10, 18)), max_new_tokens=steps + 1, eos_token_id=-1)
                       for _ in range(rows)]
        for hd in handles:
            hd.result(timeout=600)
    finally:
        eng.stop()
    plans = {e.step: e for e in eng.events.events("step_planned")}
    times = [e.t - plans[e.step].t for e in eng.events.events("step_timing")
             if e.step in plans and plans[e.step].prefill_tokens == 0 and len(plans[e.step].taken) == rows]
    times.sort()
    return times[len(times) // 2]


def _fixed_costs(s: ModelShape, quick: bool, log: Callable[..., None]) -> dict[str, float]:
    """Fit t(L, B) = step + L * layer + L * B * call + B * request over tiny models' decode steps (least squares).

    The (layers, rows) points are measured in interleaved rounds so that a noisy period hits them all alike."""
    import numpy as np

    steps = 12 if quick else 30
    rounds = 1 if quick else 2
    points = [(layers, rows) for layers in (2, 8) for rows in (1, 8, 16)]
    models = {layers: _tiny_model(s, layers) for layers in (2, 8)}
    samples: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for _ in range(rounds):
        for layers, rows in points:
            samples[layers, rows].append(_decode_step_s(models[layers], rows, steps))
    t = {p: sorted(v)[len(v) // 2] for p, v in samples.items()}
    a = np.array([[1.0, L, L * B, B] for L, B in points])
    y = np.array([t[p] for p in points])
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    base, layer, call, req = (max(0.0, float(c)) for c in coef)
    log(f"fixed: step {base * 1e3:.3f} ms, layer {layer * 1e6:.1f} us, attention call {call * 1e6:.1f} us, "
        f"request {req * 1e6:.1f} us  (from {', '.join(f'L{k[0]}xB{k[1]}={v * 1e3:.2f}ms' for k, v in t.items())})")
    # More layers or more rows never make a step cheaper: when they do, the machine was too busy to measure.
    noisy = any(t[2, b] > t[8, b] for b in (1, 8, 16)) or any(t[L, 1] > t[L, 16] for L in (2, 8))
    return {"step_s": base, "layer_s": layer, "call_s": call, "request_s": req, "noisy": noisy}


# The end-to-end runs behind `cost_factors`: (requests, prompt tokens, new tokens). A long prompt alone (a full
# 512-token chunk, then decode over ~500 keys), a few short ones (decode at 4 rows), and 12 mid-sized ones (chunks
# with a past, then decode at 12 rows). None of them is a validation workload.
_FIT_RUNS = ((1, 480, 10), (4, 40, 24), (12, 160, 16), (32, 24, 8))
# The compute factor is a curve over the step's query tokens at these rows (a forward's small GEMMs lose more to
# their neighbours than its large ones), linear in log rows between them.
_FIT_COMPUTE_ROWS = (1, 16, 512)
# Each fit run runs this many times; a step's time is its fastest (the same plan every time: all requests arrive
# before the first step).
_FIT_REPEATS = 2
_FIT_BOUNDS = (0.25, 4.0)
# Ridge toward 1: moving a factor by 1 costs as much as 10 % more error on every step where its group is at least
# 5 % of the time, so a group the runs barely determine (collinear with another) stays near its microbenchmark value.
_FIT_RIDGE = 0.01


def _shape_model(s: ModelShape, budget_bytes: int) -> tuple[Any, ModelShape]:
    """A random-weight model of the shape (float32), with fewer layers when the whole one would exceed
    `budget_bytes`; returns it and the shape it has."""
    import dataclasses

    from transformers import AutoConfig, AutoModelForCausalLM

    layer_bytes = max(1, (s.weight_bytes() - s.vocab_size * s.hidden_size * s.itemsize) // max(1, s.num_layers))
    layers = max(2, min(s.num_layers, budget_bytes // layer_bytes))
    types = tuple(s.layer_types[:layers]) if s.layer_types else None
    kw: dict[str, Any] = dict(num_hidden_layers=layers, hidden_size=s.hidden_size,
                              intermediate_size=s.intermediate_size, num_attention_heads=s.num_heads,
                              num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, vocab_size=s.vocab_size,
                              max_position_embeddings=max(4096, s.max_position_embeddings or 0),
                              tie_word_embeddings=s.tie_word_embeddings)
    if types is not None:
        kw["layer_types"] = list(types)
    if s.sliding_window is not None:
        kw["sliding_window"] = s.sliding_window
    try:
        cfg = AutoConfig.for_model(s.model_type, **kw)
    except (ValueError, KeyError):
        cfg = AutoConfig.for_model("llama", **{k: v for k, v in kw.items() if k != "layer_types"})
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, s.dtype))
    model.requires_grad_(False)
    return model.eval(), dataclasses.replace(s, num_layers=layers, layer_types=types)


def _engine_steps(model: Any, requests: int, prompt: int, new: int) -> list[tuple[float, tuple]]:
    """(measured seconds, plan rows) of every step of one cbnb.Engine run (all requests in before the first step).
    Plan rows are (start, tokens, samples, shared tokens) as `cbnb.sim.cost.StepLoad.of` takes them."""
    from ..core.config import ContinuousBatchingConfig
    from ..engine.engine import Engine

    cfg = ContinuousBatchingConfig(page_size=32, num_blocks=requests * (-(-(prompt + new) // 32)) + 8,
                                   max_batch_tokens=512)
    eng = Engine(model, config=cfg)
    try:
        with submitted_together(eng, timeout=60):
            handles = [eng.submit([10 + (7 * i + j) % 400 for j in range(prompt)], max_new_tokens=new,
                                  eos_token_id=-1) for i in range(requests)]
        for hd in handles:
            hd.result(timeout=600)
    finally:
        eng.stop()
    plans = {e.step: e for e in eng.events.events("step_planned")}
    out = []
    for e in eng.events.events("step_timing"):
        p = plans.get(e.step)
        if p is None:
            continue
        shared = p.shared_tokens or [0] * len(p.taken)
        rows = tuple((start, n, phase == "decode" or start + n >= prompt, sh)
                     for (_rid, phase, n, start, _h), sh in zip(p.taken, shared))
        out.append((e.t - p.t, rows))
    return out


def fit_factors(s: ModelShape, profile: Any, log: Callable[..., None], model: Any = None,
                budget_bytes: int = 1 << 30) -> dict[str, Any]:
    """`HardwareProfile.cost_factors` for `profile` (its microbenchmark figures, factors 1): run `_FIT_RUNS` on
    cbnb.Engine (`model`, or a random-weight model of the shape; each `_FIT_REPEATS` times, a step's fastest time
    kept) and find the factors that minimise the squared
    relative error of the cost model's step times plus a ridge toward 1, ``sum_s ((sum_g f_g t_sg - m_s) / m_s)^2 +
    sum_g _FIT_RIDGE n_g (f_g - 1)^2`` with n_g the steps where group g is at least 5 % of the step (linear; a
    factor outside `_FIT_BOUNDS` is clamped and the others refitted). Groups with no time in the
    runs keep factor 1. Returns {"factors", "steps", "error_pct_before", "error_pct_after"} (median |relative step
    error| of the fit runs with factors 1 and with the fitted ones)."""
    import numpy as np

    from ..sim.cost import CostModel, StepLoad, log_interp_weights

    if model is None:
        model, fit_shape = _shape_model(s, budget_bytes)
    else:
        fit_shape = s
    base = profile.replace(cost_factors=None)
    from ..core.config import ContinuousBatchingConfig

    cost = CostModel(fit_shape, base, ContinuousBatchingConfig(page_size=32, max_batch_tokens=512))
    names = tuple(f"compute@{r}" for r in _FIT_COMPUTE_ROWS) + ("attention", "decode_attention", "fixed")
    rows, meas = [], []
    for i, run in enumerate(_FIT_RUNS):
        steps = _engine_steps(model, *run)
        for _ in range(_FIT_REPEATS - 1):  # a neighbour only ever slows a step: keep each step's fastest repeat
            again = _engine_steps(model, *run)
            if [p for _, p in again] == [p for _, p in steps]:
                steps = [(min(m, m2), p) for (m, p), (m2, _) in zip(steps, again)]
        for j, (m, plan) in enumerate(steps):
            if (i == 0 and j == 0) or m <= 0 or not plan:
                continue  # the very first step also pays one-off warm-up
            load = StepLoad.of(plan)
            g = cost.step(load).groups
            w = log_interp_weights(list(_FIT_COMPUTE_ROWS), load.num_tokens)
            rows.append([g["compute"] * wi for wi in w] + [g[k] for k in names[len(w):]] + [g["swap"]])
            meas.append(m)
    a = np.array(rows)
    y = np.array(meas)
    free = [k for k in range(len(names)) if a[:, k].sum() > 0]
    fixed = {k: 1.0 for k in range(len(names)) if k not in free}
    lo, hi = _FIT_BOUNDS
    # per group: the steps where it is at least 5 % of the step
    lam_g = _FIT_RIDGE * np.maximum(1, (a[:, :-1] >= 0.05 * y[:, None]).sum(0))
    while True:
        cols = [k for k in free if k not in fixed]
        rhs = (y - a[:, -1] - sum(a[:, k] * v for k, v in fixed.items())) / y
        x = a[:, cols] / y[:, None]
        lam = np.diag(lam_g[cols])
        coef = np.linalg.solve(x.T @ x + lam, x.T @ rhs + lam.sum(1)) if cols else []
        out = dict(zip(cols, (float(c) for c in coef)))
        bad = {k: min(max(v, lo), hi) for k, v in out.items() if not lo <= v <= hi}
        if not bad:
            break
        worst = max(bad, key=lambda k: abs(np.log(max(out[k], 1e-9) / bad[k])))
        fixed[worst] = bad[worst]
    fitted = {names[k]: round(v, 4) for k, v in {**out, **fixed}.items()}
    f = np.array([fitted[k] for k in names] + [1.0])
    factors: dict[str, Any] = {k: fitted[k] for k in names if not k.startswith("compute@")}
    factors["compute"] = [[r, fitted[f"compute@{r}"]] for r in _FIT_COMPUTE_ROWS]
    before = float(np.median(np.abs(a[:, :-1].sum(1) + a[:, -1] - y) / y))
    after = float(np.median(np.abs(a @ f - y) / y))
    log("cost factors " + ", ".join(f"{k} {v:.2f}" for k, v in fitted.items())
        + f"  (fit runs: median step error {100 * before:.1f} % -> {100 * after:.1f} %, {len(y)} steps)")
    return {"factors": factors, "steps": len(y), "error_pct_before": round(100 * before, 1),
            "error_pct_after": round(100 * after, 1)}
