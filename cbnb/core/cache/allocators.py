"""Per-attention-type block allocators over the shared `CachePool` (torch-free).

`FullAttentionCacheAllocator` keeps every token of a request: a request of T tokens holds ``ceil(T / page_size)``
blocks and token position p lives in block ``table[p // page_size]`` at offset ``p % page_size``. It supports
prefix sharing (refcounted blocks, a `PrefixIndex`).

`SlidingAttentionCacheAllocator` keeps only the window: position p lives at ring slot ``r = p % window``, i.e. in
block ``table[r // page_size]`` at offset ``r % page_size``, so a request never holds more than
``ceil(window / page_size)`` blocks and, once the window is full, new tokens overwrite the slot of the token that
just left it (transformers' ring buffer). It supports no sharing.

Slots are allocator-global token indices: ``slot = block * page_size + offset``. The runner maps slot -1 to the
write-padding block.
"""

from __future__ import annotations

import heapq
import math
from typing import Iterable, Sequence

from .layout import FULL, SLIDING, KVLayout, LayerGroup
from .pool import CachePool
from .prefix import PrefixIndex

__all__ = ["BlockAllocator", "FullAttentionCacheAllocator", "SlidingAttentionCacheAllocator", "make_allocator"]


class BlockAllocator:
    """Blocks of one layer group: ownership of sectors, a free set, per-request block tables and refcounts.

    Args:
        group: the layer group this allocator serves.
        layout: the cache geometry.
        pool: the shared sector pool.
    """

    supports_sharing = False
    attention_type = ""

    def __init__(self, group: LayerGroup, layout: KVLayout, pool: CachePool) -> None:
        self.group = group
        self.index = group.index
        self.page_size = layout.page_size
        self.pool = pool
        self.blocks_per_sector = layout.blocks_per_sector(group.index)
        self.total_blocks = pool.total_sectors * self.blocks_per_sector  # block ids, reserved ones included
        self.refcount: list[int] = [0] * self.total_blocks
        self.tables: dict[str, list[int]] = {}
        self.prefix: PrefixIndex | None = None
        self._free_heap: list[int] = []
        self._free: set[int] = set()
        self._sector_free: dict[int, int] = {}
        bps = self.blocks_per_sector
        # The padding blocks: first block of reserved sector 0 (read, zeros) and of sector 1 (write).
        self.read_padding_block = 0 if pool.num_reserved >= 1 else None
        self.write_padding_block = bps if pool.num_reserved >= 2 else None

    # ------------------------------------------------------------------------------------------ capacity
    @property
    def usable_blocks(self) -> int:
        """Blocks this allocator could hold if it owned every usable sector."""
        return self.pool.num_sectors * self.blocks_per_sector

    @property
    def num_free_owned(self) -> int:
        """Uninitialised free blocks in sectors this allocator already owns."""
        return len(self._free)

    @property
    def num_demotable(self) -> int:
        """Cached (unreferenced, hashed) blocks that can be demoted to free on demand."""
        return self.prefix.num_cached if self.prefix is not None else 0

    @property
    def num_used(self) -> int:
        """Referenced blocks."""
        return self.owned_blocks - len(self._free) - self.num_demotable

    @property
    def owned_blocks(self) -> int:
        return len(self._sector_free) * self.blocks_per_sector

    def blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks a request of `num_tokens` tokens holds in this allocator."""
        return math.ceil(num_tokens / self.page_size)

    def table(self, request_id: str) -> list[int]:
        return self.tables.get(request_id, [])

    def covers(self, request_id: str, total_tokens: int) -> bool:
        """Whether the request's table already holds `total_tokens` tokens (no new block needed)."""
        t = self.tables.get(request_id)
        return (len(t) if t else 0) * self.page_size >= total_tokens

    def extra_blocks(self, request_id: str, total_tokens: int) -> int:
        """New blocks needed to hold `total_tokens` tokens of this request."""
        return max(0, self.blocks_for_tokens(total_tokens) - len(self.tables.get(request_id, ())))

    # ------------------------------------------------------------------------------------------ free set
    def _push_free(self, block: int) -> None:
        if block in self._free:
            raise RuntimeError(f"block {block} freed twice")
        self._free.add(block)
        heapq.heappush(self._free_heap, block)
        self._sector_free[block // self.blocks_per_sector] += 1

    def _pop_free(self) -> int:
        while self._free_heap:
            b = heapq.heappop(self._free_heap)
            if b in self._free:
                self._free.remove(b)
                self._sector_free[b // self.blocks_per_sector] -= 1
                return b
        raise RuntimeError("no owned free block")

    def _own_sector(self) -> None:
        s = self.pool.take(self.index)
        self._sector_free[s] = 0
        base = s * self.blocks_per_sector
        for b in range(base, base + self.blocks_per_sector):
            self._push_free(b)

    def release_empty_sectors(self) -> int:
        """Give sectors whose blocks are all free back to the pool. Returns how many."""
        bps = self.blocks_per_sector
        empty = [s for s, n in self._sector_free.items() if n == bps]
        for s in empty:
            for b in range(s * bps, (s + 1) * bps):
                self._free.discard(b)
            del self._sector_free[s]
            self.pool.give_back(s)
        if len(self._free_heap) > 2 * len(self._free) + 64:
            self._free_heap = sorted(self._free)
        return len(empty)

    # ------------------------------------------------------------------------------------------ allocation
    def grow(self, request_id: str, num_blocks: int, max_new_sectors: int) -> tuple[list[int], list[int]]:
        """Append `num_blocks` fresh blocks to the request's table.

        Order: owned free blocks, then up to `max_new_sectors` new sectors, then demoted cached blocks. The caller
        (the cache manager) has already checked that this succeeds.

        Returns:
            (new block ids, block ids demoted from the prefix cache to make room).
        """
        table = self.tables.setdefault(request_id, [])
        new: list[int] = []
        demoted: list[int] = []
        for _ in range(num_blocks):
            if not self._free and max_new_sectors > 0:
                self._own_sector()
                max_new_sectors -= 1
            if self._free:
                b = self._pop_free()
            elif self.prefix is not None and self.prefix.num_cached:
                b, _ = self.prefix.demote()
                demoted.append(b)
            else:
                raise RuntimeError(f"allocator {self.index}: out of blocks (admission should have been refused)")
            self.refcount[b] = 1
            new.append(b)
        table.extend(new)
        return new, demoted

    def share(self, request_id: str, blocks: Sequence[int]) -> None:
        """Reference existing (hashed) blocks at the start of a new request's table (a prefix hit)."""
        table = self.tables.setdefault(request_id, [])
        if table:
            raise RuntimeError("prefix blocks can only start an empty block table")
        for b in blocks:
            if self.refcount[b] == 0:
                self.prefix.claim(b)  # type: ignore[union-attr]
            self.refcount[b] += 1
        table.extend(blocks)

    def release(self, request_id: str) -> tuple[list[int], list[int]]:
        """Drop the request's references.

        Returns:
            (blocks now free, blocks now cached for their content).
        """
        table = self.tables.pop(request_id, None)
        if not table:
            return [], []
        freed: list[int] = []
        parked: list[int] = []
        for b in table:
            self.refcount[b] -= 1
            if self.refcount[b] < 0:
                raise RuntimeError(f"block {b} refcount below zero")
            if self.refcount[b] == 0:
                if self.prefix is not None and self.prefix.is_hashed(b):
                    parked.append(b)
                else:
                    self._push_free(b)
                    freed.append(b)
        if parked:
            self.prefix.park(parked)  # type: ignore[union-attr]
        return freed, parked

    def replace(self, request_id: str, position: int, new_block: int) -> bool:
        """Point the table entry at `position` to `new_block` (prefix dedupe). Returns True if the old block freed."""
        table = self.tables[request_id]
        old = table[position]
        if self.refcount[new_block] == 0:
            self.prefix.claim(new_block)  # type: ignore[union-attr]
        self.refcount[new_block] += 1
        table[position] = new_block
        self.refcount[old] -= 1
        if self.refcount[old] == 0:
            self._push_free(old)
            return True
        return False

    # ------------------------------------------------------------------------------------------ slots
    def slot(self, request_id: str, position: int) -> int:
        """The allocator-global slot of token `position` of the request."""
        raise NotImplementedError

    def write_slots(self, request_id: str, start: int, end: int) -> list[int]:
        """Slots where the K/V of positions [start, end) are written (-1: discard to the write-padding block)."""
        raise NotImplementedError

    # ------------------------------------------------------------------------------------------ state
    def block_states(self) -> dict[str, list[int]]:
        """Block ids by state: reserved, unassigned (sector in the pool), free, cached, used (ref 1), shared."""
        bps = self.blocks_per_sector
        reserved = list(range(self.pool.num_reserved * bps))
        owned = set()
        for s in self._sector_free:
            owned.update(range(s * bps, (s + 1) * bps))
        cached = set(self.prefix.cached) if self.prefix is not None else set()
        used = [b for b in owned if self.refcount[b] == 1]
        shared = [b for b in owned if self.refcount[b] >= 2]
        return {
            "reserved": reserved,
            "unassigned": [b for b in range(len(reserved), self.total_blocks) if b not in owned],
            "free": sorted(self._free),
            "cached": sorted(cached),
            "used": sorted(used),
            "shared": sorted(shared),
        }


class FullAttentionCacheAllocator(BlockAllocator):
    """Full attention: every token kept; supports block sharing (prefix caching)."""

    supports_sharing = True
    attention_type = FULL

    def slot(self, request_id: str, position: int) -> int:
        p = self.page_size
        return self.tables[request_id][position // p] * p + position % p

    def write_slots(self, request_id: str, start: int, end: int) -> list[int]:
        table = self.tables[request_id]
        p = self.page_size
        return [table[pos // p] * p + pos % p for pos in range(start, end)]


class SlidingAttentionCacheAllocator(BlockAllocator):
    """Sliding-window attention: a per-request ring of `window` slots over at most ceil(window / page_size) blocks."""

    supports_sharing = False
    attention_type = SLIDING

    def __init__(self, group: LayerGroup, layout: KVLayout, pool: CachePool) -> None:
        if group.window is None or group.window <= 0:
            raise ValueError(f"sliding group {group.index} needs a positive window; got {group.window!r}")
        super().__init__(group, layout, pool)
        self.window = group.window

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return math.ceil(min(num_tokens, self.window) / self.page_size)

    def covers(self, request_id: str, total_tokens: int) -> bool:
        t = self.tables.get(request_id)
        return (len(t) if t else 0) * self.page_size >= min(total_tokens, self.window)

    def slot(self, request_id: str, position: int) -> int:
        p = self.page_size
        r = position % self.window
        return self.tables[request_id][r // p] * p + r % p

    def write_slots(self, request_id: str, start: int, end: int) -> list[int]:
        # Only the last `window` positions of the chunk are kept; earlier ones would be overwritten in this very
        # chunk, so they go to the write-padding block.
        table = self.tables[request_id]
        p, w = self.page_size, self.window
        first_kept = max(start, end - w)
        out = [-1] * (first_kept - start)
        for pos in range(first_kept, end):
            r = pos % w
            out.append(table[r // p] * p + r % p)
        return out

    def read_positions(self, past: int) -> tuple[int, int]:
        """The cached positions [lo, past) a chunk starting at `past` attends to (the previous window - 1 tokens)."""
        return max(0, past - (self.window - 1)), past


def make_allocator(group: LayerGroup, layout: KVLayout, pool: CachePool) -> BlockAllocator:
    if group.attention_type == FULL:
        return FullAttentionCacheAllocator(group, layout, pool)
    if group.attention_type == SLIDING:
        return SlidingAttentionCacheAllocator(group, layout, pool)
    raise ValueError(f"unsupported attention type {group.attention_type!r}")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def sectors_needed(shortfalls: Iterable[tuple[int, int]]) -> int:
    """Total sectors for (blocks short, blocks per sector) pairs."""
    return sum(ceil_div(max(0, s), bps) for s, bps in shortfalls)
