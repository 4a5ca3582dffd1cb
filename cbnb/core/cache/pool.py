"""`CachePool`: the shared pool of sectors that every allocator draws from (torch-free).

The device cache is one byte buffer of ``(num_sectors + num_reserved) * bytes_per_sector`` bytes. The first
`num_reserved` sectors (two on the device, none in the host swap pool) are never handed out: sector 0 holds the
read-padding block (zeros, read by padded attention rows) and sector 1 the write-padding block (where padded or
out-of-window writes land). Sector ids are handed out lowest first so that the page map fills from the start.
"""

from __future__ import annotations

import heapq

__all__ = ["CachePool", "RESERVED", "UNASSIGNED"]

RESERVED = -2
UNASSIGNED = -1


class CachePool:
    """A free list of sectors.

    Args:
        num_sectors: usable sectors (>= 0), not counting the reserved ones.
        num_reserved: leading sectors that are never handed out (2 on the device, 0 in the swap pool).

    Attributes:
        owner: per sector id, the group index that holds it, `UNASSIGNED` (-1) or `RESERVED` (-2).
    """

    def __init__(self, num_sectors: int, num_reserved: int = 2) -> None:
        if num_sectors < 0 or num_reserved < 0:
            raise ValueError(f"num_sectors and num_reserved must be >= 0; got {num_sectors}, {num_reserved}")
        self.num_sectors = num_sectors
        self.num_reserved = num_reserved
        self.total_sectors = num_sectors + num_reserved
        self.owner: list[int] = [RESERVED] * num_reserved + [UNASSIGNED] * num_sectors
        self._free: list[int] = list(range(num_reserved, self.total_sectors))
        heapq.heapify(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def take(self, group: int) -> int:
        """Hand the lowest free sector to `group`.

        Raises:
            RuntimeError: when no sector is free (callers check `num_free` first: admission is all-or-nothing).
        """
        if not self._free:
            raise RuntimeError("CachePool: no free sector (admission should have been refused)")
        s = heapq.heappop(self._free)
        self.owner[s] = group
        return s

    def give_back(self, sector: int) -> None:
        """Return `sector` to the free list.

        Raises:
            ValueError: for a reserved or already free sector.
        """
        if self.owner[sector] < 0:
            raise ValueError(f"sector {sector} is {'reserved' if self.owner[sector] == RESERVED else 'already free'}")
        self.owner[sector] = UNASSIGNED
        heapq.heappush(self._free, sector)
