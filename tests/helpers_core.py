"""A small torch-free engine core for the scheduler tests (tests/core/test_scheduler.py, test_vllm_scheduler.py):
one KV group, one block per sector, `P` tokens a page; requests of consecutive token ids; one step = schedule, apply
with a fixed token, check the cache's invariants."""

from __future__ import annotations

from cbnb.core.cache.layout import KVLayout, layer_groups
from cbnb.core.cache.manager import CacheManager
from cbnb.core.config import ContinuousBatchingConfig
from cbnb.core.engine_core import EngineCore
from cbnb.core.plan import BatchPlan, SkipReason
from cbnb.core.requests import Request, SamplingParams

P = 4


def core_for(num_sectors: int = 32, *, sharing: bool = True, swap: int = 0, **cfg) -> EngineCore:
    """An `EngineCore` over `num_sectors` blocks of `P` tokens (`cfg`: config fields; max_batch_tokens 64)."""
    cfg.setdefault("max_batch_tokens", 64)
    config = ContinuousBatchingConfig(page_size=P, allow_block_sharing=sharing, **cfg).resolve("cpu")
    layout = KVLayout(tuple(layer_groups(1)), 1, 16, 4, P)  # one block per sector
    return EngineCore(config, CacheManager(layout, num_sectors, allow_block_sharing=sharing, swap_sectors=swap))


def add(core: EngineCore, rid: str, n: int, max_new: int = 8, base: int = 10) -> Request:
    """Add a request of `n` prompt tokens ``base, base + 1, ...`` (EOS 1, never drawn)."""
    r = Request(rid, [base + i for i in range(n)], SamplingParams(max_new_tokens=max_new, eos_token_ids=1))
    assert core.add(r)
    return r


def step(core: EngineCore, token: int = 5) -> BatchPlan:
    """One step: schedule, apply `token` for every sampling row, check the cache; the step's plan."""
    work = core.schedule()
    core.apply(work, {s.request_id: token for s in work.plan.scheduled if s.samples})
    core.cache.check_invariants(list(core.requests.values()))
    return work.plan


def ids(plan: BatchPlan) -> list[tuple[str, int, int]]:
    """(request id, first position, token count) of each scheduled row."""
    return [(s.request_id, s.start, s.num_tokens) for s in plan.scheduled]


def reason(plan: BatchPlan, rid: str) -> SkipReason:
    """Why `plan` left `rid` out (asserts it is listed)."""
    entry = plan.skip_reason(rid)
    assert entry is not None, f"{rid} not listed"
    return entry.reason
