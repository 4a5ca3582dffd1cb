"""KV tensors: the device pool, its per-layer page views, the host swap pool, and block copies.

The pool is one uint8 buffer of ``(num_sectors + 2) * bytes_per_sector`` bytes (`cbnb.core.cache.layout` has the
geometry). Layer group g sees it as ``[num_blocks_g, layers_in_g, 2, page_size, num_kv_heads, head_dim]`` in the
cache dtype, so layer l (the i-th of its group) has K pages ``view[:, i, 0]`` and V pages ``view[:, i, 1]``, each
``[num_blocks_g, page_size, num_kv_heads, head_dim]`` (strided: consecutive blocks are `bytes_per_block` apart).

The buffer starts zeroed: padded attention rows read the zero block, and masked slots must hold finite values
(a masked weight of 0 times NaN is NaN). On CPU it is an anonymous memory map, which the OS backs with lazily
zeroed pages, so resident memory grows only as blocks are used; it asks for transparent huge pages
(``MADV_HUGEPAGE``, 2 MiB), because the first write to each 4 KiB page faults: on cpu-32 (about 250 MB of K/V
written per run) the faults made the K/V writes about 7x slower than writes into touched memory.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..core.cache.layout import KVLayout
from .malloc import tune_malloc

if TYPE_CHECKING:
    from ..core.plan import StepWork

__all__ = ["KVStore"]


_HUGE = 2 << 20


def _host_zeros(num_bytes: int) -> torch.Tensor:
    """Lazily zeroed host memory: an anonymous map, 2 MiB-aligned and advised to use huge pages where supported."""
    if num_bytes <= 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.from_numpy(np.zeros(max(num_bytes, 0), dtype=np.uint8))
    m = mmap.mmap(-1, num_bytes + _HUGE)
    start = ctypes.addressof(ctypes.c_char.from_buffer(m))
    offset = -start % _HUGE
    with contextlib.suppress(OSError):  # a kernel without THP: plain pages
        m.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(m, dtype=torch.uint8, count=num_bytes, offset=offset)


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
