"""Offload policy: which active requests give up their blocks when others stall, and how (torch-free).

When the plan reports stalled requests (active requests that could not get their next blocks), victims are chosen
among the active requests *not* in this step, newest first (transformers pops the newest starved request), until
the remaining stalled requests' block needs are covered. The last active request is never offloaded, so one
request always makes progress.

Each victim takes one of two paths:

- **swap**: when a host swap pool exists (`cpu_offload_space > 0`) and holds the victim's blocks, its pages are
  copied to the pool and its device blocks freed; it is re-queued with its progress and restored by a copy when
  scheduled again (no recomputation).
- **soft reset**: otherwise, its blocks are freed (full blocks stay in the prefix cache when sharing is on) and it is
  re-queued with ``num_computed = 0``: prompt and generated tokens are recomputed as a prefill, progress kept.

One exception to "never the last active request" (`choose_defragment`): with several layer groups, sector
fragmentation can stall a request that is alone in the cache although it fits an empty cache; rather than failing
it, it is swapped out or soft-reset itself and re-admitted into compact blocks.

This module decides; the engine core applies the decision and the runner copies the pages.
"""

from __future__ import annotations

from dataclasses import dataclass

from .cache.manager import CacheManager
from .requests import Request
from .plan import StalledRequest

__all__ = ["OffloadDecision", "choose_victims", "choose_defragment", "SWAP", "SOFT_RESET"]

SWAP = "swap"
SOFT_RESET = "soft_reset"


@dataclass
class OffloadDecision:
    """One victim and its path.

    Attributes:
        request: the victim.
        path: "swap" or "soft_reset".
        reason: why (which stalled requests needed how many blocks).
        blocks_freed: device blocks the victim releases (exclusive ones; shared ones stay referenced).
        tokens_to_recompute: tokens whose K/V must be computed again (0 for a swap).
    """

    request: Request
    path: str
    reason: str
    blocks_freed: int
    tokens_to_recompute: int


