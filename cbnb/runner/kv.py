"""KV tensors: the device pool, its per-layer page views, the host swap pool, and block copies.

The pool is one uint8 buffer of ``(num_sectors + 2) * bytes_per_sector`` bytes (`cbnb.core.cache.layout` has the
geometry). Layer group g sees it as ``[num_blocks_g, layers_in_g, 2, page_size, num_kv_heads, head_dim]`` in the
cache dtype, so layer l (the i-th of its group) has K pages ``view[:, i, 0]`` and V pages ``view[:, i, 1]``, each
``[num_blocks_g, page_size, num_kv_heads, head_dim]`` (strided: consecutive blocks are `bytes_per_block` apart).

The buffer starts zeroed: padded attention rows read the zero block, and masked slots must hold finite values
(a masked weight of 0 times NaN is NaN). On CPU it is a private anonymous memory map, which the OS backs with
lazily zeroed pages, so resident memory grows only as blocks are used (`_host_zeros` says why neither a shared map
nor huge pages). The price: the first write to each 4 KiB page faults, about 0.1-0.4 s of a cpu-32 run that writes
250 MB of K/V into a fresh cache; an engine that keeps its cache pays it once.
"""

from __future__ import annotations

import mmap
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.cache.layout import KVLayout
from .malloc import tune_malloc

if TYPE_CHECKING:
    from ..core.plan import StepWork

__all__ = ["KVStore"]


def _host_zeros(num_bytes: int) -> torch.Tensor:
    """Lazily zeroed host memory: a private anonymous map, so the pool commits pages only as the cache fills them
    (the default CPU cache is sized from free memory and may span many GB).

    Private, not shared: a shared anonymous map is shmem, whose first-touch faults cost more; with the shared map
    a cpu-32 run (about 250 MB of K/V written into a 943 MB pool) took 8.76 s against 8.59 s (median of 4
    interleaved runs, `python -m cbnb.bench`'s workload, 2026-12-06, the project's EPYC). No huge-page advice:
    faulting 2 MiB pages in lazily (with the kernel's compaction) made the same run 9.37 s.
    """
    if num_bytes <= 0 or not hasattr(mmap, "MAP_PRIVATE"):
        return torch.from_numpy(np.zeros(max(num_bytes, 0), dtype=np.uint8))
    m = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(m, dtype=torch.uint8, count=num_bytes)


def _zeros(num_bytes: int, device: torch.device, pin: bool = False) -> torch.Tensor:
    if device.type == "cpu":
        if pin:
            return torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=True)
        return _host_zeros(num_bytes)
    return torch.zeros(num_bytes, dtype=torch.uint8, device=device)


class KVStore:
    """Device KV pool and optional host swap pool with identical geometry.

    Args:
        layout: cache geometry.
        num_sectors: usable device sectors (2 padding sectors are added).
        device: where the pool lives.
        dtype: cache dtype (the model's dtype).
        swap_sectors: host swap pool sectors (0: none). Pinned when the device is CUDA.

    Attributes:
        k, v: per model layer, the page views ``[num_blocks_g, page_size, num_kv_heads, head_dim]``.
        block_rows: per group, the pool as ``[num_blocks_g, bytes_per_block]`` uint8 (for copies).
    """

    def __init__(self, layout: KVLayout, num_sectors: int, device: torch.device, dtype: torch.dtype,
                 swap_sectors: int = 0) -> None:
        if torch.tensor([], dtype=dtype).element_size() != layout.itemsize:
            raise ValueError(f"layout itemsize {layout.itemsize} does not match dtype {dtype}")
        if device.type == "cpu":
            tune_malloc()
        self.layout = layout
        self.device = device
        self.dtype = dtype
        bps = layout.bytes_per_sector
        self.num_bytes = (num_sectors + 2) * bps
        self.buffer = _zeros(self.num_bytes, device)
        self.k: list[torch.Tensor] = [None] * layout.num_layers  # type: ignore[list-item]
        self.v: list[torch.Tensor] = [None] * layout.num_layers  # type: ignore[list-item]
        self.block_rows: list[torch.Tensor] = []
        self.layer_group: list[tuple[int, int]] = [(-1, -1)] * layout.num_layers
        # The pool as token rows of one layer's K (or V): [total_rows, Hkv * D]. Token `o` of block `b`, layer `i`
        # of group g, K is row `b * rows_per_block[g] + 2 * i * P + o` (V: + P). Writes index it directly.
        self.token_rows = self.buffer.view(dtype).view(-1, layout.num_kv_heads * layout.head_dim)
        self.rows_per_block: list[int] = []
        self.layer_row_offset: list[int] = [0] * layout.num_layers
        P, H, D = layout.page_size, layout.num_kv_heads, layout.head_dim
        for g in layout.groups:
            n = len(g.layers)
            view = self.buffer.view(dtype).view(-1, n, 2, P, H, D)
            for i, layer in enumerate(g.layers):
                self.k[layer] = view[:, i, 0]
                self.v[layer] = view[:, i, 1]
                self.layer_group[layer] = (g.index, i)
                self.layer_row_offset[layer] = 2 * i * P
            self.rows_per_block.append(n * 2 * P)
            self.block_rows.append(self.buffer.view(-1, layout.bytes_per_block(g.index)))
        self.swap_bytes = swap_sectors * bps
        self.host = None
        self.host_rows: list[torch.Tensor] = []
        if swap_sectors > 0:
            self.host = _zeros(self.swap_bytes, torch.device("cpu"), pin=device.type == "cuda")
            for g in layout.groups:
                self.host_rows.append(self.host.view(-1, layout.bytes_per_block(g.index)))

    def run_copies(self, work: StepWork) -> int:
        """A step's offload copies, in the order the core planned them: swap-outs, then restores. Returns bytes."""
        copied = 0
        for _, so in work.swap_outs:
            copied += self.swap_out(so.pairs)
        for _, pairs in work.restores:
            copied += self.swap_in(pairs)
        return copied

    def swap_out(self, pairs: list[list[tuple[int, int]]]) -> int:
        """Copy device blocks to host blocks: per group, (device block, host block) pairs. Returns bytes copied."""
        copied = 0
        for g, gp in enumerate(pairs):
            if not gp:
                continue
            dev = torch.tensor([p[0] for p in gp], dtype=torch.long, device=self.device)
            host = torch.tensor([p[1] for p in gp], dtype=torch.long)
            rows = self.block_rows[g].index_select(0, dev)
            self.host_rows[g].index_copy_(0, host, rows.to("cpu"))
            copied += rows.numel() * rows.element_size()
        return copied

    def swap_in(self, pairs: list[list[tuple[int, int]]]) -> int:
        """Copy host blocks back to device blocks: per group, (host block, device block) pairs. Returns bytes."""
        copied = 0
        for g, gp in enumerate(pairs):
            if not gp:
                continue
            host = torch.tensor([p[0] for p in gp], dtype=torch.long)
            dev = torch.tensor([p[1] for p in gp], dtype=torch.long, device=self.device)
            rows = self.host_rows[g].index_select(0, host)
            if self.device.type == "cuda":
                rows = rows.pin_memory().to(self.device, non_blocking=True)
            self.block_rows[g].index_copy_(0, dev, rows.to(self.device))
            copied += rows.numel() * rows.element_size()
        return copied
