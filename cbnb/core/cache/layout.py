"""KV cache geometry: layer groups, pages, blocks and sectors (torch-free).

Units (same definitions as transformers' paged cache):

- **page**: one layer's K and V for `page_size` tokens:
  ``bytes_per_page = 2 * num_kv_heads * head_dim * itemsize * page_size``.
- **block**: one page per layer of a layer group; the unit a request owns. ``bytes_per_block(g) =
  bytes_per_page * len(g.layers)``.
- **sector**: the unit the shared pool hands to an allocator. ``bytes_per_sector = lcm(bytes_per_block of every
  group, 128)``, so full and sliding blocks tile the same bytes: group g gets ``bytes_per_sector /
  bytes_per_block(g)`` blocks per sector. Block ids are global in each group's block size: block b of group g
  occupies bytes ``[b * bpb(g), (b + 1) * bpb(g))`` of the pool, i.e. it lives in sector ``b // blocks_per_sector``.

Inside a block the layout is ``[layer_in_group, 2 (K, V), page_size, num_kv_heads, head_dim]``.

Layer groups follow transformers' `group_layers_by_attn_type`: with `layer_types`, one group per type
("full_attention", "sliding_attention"; anything else is rejected); without it, all layers are sliding if
`sliding_window` is set, else all are full. Groups are ordered by first appearance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = ["FULL", "SLIDING", "LayerGroup", "KVLayout", "layer_groups", "model_kv_spec"]

FULL = "full_attention"
SLIDING = "sliding_attention"
_SUPPORTED = (FULL, SLIDING)


@dataclass(frozen=True)
class LayerGroup:
    """Layers that share one allocator. `window` is the sliding window in tokens (None for full attention)."""

    index: int
    attention_type: str
    layers: tuple[int, ...]
    window: int | None = None


def layer_groups(num_layers: int, layer_types: Sequence[str] | None = None,
                 sliding_window: int | None = None) -> list[LayerGroup]:
    """Group layers by attention type.

    Raises:
        ValueError: on an unsupported layer type, a length mismatch, or a sliding group without a positive window.
    """
    if layer_types is not None:
        types = list(layer_types)
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries but the model has {num_layers} layers")
    else:
        types = [SLIDING if sliding_window is not None else FULL] * num_layers
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for i, t in enumerate(types):
        if t not in _SUPPORTED:
            raise ValueError(f"layer {i} has attention type {t!r}; cbnb supports {', '.join(_SUPPORTED)}")
        if t not in members:
            order.append(t)
            members[t] = []
        members[t].append(i)
    groups = []
    for gi, t in enumerate(order):
        window = None
        if t == SLIDING:
            if not isinstance(sliding_window, int) or sliding_window <= 0:
                raise ValueError(f"sliding_window must be a positive integer for sliding layers; got {sliding_window!r}")
            window = sliding_window
        groups.append(LayerGroup(gi, t, tuple(members[t]), window))
    return groups


@dataclass(frozen=True)
class KVLayout:
    """The byte geometry of the paged KV cache.

    Args:
        groups: layer groups (see `layer_groups`).
        num_kv_heads: K/V heads per layer.
        head_dim: head dimension (elements).
        itemsize: bytes per element of the cache dtype (4 for float32, 2 for bf16/fp16).
        page_size: tokens per page (>= 4).
    """

    groups: tuple[LayerGroup, ...]
    num_kv_heads: int
    head_dim: int
    itemsize: int
    page_size: int

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def bytes_per_token_per_layer(self) -> int:
        """K and V of one token in one layer (bytes)."""
        return 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_page(self) -> int:
        return self.bytes_per_token_per_layer * self.page_size

    def bytes_per_block(self, group: int) -> int:
        return self.bytes_per_page * len(self.groups[group].layers)

    @property
    def bytes_per_sector(self) -> int:
        v = 128
        for g in self.groups:
            v = math.lcm(v, self.bytes_per_block(g.index))
        return v

    def blocks_per_sector(self, group: int) -> int:
        return self.bytes_per_sector // self.bytes_per_block(group)

    @property
    def bytes_per_whole_model_block(self) -> int:
        """One page for every layer of the model (transformers' unit for `num_blocks`)."""
        return self.bytes_per_page * self.num_layers

    def sectors_for_blocks(self, num_blocks: int) -> int:
        """Sectors holding `num_blocks` whole-model blocks, rounded up (at least 1): transformers' rule."""
        return max(1, math.ceil(num_blocks * self.bytes_per_whole_model_block / self.bytes_per_sector))

    def whole_model_blocks(self, num_sectors: int) -> int:
        """How many whole-model blocks `num_sectors` sectors hold (rounded down)."""
        return num_sectors * self.bytes_per_sector // self.bytes_per_whole_model_block

    @property
    def supports_sharing(self) -> bool:
        """Prefix sharing needs every group to be full attention."""
        return all(g.attention_type == FULL for g in self.groups)

    @property
    def max_window(self) -> int | None:
        """The sliding window when the model is purely sliding, else None (caps KV reads)."""
        if all(g.attention_type == SLIDING for g in self.groups):
            return max(g.window for g in self.groups if g.window is not None)
        return None


def model_kv_spec(config: Any) -> dict[str, Any]:
    """Extract what the KV layout needs from a transformers model config (duck-typed, no torch).

    Returns:
        dict with num_layers, layer_types (or None), sliding_window (or None), num_kv_heads, head_dim,
        num_heads, hidden_size, vocab_size, max_position_embeddings.
    """
    text = getattr(config, "text_config", None) or config
    num_layers = int(text.num_hidden_layers)
    num_heads = int(text.num_attention_heads)
    num_kv = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    layer_types = getattr(text, "layer_types", None)
    sliding_window = getattr(text, "sliding_window", None)
    if layer_types is not None and SLIDING not in layer_types:
        sliding_window = None  # e.g. Qwen3 keeps a sliding_window value but uses it on no layer
    if layer_types is None and getattr(text, "use_sliding_window", True) is False:
        sliding_window = None
    return {
        "num_layers": num_layers,
        "layer_types": list(layer_types) if layer_types is not None else None,
        "sliding_window": int(sliding_window) if sliding_window else None,
        "num_kv_heads": num_kv,
        "head_dim": int(head_dim),
        "num_heads": num_heads,
        "hidden_size": int(text.hidden_size),
        "vocab_size": int(text.vocab_size),
        "max_position_embeddings": int(getattr(text, "max_position_embeddings", 0) or 0) or None,
    }


def layout_for(spec: dict[str, Any], itemsize: int, page_size: int) -> KVLayout:
    """A `KVLayout` from `model_kv_spec` output."""
    groups = layer_groups(spec["num_layers"], spec["layer_types"], spec["sliding_window"])
    return KVLayout(tuple(groups), spec["num_kv_heads"], spec["head_dim"], itemsize, page_size)
