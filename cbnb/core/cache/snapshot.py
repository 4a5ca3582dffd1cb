"""KV page map snapshots and cache usage figures (torch-free, NumPy).

`kv_snapshot` turns the cache manager's bookkeeping into flat arrays, one entry per block of each layer group:
state, refcount, owner request, tokens filled. The first blocks of every group are *reserved*: the read-padding
and write-padding blocks (`padding_blocks`), never handed to a request, so a cache of ``num_blocks=64`` shows
64 usable blocks + 2 reserved (``repr(snapshot)``, `GroupSnapshot.usable_blocks`, `reserved_blocks`). It is vectorised so that 100,000 blocks take a few milliseconds
(cheap enough for a 10 Hz display). Take it while the engine is not mutating the cache (the engine's
`snapshot()` holds its state lock).

KV usage is reported two ways, both in [0, 1] of the cache bytes: *by blocks* (blocks referenced by requests) and
*by tokens* (token slots actually filled in those blocks). Their difference is page fragmentation: the unfilled
tails of partially used pages, which shrinks with a smaller `page_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from .manager import CacheManager
from .pool import RESERVED

__all__ = ["BlockState", "GroupSnapshot", "KVSnapshot", "kv_snapshot", "kv_usage"]


class BlockState:
    """Block state codes used in snapshots (uint8)."""

    FREE = 0  # free (never handed to this group, or handed back and unused)
    ALLOCATED = 1  # referenced by one request
    SHARED = 2  # referenced by several requests (prefix sharing)
    CACHED = 3  # unreferenced, kept for its content (prefix cache)
    RESERVED = 4  # a padding block (never handed out)
    OTHER_GROUP = 5  # these bytes belong to another layer group's sector
    NAMES = ("free", "allocated", "shared", "cached", "reserved", "other_group")


@dataclass
class GroupSnapshot:
    """One layer group's page map (arrays of length `num_blocks`)."""

    index: int
    attention_type: str
    page_size: int
    num_layers: int
    blocks_per_sector: int
    state: np.ndarray  # uint8 BlockState codes
    refcount: np.ndarray  # int32
    owner: np.ndarray  # int32 index into KVSnapshot.request_ids, -1 when none (first owner if shared)
    tokens: np.ndarray  # int32 token slots filled
    padding_blocks: tuple[int, ...] = ()
    shared_owners: dict[int, list[int]] = field(default_factory=dict)  # block -> owner indices (refcount >= 2)

    @property
    def num_blocks(self) -> int:
        """Blocks in the arrays, the reserved padding ones included."""
        return int(self.state.shape[0])

    @property
    def reserved_blocks(self) -> int:
        """Blocks of the reserved padding area (never handed to a request)."""
        return int(np.count_nonzero(self.state == BlockState.RESERVED))

    @property
    def usable_blocks(self) -> int:
        """Blocks requests can hold: `num_blocks` minus the reserved ones."""
        return self.num_blocks - self.reserved_blocks

    def counts(self) -> dict[str, int]:
        c = np.bincount(self.state, minlength=len(BlockState.NAMES))
        return {name: int(c[i]) for i, name in enumerate(BlockState.NAMES)}

    def describe(self) -> str:
        """E.g. "group 0 (full_attention, page 16 tokens): 64 blocks + 2 reserved padding, 3 allocated"."""
        c = self.counts()
        used = ", ".join(f"{c[k]} {k}" for k in ("allocated", "shared", "cached") if c[k])
        return (f"group {self.index} ({self.attention_type}, page {self.page_size} tokens): {self.usable_blocks} "
                f"blocks + {self.reserved_blocks} reserved padding" + (f", {used}" if used else ""))

    def __repr__(self) -> str:
        return f"GroupSnapshot({self.describe()})"


@dataclass(repr=False)
class KVSnapshot:
    """The page map of every layer group plus the request ids the owner indices refer to."""

    groups: list[GroupSnapshot]
    request_ids: list[str]
    num_sectors: int  # the pool's allocation units (internal geometry; blocks are what users see)
    bytes_per_sector: int

    def __repr__(self) -> str:
        return f"KVSnapshot({'; '.join(g.describe() for g in self.groups)}; {len(self.request_ids)} requests)"


