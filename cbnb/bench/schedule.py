"""Scheduling-overhead benchmark: time to plan one step of 256 decoding requests (torch-free).

Run ``python -m cbnb.bench.schedule [--requests 256] [--steps 400] [--profile]``.

Setup: a SmolLM2-135M-shaped KV layout (30 full-attention layers, 3 KV heads, head_dim 64, float32), page_size 16,
prefix caching on, a cache large enough that nothing is offloaded, and `requests` prompts of a few hundred tokens
that share a 128-token prefix. All requests are first prefilled (not timed); then every step is
``core.schedule()`` (timed) → a fake forward that samples a token per request → ``core.apply()`` (timed apart).
Tokens never hit EOS and max_new_tokens is larger than the number of steps, so all requests decode throughout.

Target: median `schedule()` ≤ 1 ms for 256 decoding requests.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

from ..core.cache.layout import KVLayout, layer_groups
from ..core.cache.manager import CacheManager
from ..core.config import ContinuousBatchingConfig
from ..core.engine_core import EngineCore
from ..core.requests import Request, SamplingParams


def build(num_requests: int, page_size: int = 16, seed: int = 0) -> EngineCore:
    rng = random.Random(seed)
    layout = KVLayout(tuple(layer_groups(30)), 3, 64, 4, page_size)
    prefix = [rng.randrange(3, 49152) for _ in range(128)]
    prompts = [prefix + [rng.randrange(3, 49152) for _ in range(rng.randint(100, 300))] for _ in range(num_requests)]
    need = sum(len(p) for p in prompts) + num_requests * 2048
    num_sectors = need // page_size + 16
    cfg = ContinuousBatchingConfig(page_size=page_size, max_batch_tokens=8192, num_blocks=num_sectors).resolve("cuda")
    cache = CacheManager(layout, num_sectors, allow_block_sharing=True)
    core = EngineCore(cfg, cache)
    for i, p in enumerate(prompts):
        core.add(Request(f"req-{i}", p, SamplingParams(max_new_tokens=100_000, eos_token_ids=[0])))
    return core


def fake_tokens(work, rng: random.Random) -> dict[str, int]:
    return {s.request_id: rng.randrange(3, 49152) for s in work.plan.scheduled if s.samples}


def run(num_requests: int = 256, steps: int = 400, page_size: int = 16, profile: bool = False) -> dict[str, float]:
    core = build(num_requests, page_size)
    rng = random.Random(1)
    # Prefill everything (not timed) until every request decodes.
    for _ in range(10_000):
        if all(r.is_decode for r in core.requests.values()) and not core.scheduler.waiting:
            break
        work = core.schedule()
        core.apply(work, fake_tokens(work, rng))
    assert len(core.scheduler.active) == num_requests, "not all requests are decoding"
    sched_t: list[float] = []
    apply_t: list[float] = []
    prof = cProfile.Profile() if profile else None
    for _ in range(steps):
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        work = core.schedule()
        t1 = time.perf_counter()
        if prof is not None:
            prof.disable()
        assert len(work.plan.scheduled) == num_requests and not work.offloads
        toks = fake_tokens(work, rng)
        t2 = time.perf_counter()
        core.apply(work, toks)
        t3 = time.perf_counter()
        sched_t.append(t1 - t0)
        apply_t.append(t3 - t2)
    if prof is not None:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(25)

    def q(xs: list[float], f: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(f * len(xs)))]

    return {
        "requests": num_requests,
        "steps": steps,
        "schedule_median_ms": statistics.median(sched_t) * 1e3,
        "schedule_p90_ms": q(sched_t, 0.9) * 1e3,
        "apply_median_ms": statistics.median(apply_t) * 1e3,
        "apply_p90_ms": q(apply_t, 0.9) * 1e3,
        "prefix_hit_tokens": sum(r.prefix_cached_tokens for r in core.requests.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--profile", action="store_true", help="cProfile the timed schedule() calls")
    args = ap.parse_args()
    r = run(args.requests, args.steps, args.page_size, args.profile)
    print(f"{r['requests']} decoding requests, page_size {args.page_size}, {r['steps']} steps, "
          f"prefix hits {r['prefix_hit_tokens']} tokens")
    print(f"schedule(): median {r['schedule_median_ms']:.3f} ms, p90 {r['schedule_p90_ms']:.3f} ms")
    print(f"apply():    median {r['apply_median_ms']:.3f} ms, p90 {r['apply_p90_ms']:.3f} ms")


if __name__ == "__main__":
    main()