class _Projection:
    """What the cache would look like once some requests released their device blocks (a dry run).

    It mirrors `CacheManager.allocate` and `BlockAllocator.release_empty_sectors` at sector granularity, so that for
    a hybrid model (several groups sharing the sector pool) a block freed in one group does not count as room for
    another group unless its whole sector empties.
    """

    def __init__(self, cache: CacheManager) -> None:
        self.cache = cache
        self.multi = len(cache.allocators) > 1
        self.pool_free = cache.pool.num_free
        self.free_owned = [a.num_free_owned for a in cache.allocators]
        self.demotable = [a.num_demotable for a in cache.allocators]
        self.sector_free = [dict(a._sector_free) for a in cache.allocators]
        self.released: list[dict[int, int]] = [{} for _ in cache.allocators]  # block -> references dropped
        if self.multi:
            self._return_empty_sectors()

    def release(self, req: Request) -> None:
        cache = self.cache
        for g, a in enumerate(cache.allocators):
            dropped = self.released[g]
            for b in a.table(req.request_id):
                dropped[b] = dropped.get(b, 0) + 1
                if a.refcount[b] - dropped[b] > 0:
                    continue
                if a.prefix is not None and a.prefix.is_hashed(b):
                    self.demotable[g] += 1
                else:
                    self.free_owned[g] += 1
                    s = b // a.blocks_per_sector
                    self.sector_free[g][s] = self.sector_free[g].get(s, 0) + 1
        if self.multi:
            self._return_empty_sectors()

    def _return_empty_sectors(self) -> None:
        for g, a in enumerate(self.cache.allocators):
            bps = a.blocks_per_sector
            empty = [s for s, n in self.sector_free[g].items() if n == bps]
            for s in empty:
                del self.sector_free[g][s]
                self.free_owned[g] -= bps
                self.pool_free += 1

    def fits(self, stalled: list[StalledRequest]) -> bool:
        """Whether every stalled request gets its blocks, admitted one after another."""
        pool_free = self.pool_free
        free_owned = list(self.free_owned)
        demotable = list(self.demotable)
        for s in stalled:
            sectors = []
            for g, a in enumerate(self.cache.allocators):
                short = s.blocks_needed[g] - free_owned[g] - demotable[g]
                sectors.append(-(-max(0, short) // a.blocks_per_sector))
            if sum(sectors) > pool_free:
                return False
            pool_free -= sum(sectors)
            for g, a in enumerate(self.cache.allocators):
                left = free_owned[g] + sectors[g] * a.blocks_per_sector - s.blocks_needed[g]
                if left < 0:
                    demotable[g] += left
                    left = 0
                free_owned[g] = left
        return True


def choose_victims(
    active: list[Request],
    stalled: list[StalledRequest],
    scheduled_ids: set[str],
    cache: CacheManager,
) -> list[OffloadDecision]:
    """Pick the fewest newest victims that let the stalled requests proceed.

    Args:
        active: active requests in admission order (oldest first).
        stalled: the plan's stalled requests (their block needs and what was obtainable, per group).
        scheduled_ids: requests in the current step (never victims: their blocks are in use this step). Requests
            with an in-flight step (`pending_samples > 0`, async batching) are never victims either.
        cache: the cache manager (for block counts and swap-pool room).

    Returns:
        Decisions, newest victim first. Empty when nothing can or need be done.
    """
    if not stalled:
        return []
    n_groups = len(cache.allocators)
    remaining = list(stalled)
    projection = _Projection(cache)
    decisions: list[OffloadDecision] = []
    need_txt = ", ".join(f"{s.request_id} needs {sum(s.blocks_needed)} blocks" for s in stalled)
    reason = f"cache full: {need_txt}"
    swap_sizes = [0] * n_groups  # host blocks already promised to earlier victims in this round
    for victim in reversed(active):
        if not remaining or projection.fits(remaining):
            break
        if len(active) - len(decisions) <= 1:
            break  # never offload the last active request
        if victim.request_id in scheduled_ids or victim.pending_samples:
            continue  # its blocks are in use by this step, or by an in-flight one (async) not yet applied
        excl = cache.exclusive_blocks(victim)
        if not any(excl):
            continue  # every block it holds is shared: offloading it frees nothing
        sizes = [len(t) for t in cache.block_tables(victim)]
        path = SOFT_RESET
        if cache.swap is not None:
            total = [a + b for a, b in zip(swap_sizes, sizes)]
            if cache.swap.can_fit(total):
                path = SWAP
                swap_sizes = total
        decisions.append(OffloadDecision(
            request=victim,
            path=path,
            reason=reason,
            blocks_freed=sum(excl),
            tokens_to_recompute=0 if path == SWAP else victim.num_computed,
        ))
        projection.release(victim)
        remaining = [s for s in remaining if s.request_id != victim.request_id]
    return decisions


def choose_defragment(
    active: list[Request],
    stalled: list[StalledRequest],
    cache: CacheManager,
) -> list[OffloadDecision]:
    """The lone active request stalled by sector fragmentation: release and re-admit it rather than fail it.

    With several layer groups sharing the sector pool, a request alone in the cache can hold blocks scattered over
    partly free sectors of one group while another group finds no free sector, although the request would fit an
    empty cache. There is no other victim (the rule "never the last active request" protects progress when others
    exist), so the request itself gives up its blocks: swapped out when the host pool holds it (restored by a copy
    into compact blocks), else soft-reset. A request that does not fit an empty cache gets no decision (it fails).
    """
    if len(active) != 1 or len(stalled) != 1 or stalled[0].request_id != active[0].request_id:
        return []
    req, s = active[0], stalled[0]
    if req.pending_samples or not cache.fits_empty(s.tokens):
        return []
    path = SWAP if cache.can_swap(req) else SOFT_RESET
    return [OffloadDecision(
        request=req,
        path=path,
        reason=(f"defragment: {req.request_id} needs {sum(s.blocks_needed)} blocks for {s.tokens} tokens, which fit "
                f"an empty cache but not the space its layer groups' blocks leave free around its own"),
        blocks_freed=sum(cache.exclusive_blocks(req)),
        tokens_to_recompute=0 if path == SWAP else req.num_computed,
    )]
