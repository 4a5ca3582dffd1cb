"""The simulator makes the real engine's decisions and records them the same way: for requests all submitted before
the engine starts, its sequence of StepPlanned records (scheduled ids, query tokens, start positions, prefix hits,
skip reasons, stalls), its offloads, and indeed its whole event log (every record, type by type, in order, apart from
times) equal `cbnb.Engine`'s, and its `stats()` has the same keys, with tiny models, under configs that force
chunking, prefix hits, swaps, soft resets, both schedulers, a hybrid (sliding + full) model, and async batching (the
CUDA runner on CPU with fake graphs)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import cbnb  # noqa: E402
from cbnb.core.requests import RequestState  # noqa: E402
from cbnb.sim import SimEngine, load_shape  # noqa: E402

from helpers_sim import TEST_CPU  # noqa: E402
from helpers_engine import (  # noqa: E402
    STD_NEW, STD_PROMPTS, TIMEOUT, config, paused, random_prompts, tiny_model,
)

# A CPU-like profile: the cost figures do not matter for decisions, the memory does not bind (explicit num_blocks).
_SHARED = random_prompts([24], seed=3)[0]
SHARED_PROMPTS = [_SHARED + p for p in random_prompts([5, 9, 17, 3, 11], seed=4)] + [_SHARED[:16]] + STD_PROMPTS[:3]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


def decisions(events: cbnb.telemetry.events.EventLog) -> tuple[list, list]:
    plans = [(e.step, e.scheduler, e.taken, e.skipped, e.stalled, e.token_budget, e.cache_budget_tokens,
              e.cache_read_tokens, e.request_cap, round(e.free_fraction, 9)) for e in events.events("step_planned")]
    offloads = [(e.step, e.request_id, e.path, e.reason, e.blocks_freed, e.tokens_to_recompute)
                for e in events.events("offload")]
    return plans, offloads


# Fields that hold times (the real engine's are wall seconds, the simulator's simulated seconds) or say how a step ran.
_TIME_FIELDS = {"t", "at", "ttft_s", "e2e_s", "queue_s", "schedule_s", "offload_copy_s", "prepare_s", "forward_s",
                "sample_s", "update_s", "backend"}


def timeless(events: cbnb.telemetry.events.EventLog) -> list[dict]:
    """Every event as a dict without its times; CUDA-graph records are left out (the simulator captures none)."""
    return [{k: v for k, v in e.to_dict().items() if k not in _TIME_FIELDS} for e in events.events()
            if e.kind != "cuda_graph"]


def key_tree(d):
    return {k: key_tree(v) if isinstance(v, dict) and k not in ("offloads_by_path", "offloads_by_reason") else None
            for k, v in d.items()}


def run_real(name: str, cfg, prompts, n, async_: bool = False):
    eng = cbnb.Engine(tiny_model(name), config=cfg)
    if async_:
        from cbnb.runner.cuda.cuda_runner import CudaModelRunner

        r = CudaModelRunner(eng.model, eng.cache.geometry(), eng.store, seed=eng.config.seed, attention="torch")
        r.configure(eng.config, use_cuda_graph=True, use_async_batching=True)
        assert r.async_mode
        eng.runner = r
    ns = n if isinstance(n, list) else [n] * len(prompts)
    with paused(eng):  # every request reaches the core in the loop's first turn, before any step
        hs = [eng.submit(p, max_new_tokens=k, eos_token_id=-1, request_id=f"r{i}")
              for i, (p, k) in enumerate(zip(prompts, ns))]
    outs = [h.result(TIMEOUT) for h in hs]
    eng.stop(drain=True)
    run_real.last = eng
    return decisions(eng.events), outs, eng.config


def run_sim(name: str, cfg, prompts, n, async_: bool = False):
    shape = load_shape(tiny_model(name).config, dtype="float32")
    sim = SimEngine(shape, TEST_CPU, cfg, async_batching=async_)
    ns = n if isinstance(n, list) else [n] * len(prompts)
    for i, (p, k) in enumerate(zip(prompts, ns)):
        sim.submit(p, k, eos_token_id=-1, request_id=f"r{i}")
    sim.run()
    return decisions(sim.events), sim.outputs(), sim


CASES = {
    # chunked prefill under a small token budget, prefix hits on a shared 24-token prefix (page 8)
    "chunking+prefix": ("tiny:llama", dict(page_size=8, num_blocks=64, max_batch_tokens=16), SHARED_PROMPTS, 12),
    # a cache too small for all: swaps to the host pool
    "swap": ("tiny:llama", dict(page_size=8, num_blocks=12, max_batch_tokens=64, cpu_offload_space=0.001),
             STD_PROMPTS, STD_NEW),
    # no host pool: soft resets; hybrid sliding + full model (two layer groups)
    "soft_reset+hybrid": ("tiny:gemma3", dict(page_size=8, num_blocks=12, max_batch_tokens=64, cpu_offload_space=0),
                          STD_PROMPTS, STD_NEW),
    # the other scheduler with a safety margin, sliding-window model, request cap
    "prefill_first": ("tiny:mistral", dict(page_size=8, num_blocks=20, max_batch_tokens=24, max_requests_per_batch=3,
                                           scheduler_type="prefill_first", safety_margin=0.2, cpu_offload_space=0.001),
                      STD_PROMPTS, [30, 10, 20, 5, 24, 12]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_step_plans_and_offloads_equal_the_real_engine(case):
    name, kw, prompts, n = CASES[case]
    cfg = config(**kw)
    (real_plans, real_offloads), real_outs, real_cfg = run_real(name, cfg, prompts, n)
    (sim_plans, sim_offloads), sim_outs, sim = run_sim(name, cfg, prompts, n)
    assert sim.config.num_blocks == real_cfg.num_blocks and sim.memory.num_sectors > 0
    assert len(sim_plans) == len(real_plans)
    for real, simulated in zip(real_plans, sim_plans):
        assert simulated == real, f"step {real[0]} differs"
    assert sim_offloads == real_offloads
    assert [(o.request_id, o.state, len(o.token_ids)) for o in sim_outs] == [
        (o.request_id, o.state, len(o.token_ids)) for o in real_outs]
    real = run_real.last
    real_events, sim_events = timeless(real.events), timeless(sim.events)
    assert [e["kind"] for e in sim_events] == [e["kind"] for e in real_events]
    for a, b in zip(real_events, sim_events):
        assert b == a
    assert key_tree(sim.stats()) == key_tree(real.stats())
    assert sim.stats()["run"]["output_tokens"] == real.stats()["run"]["output_tokens"]
    # The case exercises what it claims.
    taken = [t for p in real_plans for t in p[2]]
    if case == "chunking+prefix":
        assert any(t[4] > 0 for t in taken), "no prefix hit"
        assert any(t[1] == "prefill" and t[3] > 0 and t[4] == 0 for t in taken), "no chunked prefill"
    if case == "swap":
        assert {o[2] for o in real_offloads} == {"swap"}
    if case == "soft_reset+hybrid":
        assert {o[2] for o in real_offloads} == {"soft_reset"}
    if case == "prefill_first":
        assert any(s[0] == "request_cap" for p in real_plans for s in p[3])
    assert all(o.state == RequestState.FINISHED for o in real_outs)


def test_async_batching_plans_equal_the_real_async_engine():
    # The CUDA runner on CPU (fake graphs, torch attention) runs cbnb's async loop: step N+1 is scheduled before
    # step N is applied. The simulator's async loop must schedule the same steps (incl. "finishing" skips).
    cfg = config(page_size=8, num_blocks=16, max_batch_tokens=32, cpu_offload_space=0.001)
    prompts, n = STD_PROMPTS, [24, 6, 12, 3, 24, 9]
    (real_plans, real_offloads), real_outs, _ = run_real("tiny:llama", cfg, prompts, n, async_=True)
    (sim_plans, sim_offloads), sim_outs, sim = run_sim("tiny:llama", cfg, prompts, n, async_=True)
    assert sim.async_batching
    assert sim_plans == real_plans
    assert sim_offloads == real_offloads
    assert timeless(sim.events) == timeless(run_real.last.events)
    assert any(s[0] == "finishing" for p in real_plans for s in p[3]), "no async 'finishing' skip exercised"
    assert [(o.request_id, len(o.token_ids)) for o in sim_outs] == [(o.request_id, len(o.token_ids))
                                                                      for o in real_outs]
