"""`CacheManager`: the pool, one allocator per layer group, the prefix index and the host swap pool (torch-free).

It answers the scheduler's questions (does this request fit? what prefix is cached? how full is the cache?),
performs all-or-nothing admission across every allocator, registers completed blocks in the prefix index, and
decides which host blocks receive an offloaded request. It hands the runner block tables and slot mappings as plain
lists; it never touches tensors.

Prefix sharing is enabled only when `allow_block_sharing` is set and every layer group is full attention (a single
`FullAttentionCacheAllocator`), as in transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..plan import KVGeometry, KVGroup, RowKV, StepKV
from ..requests import Request
from .allocators import BlockAllocator, FullAttentionCacheAllocator, ceil_div, make_allocator
from .layout import FULL, SLIDING, KVLayout
from .pool import CachePool, UNASSIGNED
from .prefix import PrefixIndex, block_hash
from .swap import HostSwapPool

__all__ = ["CacheManager", "PrefixMatch", "Allocation", "Shortfall", "SwapOut"]


@dataclass
class PrefixMatch:
    """Cached leading full blocks of a request's tokens. `num_tokens` = len(blocks) * page_size."""

    num_tokens: int
    blocks: list[int]


@dataclass
class Allocation:
    """A successful admission/growth.

    Attributes:
        new_blocks: per group, the block ids appended to the request's table.
        demoted: per group, cached blocks whose hash was dropped to make room.
        prefix: the prefix blocks shared at admission, if any.
        restored: per group, (host block, device block) pairs to copy back for a swapped-in request.
    """

    new_blocks: list[list[int]]
    demoted: list[list[int]]
    prefix: PrefixMatch | None = None
    restored: list[list[tuple[int, int]]] | None = None


@dataclass
class Shortfall:
    """A refused admission: new blocks needed and blocks obtainable, per group."""

    needed: list[int]
    available: list[int]

    def describe(self) -> str:
        return ", ".join(f"group {g}: needs {n} blocks, {a} obtainable" for g, (n, a) in
                         enumerate(zip(self.needed, self.available)) if n > a) or "no group short"


@dataclass
class SwapOut:
    """Per group, (device block, host block) pairs to copy for an offloaded request."""

    pairs: list[list[tuple[int, int]]] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return sum(len(p) for p in self.pairs)