def _fill(tokens: int, n_blocks: int, page: int) -> np.ndarray:
    """Tokens held by each of `n_blocks` consecutive pages filled in order with `tokens` tokens."""
    starts = np.arange(n_blocks, dtype=np.int64) * page
    return np.clip(tokens - starts, 0, page).astype(np.int32)


def kv_snapshot(cache: CacheManager, computed: Mapping[str, int]) -> KVSnapshot:
    """Snapshot every group's blocks.

    Args:
        cache: the cache manager.
        computed: request_id -> tokens whose K/V is written (`Request.num_computed`), for the fill counts.
    """
    pool_owner = np.asarray(cache.pool.owner, dtype=np.int64)
    request_ids: list[str] = []
    index: dict[str, int] = {}
    groups = []
    for a in cache.allocators:
        bps = a.blocks_per_sector
        sector_of = np.repeat(pool_owner, bps)
        n = a.total_blocks
        rc = np.asarray(a.refcount, dtype=np.int32)
        state = np.full(n, BlockState.FREE, dtype=np.uint8)
        state[sector_of == RESERVED] = BlockState.RESERVED
        state[(sector_of >= 0) & (sector_of != a.index)] = BlockState.OTHER_GROUP
        mine = sector_of == a.index
        state[mine & (rc == 1)] = BlockState.ALLOCATED
        state[mine & (rc >= 2)] = BlockState.SHARED
        if a.prefix is not None and a.prefix.num_cached:
            state[np.fromiter(a.prefix.cached, dtype=np.int64, count=a.prefix.num_cached)] = BlockState.CACHED
        owner = np.full(n, -1, dtype=np.int32)
        tokens = np.zeros(n, dtype=np.int32)
        if a.prefix is not None and a.prefix.num_cached:
            tokens[state == BlockState.CACHED] = a.page_size
        window = getattr(a, "window", None)
        for rid, table in a.tables.items():
            if not table:
                continue
            i = index.get(rid)
            if i is None:
                i = index[rid] = len(request_ids)
                request_ids.append(rid)
            t = np.asarray(table, dtype=np.int64)
            free_slot = owner[t] < 0
            owner[t[free_slot]] = i
            held = computed.get(rid, 0)
            if window is not None:
                held = min(held, window)
            tokens[t] = np.maximum(tokens[t], _fill(held, len(t), a.page_size))
        shared_owners: dict[int, list[int]] = {}
        if (state == BlockState.SHARED).any():
            shared = set(np.flatnonzero(state == BlockState.SHARED).tolist())
            for rid, table in a.tables.items():
                for b in table:
                    if b in shared:
                        shared_owners.setdefault(b, []).append(index[rid])
        pads = tuple(b for b in (a.read_padding_block, a.write_padding_block) if b is not None)
        groups.append(GroupSnapshot(a.index, a.attention_type, a.page_size, len(a.group.layers), bps, state, rc,
                                    owner, tokens, pads, shared_owners))
    return KVSnapshot(groups, request_ids, cache.pool.num_sectors, cache.layout.bytes_per_sector)


def kv_usage(cache: CacheManager, computed: Mapping[str, int]) -> dict[str, float]:
    """KV usage of the cache, as fractions of its usable bytes.

    Returns:
        {"blocks_frac": referenced blocks, "tokens_frac": filled token slots in them, "fragmentation_frac": the
        difference, "cached_frac": cached prefix blocks}. Shared blocks count once.
    """
    lay = cache.layout
    total = cache.pool.num_sectors * lay.bytes_per_sector
    used_b = used_t = cached_b = 0.0
    for a in cache.allocators:
        bpb = lay.bytes_per_block(a.index)
        per_token = bpb / a.page_size
        used_b += a.num_used * bpb
        cached_b += a.num_demotable * bpb
        window = getattr(a, "window", None)
        filled = 0
        for rid, table in a.tables.items():
            held = computed.get(rid, 0)
            if window is not None:
                held = min(held, window)
            filled += min(held, len(table) * a.page_size)
        if a.prefix is not None:
            # A block shared by k requests was counted k times above; shared blocks are always full.
            extra = sum(len(t) for t in a.tables.values()) - a.num_used
            filled -= extra * a.page_size
        used_t += filled * per_token
    return {
        "blocks_frac": used_b / total if total else 0.0,
        "tokens_frac": used_t / total if total else 0.0,
        "fragmentation_frac": (used_b - used_t) / total if total else 0.0,
        "cached_frac": cached_b / total if total else 0.0,
    }

