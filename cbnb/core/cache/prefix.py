"""Prefix index: content hashes of completed full blocks, chained through the parent block (torch-free).

A block's key is ``blake2b(parent_hash as 8 little-endian bytes || its page_size token ids as int32, digest 8)``
(transformers' scheme: the chain makes the key the whole prefix, and blake2b is not salted per process the way
Python's `hash` is). A block that is unreferenced but hashed stays *cached*: it keeps its content and can be claimed
back by a later request with the same prefix without a copy. Cached blocks are demoted to plain free blocks lazily,
one at a time, only when uninitialised blocks run out, in the order of `policy`:

- "transformers": most recently freed first (a finished request's tail first, since its blocks are freed in order);
- "lru": least recently freed first (vLLM's order; a request's blocks are queued tail first).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence

__all__ = ["block_hash", "PrefixIndex"]


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """The chained content hash of one full block (an unsigned 64-bit int)."""
    h = hashlib.blake2b(digest_size=8)
    if parent is not None:
        h.update(parent.to_bytes(8, "little"))
    h.update(array("i", tokens).tobytes())
    return int.from_bytes(h.digest(), "little")


class PrefixIndex:
    """hash -> block, block -> hash, and the ordered set of cached (unreferenced, hashed) blocks."""

    def __init__(self, policy: str = "transformers") -> None:
        if policy not in ("transformers", "lru"):
            raise ValueError(f"prefix eviction policy must be 'transformers' or 'lru'; got {policy!r}")
        self.policy = policy
        self.block_of: dict[int, int] = {}
        self.hash_of: dict[int, int] = {}
        self.cached: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self.hash_of)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def lookup(self, h: int) -> int | None:
        return self.block_of.get(h)

    def register(self, block: int, h: int) -> None:
        if h in self.block_of or block in self.hash_of:
            raise ValueError(f"block {block} or its hash is already registered")
        self.block_of[h] = block
        self.hash_of[block] = h

    def is_hashed(self, block: int) -> bool:
        return block in self.hash_of

    def park(self, blocks_in_release_order: Sequence[int]) -> None:
        """Queue newly unreferenced hashed blocks, given in the order the request's table lists them."""
        if self.policy == "lru":
            # Oldest freed leaves first; within one request the tail goes first so the prefix survives longest.
            for b in reversed(blocks_in_release_order):
                self.cached[b] = None
        else:
            for b in blocks_in_release_order:
                self.cached[b] = None

    def claim(self, block: int) -> None:
        """A cached block is referenced again (a prefix hit): it is no longer demotable."""
        del self.cached[block]

    def demote(self) -> tuple[int, int]:
        """Drop the next cached block's hash (per policy) and return (block, its old hash)."""
        block, _ = self.cached.popitem(last=(self.policy == "transformers"))
        h = self.hash_of.pop(block)
        del self.block_of[h]
        return block, h

    def forget(self, block: int) -> None:
        """Drop a referenced block's hash (used when a block is re-used for other content)."""
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.block_of[h]