class CacheManager:
    """Paged KV bookkeeping for one model.

    Args:
        layout: the cache geometry (`KVLayout`).
        num_sectors: usable device sectors (the two reserved padding sectors come on top).
        allow_block_sharing: the config flag; sharing also needs a pure full-attention model.
        prefix_eviction: "transformers" (most recently freed first) or "lru".
        swap_sectors: host swap pool size in sectors (0: no swap pool).
        sink: optional callable receiving cache events (see `cbnb.telemetry.events`); None costs nothing.
    """

    def __init__(
        self,
        layout: KVLayout,
        num_sectors: int,
        *,
        allow_block_sharing: bool = True,
        prefix_eviction: str = "transformers",
        swap_sectors: int = 0,
        sink: Callable[..., None] | None = None,
    ) -> None:
        if num_sectors < 1:
            raise ValueError(f"num_sectors must be >= 1; got {num_sectors}")
        self.layout = layout
        self.page_size = layout.page_size
        self.pool = CachePool(num_sectors, num_reserved=2)
        self.allocators: list[BlockAllocator] = [make_allocator(g, layout, self.pool) for g in layout.groups]
        self._kv_groups: list[KVGroup] | None = None
        self.sharing = bool(allow_block_sharing and layout.supports_sharing)
        self.full: FullAttentionCacheAllocator | None = None
        for a in self.allocators:
            if isinstance(a, FullAttentionCacheAllocator):
                self.full = a
        self.prefix: PrefixIndex | None = None
        if self.sharing:
            self.prefix = PrefixIndex(prefix_eviction)
            self.full.prefix = self.prefix  # type: ignore[union-attr]
        self.swap: HostSwapPool | None = HostSwapPool(layout, swap_sectors) if swap_sectors > 0 else None
        self.sink = sink
        self._chains: dict[str, list[int]] = {}
        self._hashed: dict[str, int] = {}
        # Requests restored this step whose host blocks are released at the next scheduling pass: the runner copies
        # a step's swap-outs before its restores, so a host block must not be handed to a swap-out victim in the
        # same step it is read back from.
        self._host_release: list[str] = []

    # ------------------------------------------------------------------------------------------ capacity
    @property
    def num_sectors(self) -> int:
        return self.pool.num_sectors

    @property
    def capacity_tokens(self) -> int:
        """Tokens the largest group could hold: transformers' `max_tokens_read`, the scheduler's cache budget."""
        return max(self.page_size * a.usable_blocks for a in self.allocators)

    def fits_empty(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens fits in an otherwise empty cache."""
        sectors = sum(ceil_div(a.blocks_for_tokens(num_tokens), a.blocks_per_sector) for a in self.allocators)
        return sectors <= self.pool.num_sectors

    def max_request_tokens(self) -> int:
        """The longest request that fits in an empty cache (tokens), searched by bisection."""
        lo, hi = 0, self.page_size * max(a.usable_blocks for a in self.allocators)
        if all(a.attention_type != FULL for a in self.allocators) and self.fits_empty(hi):
            return 2**62  # purely sliding: a request never outgrows its window
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.fits_empty(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo

    def free_fraction(self) -> float:
        """Free share of the cache bytes, counting demotable cached prefix blocks as free.

        transformers counts cached blocks as used and, below the safety margin, evicts them all before measuring
        again; counting them as free gives that same figure without destroying the cache.
        """
        free = self.pool.num_free * self.layout.bytes_per_sector
        for a in self.allocators:
            free += (a.num_free_owned + a.num_demotable) * self.layout.bytes_per_block(a.index)
        return free / (self.pool.num_sectors * self.layout.bytes_per_sector)

    def obtainable_blocks(self, group: int) -> int:
        a = self.allocators[group]
        return a.num_free_owned + a.num_demotable + self.pool.num_free * a.blocks_per_sector

    def release_empty_sectors(self) -> None:
        """Return wholly free sectors to the pool so another group can take them (only matters for hybrids)."""
        if len(self.allocators) > 1:
            for a in self.allocators:
                a.release_empty_sectors()

    # ------------------------------------------------------------------------------------------ prefix
    def _chain(self, req: Request, n_blocks: int) -> list[int]:
        """Hashes of the request's first `n_blocks` full blocks (cached per request, extended lazily)."""
        chain = self._chains.setdefault(req.request_id, [])
        p = self.page_size
        while len(chain) < n_blocks:
            j = len(chain)
            parent = chain[-1] if chain else None
            chain.append(block_hash(parent, req.token_ids(j * p, (j + 1) * p)))
        return chain

    def match_prefix(self, req: Request) -> PrefixMatch | None:
        """The request's leading blocks found in the prefix index (at least one token is always left to compute).

        Only for a request with no blocks that is not swapped out.
        """
        if not self.sharing or req.swapped or self.full.tables.get(req.request_id):  # type: ignore[union-attr]
            return None
        if getattr(req, "prompt_logprobs", None) is not None:  # it needs the logits of every prompt position
            return None
        known = len(req.prompt_ids) + len(req.output_ids)
        n_max = (known - 1) // self.page_size
        if n_max <= 0:
            return None
        blocks: list[int] = []
        chain = self._chains.setdefault(req.request_id, [])
        p = self.page_size
        for j in range(n_max):
            if j < len(chain):
                h = chain[j]
            else:
                h = block_hash(chain[-1] if chain else None, req.token_ids(j * p, (j + 1) * p))
                chain.append(h)
            b = self.prefix.lookup(h)  # type: ignore[union-attr]
            if b is None:
                break
            blocks.append(b)
        if not blocks:
            return None
        return PrefixMatch(len(blocks) * p, blocks)

    def register_completed(self, req: Request, end: int) -> list[tuple[int, int, int]]:
        """Hash the request's full blocks below token position `end` (its K/V are written).

        A block whose content is already indexed under another block is deduplicated on the spot: the table points
        to the indexed block and the duplicate is freed (transformers' choice).

        Returns:
            (table position, duplicate block, kept block) for each deduplication.
        """
        if not self.sharing:
            return []
        rid = req.request_id
        n_full = end // self.page_size
        start = self._hashed.get(rid, 0)
        if start >= n_full:
            return []  # the hot path: no block completed since the last call
        table = self.full.tables.get(rid)  # type: ignore[union-attr]
        if not table:
            return []
        n_full = min(n_full, len(table))
        if start >= n_full:
            return []
        chain = self._chain(req, n_full)
        dedup = []
        for i in range(start, n_full):
            h = chain[i]
            b = table[i]
            existing = self.prefix.lookup(h)  # type: ignore[union-attr]
            if existing is None:
                if not self.prefix.is_hashed(b):  # type: ignore[union-attr]
                    self.prefix.register(b, h)  # type: ignore[union-attr]
            elif existing != b:
                self.full.replace(rid, i, existing)  # type: ignore[union-attr]
                dedup.append((i, b, existing))
        self._hashed[rid] = n_full
        if self.sink is not None and dedup:
            self.sink("blocks_deduplicated", request_id=rid, pairs=dedup)
        return dedup

    # ------------------------------------------------------------------------------------------ admission
    def _plan(self, req: Request, total_tokens: int, match: PrefixMatch | None):
        rid = req.request_id
        needed, smin, smax, available = [], [], [], []
        claimed = 0
        if match is not None:
            claimed = sum(1 for b in match.blocks if self.full.refcount[b] == 0)  # type: ignore[union-attr]
        for a in self.allocators:
            base = len(match.blocks) if (match is not None and a is self.full) else len(a.table(rid))
            n = max(0, a.blocks_for_tokens(total_tokens) - base)
            demotable = a.num_demotable - (claimed if a is self.full else 0)
            extra = n - a.num_free_owned
            needed.append(n)
            smin.append(ceil_div(max(0, extra - demotable), a.blocks_per_sector))
            smax.append(ceil_div(max(0, extra), a.blocks_per_sector))
            available.append(a.num_free_owned + demotable + self.pool.num_free * a.blocks_per_sector)
        return needed, smin, smax, available

    def blocks_needed(self, req: Request, total_tokens: int, match: PrefixMatch | None = None) -> list[int]:
        """New blocks per group to hold `total_tokens` tokens of the request."""
        return self._plan(req, total_tokens, match)[0]

    def allocate(self, req: Request, total_tokens: int, match: PrefixMatch | None = None) -> Allocation | Shortfall:
        """Make the request's tables cover `total_tokens` tokens, in every group or in none.

        With `match`, the matched blocks start the table (shared, refcount + 1). A swapped-out request gets fresh
        device blocks for its whole table and the (host, device) pairs to restore.

        Returns:
            `Allocation` on success; `Shortfall` (nothing changed) when the blocks cannot be found.
        """
        if match is None and len(self.allocators) == 1 and not req.swapped:
            # Hot path (a growing request, one layer group): same decision as the general path below, which takes
            # owned free blocks, then new sectors, and demotes cached blocks only when sectors run out.
            a = self.allocators[0]
            rid = req.request_id
            t = a.tables.get(rid)
            n = a.blocks_for_tokens(total_tokens) - (len(t) if t else 0)
            if n < 0:
                n = 0
            extra = n - len(a._free)
            sectors = 0 if extra <= 0 else -(-extra // a.blocks_per_sector)
            if sectors <= self.pool.num_free:
                new, dem = a.grow(rid, n, sectors)
                if self.sink is not None:
                    self.sink("blocks_allocated", request_id=rid, new_blocks=[new], demoted=[dem], shared=[],
                              refcounts=[])
                return Allocation([new], [dem], None, None)
        needed, smin, smax, available = self._plan(req, total_tokens, match)
        free_sectors = self.pool.num_free
        if sum(smin) > free_sectors:
            return Shortfall(needed, available)
        spare = free_sectors - sum(smin)
        allot = []
        for lo, hi in zip(smin, smax):
            extra = min(spare, hi - lo)
            spare -= extra
            allot.append(lo + extra)
        rid = req.request_id
        if match is not None:
            self.full.share(rid, match.blocks)  # type: ignore[union-attr]
            self._hashed[rid] = len(match.blocks)
        new_blocks, demoted = [], []
        for a, n, s in zip(self.allocators, needed, allot):
            new, dem = a.grow(rid, n, s)
            new_blocks.append(new)
            demoted.append(dem)
        restored = None
        if req.swapped:
            host_tables = self.swap.tables(rid)  # type: ignore[union-attr]
            restored = []
            for g, a in enumerate(self.allocators):
                dev = a.tables[rid]
                restored.append(list(zip(host_tables[g], dev[: len(host_tables[g])])))
            self._host_release.append(rid)  # released by `flush_host_releases`, after this step's copies
        if self.sink is not None:
            shared = list(match.blocks) if match is not None else []
            self.sink("blocks_allocated", request_id=rid, new_blocks=new_blocks, demoted=demoted, shared=shared,
                      refcounts=[self.full.refcount[b] for b in shared] if shared else [])
        return Allocation(new_blocks, demoted, match, restored)

    # ------------------------------------------------------------------------------------------ release
    def release(self, req: Request) -> tuple[int, int]:
        """Free every device block of the request (hashed ones stay cached) and any host copy.

        Returns:
            (blocks freed, blocks parked in the prefix cache).
        """
        rid = req.request_id
        freed = parked = 0
        per_group = []
        for a in self.allocators:
            f, p = a.release(rid)
            freed += len(f)
            parked += len(p)
            per_group.append((f, p))
        if self.swap is not None and self.swap.holds(rid):
            self.swap.release(rid)
            if rid in self._host_release:
                self._host_release.remove(rid)
        self._hashed.pop(rid, None)
        if self.sink is not None and (freed or parked):
            self.sink("blocks_freed", request_id=rid, per_group=per_group)
        return freed, parked

    def flush_host_releases(self) -> None:
        """Free the host copies of requests restored in the previous step (their copies have been issued).

        Called at the start of every scheduling pass (`Scheduler.schedule`).
        """
        if self._host_release:
            for rid in self._host_release:
                self.swap.release(rid)  # type: ignore[union-attr]
            self._host_release.clear()

    def forget(self, req: Request) -> None:
        """Drop per-request caches once a request is terminal."""
        self._chains.pop(req.request_id, None)
        self._hashed.pop(req.request_id, None)

    # ------------------------------------------------------------------------------------------ offload
    def exclusive_blocks(self, req: Request) -> list[int]:
        """Per group, the blocks that would become free or cached if the request released its tables."""
        rid = req.request_id
        return [sum(1 for b in a.table(rid) if a.refcount[b] == 1) for a in self.allocators]

    def can_swap(self, req: Request) -> bool:
        if self.swap is None:
            return False
        return self.swap.can_fit([len(a.table(req.request_id)) for a in self.allocators])

    def swap_out(self, req: Request) -> SwapOut:
        """Reserve host blocks for the request's device blocks, then free the device blocks.

        The returned pairs must be copied device -> host before any of those device blocks is written again
        (the runner copies at once, before the next forward).

        Raises:
            RuntimeError: when the swap pool cannot hold the request (call `can_swap` first).
        """
        if not self.can_swap(req):
            raise RuntimeError(f"swap pool cannot hold request {req.request_id!r}")
        if self.swap.holds(req.request_id):  # type: ignore[union-attr]
            raise RuntimeError(f"request {req.request_id!r} already holds host blocks")
        rid = req.request_id
        sizes = [len(a.table(rid)) for a in self.allocators]
        host = self.swap.reserve(rid, sizes)  # type: ignore[union-attr]
        pairs = [list(zip(list(a.table(rid)), h)) for a, h in zip(self.allocators, host)]
        for a in self.allocators:
            a.release(rid)
        # Restored blocks are hashed again (and deduplicated) after the request's next step.
        self._hashed[rid] = 0
        if self.sink is not None:
            self.sink("swapped_out", request_id=rid, pairs=pairs)
        return SwapOut(pairs)

    # ------------------------------------------------------------------------------------------ runner data
    def block_tables(self, req: Request) -> list[list[int]]:
        return [a.table(req.request_id) for a in self.allocators]

    def write_slots(self, req: Request, start: int, end: int) -> list[list[int]]:
        """Per group, the slots receiving the K/V of positions [start, end) (-1: the write-padding block)."""
        return [a.write_slots(req.request_id, start, end) for a in self.allocators]

    def kv_groups(self) -> list[KVGroup]:
        """Every layer group's fixed KV geometry (`cbnb.core.plan.KVGroup`: window, padding blocks), plain data."""
        if self._kv_groups is None:
            self._kv_groups = [KVGroup(int(getattr(a, "window", 0) or 0), a.read_padding_block, a.write_padding_block)
                               for a in self.allocators]
        return self._kv_groups

    def geometry(self) -> KVGeometry:
        """The fixed geometry a runner is built from (`cbnb.core.plan.KVGeometry`): page size, layer groups,
        capacity in tokens; plain data, so that no runner reads this manager."""
        return KVGeometry(self.page_size, tuple(self.kv_groups()), self.capacity_tokens)

    def step_kv(self, scheduled: list[Any]) -> StepKV:
        """What the runner needs to know about the KV of a planned step's rows (`cbnb.core.plan.StepKV`), so that it
        never reads this manager: per row and group, the block table, the write slots of a chunk (a one-token row's
        slot follows from its table: `cbnb.core.plan.decode_slot`), and a sliding chunk's earlier window slots."""
        kv = StepKV(self.page_size, self.kv_groups())
        allocs = self.allocators
        rows = kv.rows
        for s in scheduled:
            rid = s.request.request_id
            tables = [a.tables[rid] for a in allocs]
            if s.num_tokens == 1:
                rows[rid] = RowKV(tables)
                continue
            start, end = s.start, s.start + s.num_tokens
            slots = [a.write_slots(rid, start, end) for a in allocs]
            ring = None
            if start > 0 and any(a.attention_type == SLIDING for a in allocs):
                ring = [[a.slot(rid, p) for p in range(*a.read_positions(start))] if a.attention_type == SLIDING
                        else None for a in allocs]
            rows[rid] = RowKV(tables, slots, ring)
        return kv

    def shared_reads(self, scheduled: list[Any]) -> list[int]:
        """Per scheduled row (same order), its past tokens in complete blocks of the full-attention group that an
        earlier row of the step reads too: a shared prefix, read from memory once per layer and then from the CPU's
        caches (what `cbnb.sim.cost` prices apart). [] when nothing is shared. A row whose first block has one owner
        shares nothing (a shared prefix leads the table), so the walk costs only the shared blocks."""
        full, page = self.full, self.page_size
        if not self.sharing or full is None:
            return []
        refcount, tables = full.refcount, full.tables
        seen: set[int] = set()
        out = [0] * len(scheduled)
        for i, s in enumerate(scheduled):
            table = tables.get(s.request.request_id) or ()
            n_past = min(s.start // page, len(table))
            if n_past == 0 or refcount[table[0]] < 2:
                continue
            again = 0
            for b in table[:n_past]:
                if refcount[b] < 2:
                    break
                if b in seen:
                    again += 1
                else:
                    seen.add(b)
            out[i] = again * page
        return out if any(out) else []

    # ------------------------------------------------------------------------------------------ checks
    def check_invariants(self, requests: list[Request] | None = None) -> None:
        """Assert the bookkeeping is consistent (used by tests).

        Raises:
            AssertionError: naming the broken rule.
        """
        pool = self.pool
        assert pool.num_free + sum(1 for o in pool.owner if o >= 0) + pool.num_reserved == pool.total_sectors
        for a in self.allocators:
            counts: dict[int, int] = {}
            for rid, t in a.tables.items():
                for b in t:
                    counts[b] = counts.get(b, 0) + 1
            bps = a.blocks_per_sector
            for b, c in counts.items():
                assert a.refcount[b] == c, f"group {a.index} block {b}: refcount {a.refcount[b]} != owners {c}"
                assert b >= pool.num_reserved * bps, f"reserved block {b} handed out"
                assert pool.owner[b // bps] == a.index, f"block {b} used outside an owned sector"
                assert b not in a._free, f"used block {b} is on the free list"
                if c > 1:
                    assert self.sharing, f"block {b} shared without prefix sharing"
            for b in range(a.total_blocks):
                if b not in counts:
                    assert a.refcount[b] == 0, f"block {b} has refcount {a.refcount[b]} but no owner"
            cached = set(a.prefix.cached) if a.prefix is not None else set()
            assert not (cached & a._free), "a block is both cached and free"
            for b in cached:
                assert a.refcount[b] == 0 and a.prefix.is_hashed(b)  # type: ignore[union-attr]
                assert pool.owner[b // bps] == a.index
            owned = len(a._sector_free) * bps
            used = len(counts)
            assert used + len(a._free) + len(cached) == owned, (
                f"group {a.index}: used {used} + free {len(a._free)} + cached {len(cached)} != owned {owned}"
            )
            for s, n in a._sector_free.items():
                assert pool.owner[s] == a.index
                assert n == sum(1 for b in range(s * bps, (s + 1) * bps) if b in a._free)
            assert sum(1 for o in pool.owner if o == a.index) == len(a._sector_free)
        if self.prefix is not None:
            for h, b in self.prefix.block_of.items():
                assert self.prefix.hash_of[b] == h
        if requests is not None:
            for r in requests:
                if r.is_terminal:
                    for a in self.allocators:
                        assert r.request_id not in a.tables, f"terminal {r.request_id} still holds blocks"
                    continue
                for a in self.allocators:
                    n = len(a.table(r.request_id))
                    if r.swapped:
                        assert n == 0, f"swapped {r.request_id} holds device blocks"
                        if a.index < len(self.swap.allocators):  # type: ignore[union-attr]
                            hn = len(self.swap.allocators[a.index].table(r.request_id))  # type: ignore[union-attr]
                            assert hn == a.blocks_for_tokens(r.num_computed), (
                                f"{r.request_id}: host table {hn} != blocks for {r.num_computed} tokens"
                            )
                    else:
                        if self.swap is not None and self.swap.holds(r.request_id):
                            assert r.request_id in self._host_release, f"{r.request_id} holds host blocks"
                        want = a.blocks_for_tokens(r.num_computed)
                        assert n == want, (
                            f"{r.request_id} group {a.index}: table has {n} blocks, {r.num_computed} tokens need {want}"
                        )
        assert UNASSIGNED == -1
