"""Host swap pool bookkeeping: where offloaded requests' blocks wait (torch-free).

Same geometry as the device cache (same sectors, same per-group block sizes) with no reserved sectors, so a device
block copies to a host block byte for byte. The copying itself is the runner's (`cbnb.runner.kv`); this only decides
which host block receives which device block.
"""

from __future__ import annotations

from .allocators import BlockAllocator, ceil_div
from .layout import KVLayout
from .pool import CachePool

__all__ = ["HostSwapPool"]


class HostSwapPool:
    """Host blocks per layer group, drawn from a `CachePool` of `num_sectors` sectors (none reserved)."""

    def __init__(self, layout: KVLayout, num_sectors: int) -> None:
        self.layout = layout
        self.pool = CachePool(num_sectors, num_reserved=0)
        self.allocators = [BlockAllocator(g, layout, self.pool) for g in layout.groups]

    @property
    def num_sectors(self) -> int:
        return self.pool.num_sectors

    @property
    def num_bytes(self) -> int:
        return self.pool.num_sectors * self.layout.bytes_per_sector

    def holds(self, request_id: str) -> bool:
        return any(request_id in a.tables for a in self.allocators)

    def can_fit(self, sizes: list[int]) -> bool:
        """Whether blocks `sizes[g]` for every group fit at once."""
        self._tidy()
        sectors = sum(
            ceil_div(max(0, n - a.num_free_owned), a.blocks_per_sector) for n, a in zip(sizes, self.allocators)
        )
        return sectors <= self.pool.num_free

    def reserve(self, request_id: str, sizes: list[int]) -> list[list[int]]:
        """Take host blocks for the request (check `can_fit` first). Returns the host block ids per group."""
        out = []
        for n, a in zip(sizes, self.allocators):
            short = max(0, n - a.num_free_owned)
            new, _ = a.grow(request_id, n, ceil_div(short, a.blocks_per_sector))
            out.append(new)
        return out

    def tables(self, request_id: str) -> list[list[int]]:
        return [list(a.table(request_id)) for a in self.allocators]

    def release(self, request_id: str) -> None:
        for a in self.allocators:
            a.release(request_id)

    def _tidy(self) -> None:
        if len(self.allocators) > 1:
            for a in self.allocators:
                a.release_empty_sectors()
