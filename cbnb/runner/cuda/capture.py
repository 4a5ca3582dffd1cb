"""Which shapes the CUDA runner plans and captures: `shape_planner` sizes the `ShapePlanner` from a resolved config
(padding intervals, batch limits, the KV cap: the cache's capacity for full-attention groups and the model's
maximum positions, rounded up to whole pages), and `StartupCaptures` (a base of `CudaModelRunner`) captures
transformers' warm-up set of shapes before the first step, with neutral metadata only."""

from __future__ import annotations

from typing import Any

import torch

from .graphs import ShapePlanner, StepShape, cdiv, maybe_stream
from .triton_attention import num_decode_splits

__all__ = ["shape_planner", "StartupCaptures"]


def shape_planner(config: Any, model: Any, windows: list[int], capacity_tokens: int, page_size: int,
                  num_kv_heads: int, num_sms: int, block_m: int) -> ShapePlanner:
    """The step shapes of a runner configured with `config` (a resolved `ContinuousBatchingConfig`) for `model`,
    whose layer groups have `windows` (0: full attention) over a cache of `capacity_tokens` tokens in pages of
    `page_size`; `num_sms` and `block_m` (the prefill kernel's query tile) size the decode splits and tiles."""
    max_pos = model.config.get_text_config().max_position_embeddings if hasattr(
        model.config, "get_text_config") else getattr(model.config, "max_position_embeddings", None)
    caps = []
    if any(w == 0 for w in windows):
        caps.append(capacity_tokens)
    if max_pos:
        caps.append(int(max_pos))
    kv_cap = min(caps) if caps else 1 << 30
    kv_cap = cdiv(kv_cap, page_size) * page_size
    return ShapePlanner(q_interval=config.q_padding_interval_size or 64,
                        kv_interval=config.kv_padding_interval_size or 16384,
                        max_tokens=int(config.max_batch_tokens), max_seqs=int(config.max_requests_per_batch),
                        kv_cap=kv_cap, page_size=page_size, windows=windows, num_kv_heads=num_kv_heads,
                        num_sms=num_sms, block_m=block_m, split_fn=num_decode_splits)


class StartupCaptures:
    """The start-up captures of a `CudaModelRunner` (its planner, pairs, graphs and forward are the runner's)."""

    def preset_shapes(self, max_decode: int | None = None) -> list[StepShape]:
        """The shapes captured at start-up (transformers' warm-up set): decode steps of 1, 2, 4, ... requests up to
        ``max_requests_per_batch`` (or `max_decode`), and a full varlen step, all at the first KV bucket."""
        if not self.configured:
            raise RuntimeError("configure() first")
        pl = self.planner
        kv = min(pl.kv_interval, pl.kv_cap)
        out = []
        if self.graph_decode:
            top = min(pl.max_seqs, max_decode or pl.max_seqs)
            n = 1
            while True:
                out.append(pl.plan(num_tokens=n, num_seqs=n, max_kv=kv, decode_only=True, pad=True))
                if n >= top:
                    break
                n = min(2 * n, top)
        if self.graph_varlen:
            out.append(pl.plan(num_tokens=pl.max_tokens, num_seqs=1, max_kv=kv, decode_only=False, pad=True))
        return out

    @torch.inference_mode()
    def capture_presets(self, max_decode: int | None = None) -> int:
        """Capture the `preset_shapes` for every IO pair before the first step (so captures do not stall serving).
        Uses neutral metadata only: the real cache is never touched. Returns the number of graphs captured."""
        n = 0
        was_active = self._previous_impl is not None
        if not was_active:
            self.activate()  # the captured forward must route attention through "cbnb_cuda"
        try:
            n = self._capture_presets(max_decode)
        finally:
            if not was_active:
                self.deactivate()
        return n

    def _capture_presets(self, max_decode: int | None) -> int:
        n = 0
        with maybe_stream(self.compute_stream):
            for pair in self.pairs:
                for shape in self.preset_shapes(max_decode):
                    lay = self._layout(shape)
                    key = (pair.index,) + shape.key
                    if key in self.graphs:
                        continue
                    lay.fill_defaults(pair.host_np, self.trash)  # what `_warmup` restores: neutral as well
                    if self.graph_capture(key, pair, shape, lay):
                        n += 1
                        self._pending_captures.append(key)
                    self._pending_failures.extend(self.graphs.take_failures())
        if self.compute_stream is not None:
            self.compute_stream.synchronize()
        return n
