"""Cache sizing: how many sectors fit in memory, and where the bytes go (torch-free arithmetic).

Adapted from transformers' `PagedAttentionMemoryHandler` (5.24, `generation/continuous_batching/cache.py`) to
cbnb's backends, which build no attention masks and keep no read-index buffers:

    available = free_bytes * max_memory_percent
    per batch token  = a * (3 * hidden + H * d + 4 * Hkv * d + 3 * intermediate)   # activations of one token
    per cache token  = K/V of all layers (the cache itself)
                     + 2 * Hkv * d * a                                              # one layer's K/V gathered
    logits           = max_requests_per_batch * vocab * 4                           # fp32 rows that sample
    cuda_graphs      = (pairs + 1) * R * vocab * a + G * per_batch_token            # with CUDA graphs, else 0
    fixed            = 2 * bytes_per_sector (the two padding sectors) + logits + cuda_graphs
    num_sectors      = floor((available - fixed - M * per_batch_token) / per_sector)
    per_sector       = bytes_per_sector + tokens_per_sector * (2 * Hkv * d * a)

`a` is the activation/cache itemsize, `M` = `max_batch_tokens`. An explicit `num_blocks` is honoured: it is
converted to sectors with transformers' rule (`num_blocks * num_layers * bytes_per_page`, rounded up to whole
sectors) and only refused when the footprint exceeds *all* free memory (not just the percentage).

CUDA graphs (`graph_bytes`; cbnb's CUDA runner, `cbnb.runner.cuda.cuda_runner`): every graph of an IO pair writes its
kept logits rows into that pair's one static buffer (`R` = `max_requests_per_batch` rows in the model dtype, one per
pair: 2 with async batching), and all graphs share one private memory pool, which holds the largest graph's
activations (`G` = `max_batch_tokens` tokens with varlen graphs, else `R`) and its transient logits (`R` rows) apart
from the eager path's memory. For Qwen3-0.6B in bf16 with the presets (R = 1024, M = 8192, 2 pairs) that is 1.24 GB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .layout import KVLayout, layout_for

__all__ = ["MemoryPlan", "graph_bytes", "plan_cache", "plan_memory", "swap_sectors"]

GiB = 1 << 30


@dataclass
class MemoryPlan:
    """The resolved cache size and the memory split (bytes).

    Attributes:
        num_sectors: usable device sectors (the 2 padding sectors are extra).
        num_blocks: whole-model blocks those sectors hold (what `engine.config.num_blocks` reports).
        cache_bytes: the KV pool, padding sectors included.
        activation_bytes: peak activations for `max_batch_tokens` query tokens plus one layer's gathered K/V.
        logits_bytes: fp32 logits for `max_requests_per_batch` rows.
        graph_bytes: what CUDA graphs hold beyond that (static logits buffers and the graph pool; 0 without).
        weight_bytes: the model's parameters and buffers.
        packed_weight_bytes: the CPU runner's packed copies of the linear weights (`cbnb.runner.cpu.cpu_linear`; 0
            elsewhere), set aside before sizing.
        free_bytes: free memory measured before sizing.
        budget_bytes: `free_bytes * max_memory_percent`.
        capacity_tokens: tokens the largest layer group can hold.
        explicit: True when `num_blocks` came from the config.
    """

    num_sectors: int
    num_blocks: int
    cache_bytes: int
    activation_bytes: int
    logits_bytes: int
    weight_bytes: int
    free_bytes: int
    budget_bytes: int
    capacity_tokens: int
    explicit: bool
    graph_bytes: int = 0
    packed_weight_bytes: int = 0

    def split(self) -> dict[str, int]:
        """{"weights", "packed_weights", "kv_cache", "activations", "logits", "cuda_graphs"} in bytes."""
        return {"weights": self.weight_bytes, "packed_weights": self.packed_weight_bytes, "kv_cache": self.cache_bytes,
                "activations": self.activation_bytes, "logits": self.logits_bytes, "cuda_graphs": self.graph_bytes}


def _per_batch_token(spec: dict[str, Any], itemsize: int) -> int:
    h, H, Hkv, d = spec["hidden_size"], spec["num_heads"], spec["num_kv_heads"], spec["head_dim"]
    inter = spec.get("intermediate_size") or 4 * h
    return itemsize * (3 * h + H * d + 4 * Hkv * d + 3 * inter)


def graph_bytes(spec: dict[str, Any], itemsize: int, *, max_batch_tokens: int, max_requests_per_batch: int,
                cuda_graphs: tuple[bool, bool], io_pairs: int) -> int:
    """Bytes CUDA graphs hold beyond the eager path (see the module docstring for the formula).

    Args:
        spec: `model_kv_spec(...)` output (vocab_size, sizes of the activations).
        itemsize: bytes per element of the model's activations and logits.
        max_batch_tokens, max_requests_per_batch: the resolved config values.
        cuda_graphs: (varlen, decode) graphs in use; (False, False) gives 0.
        io_pairs: IO pairs (2 with async batching, else 1), each with its static logits buffer.
    """
    varlen, decode = bool(cuda_graphs[0]), bool(cuda_graphs[1])
    if not (varlen or decode):
        return 0
    rows = max_requests_per_batch
    logits_rows = (io_pairs + 1) * rows  # one static buffer per pair + the pool's transient copy
    pool_tokens = max_batch_tokens if varlen else rows
    return logits_rows * spec["vocab_size"] * itemsize + pool_tokens * _per_batch_token(spec, itemsize)


def plan_cache(
    layout: KVLayout,
    spec: dict[str, Any],
    *,
    max_batch_tokens: int,
    max_requests_per_batch: int,
    max_memory_percent: float,
    free_bytes: int,
    weight_bytes: int = 0,
    packed_weight_bytes: int = 0,
    num_blocks: int | None = None,
    cuda_graphs: tuple[bool, bool] = (False, False),
    io_pairs: int = 1,
) -> MemoryPlan:
    """Size the KV cache.

    Args:
        layout: the cache geometry.
        spec: `model_kv_spec(...)` output, plus optional "intermediate_size".
        max_batch_tokens: M, query tokens per step.
        max_requests_per_batch: rows whose logits are kept per step.
        max_memory_percent: share of `free_bytes` the engine may use (0, 1].
        free_bytes: free device memory (CUDA: `mem_get_info` free; CPU: available RAM), bytes.
        weight_bytes: already-loaded model bytes (reported only; they are not in `free_bytes`).
        packed_weight_bytes: the runner's packed weight copies (reported only: the caller takes what is not
            allocated yet out of `free_bytes`).
        num_blocks: explicit size in whole-model blocks, or None to infer.
        cuda_graphs, io_pairs: the CUDA graphs in use and the IO pairs (see `graph_bytes`).

    Raises:
        MemoryError: when not even one sector fits, or an explicit size exceeds all free memory.
    """
    a = layout.itemsize
    bps = layout.bytes_per_sector
    tokens_per_sector = max(layout.blocks_per_sector(g.index) * layout.page_size for g in layout.groups)
    gathered_per_token = layout.bytes_per_token_per_layer  # one layer's K/V read back, per cache token
    per_sector = bps + tokens_per_sector * gathered_per_token
    act = max_batch_tokens * _per_batch_token(spec, a)
    logits = max_requests_per_batch * spec["vocab_size"] * 4
    graphs = graph_bytes(spec, a, max_batch_tokens=max_batch_tokens, max_requests_per_batch=max_requests_per_batch,
                         cuda_graphs=cuda_graphs, io_pairs=io_pairs)
    fixed = 2 * bps + logits + graphs
    budget = int(free_bytes * max_memory_percent)
    if num_blocks is not None:
        sectors = layout.sectors_for_blocks(num_blocks)
        footprint = fixed + act + sectors * per_sector
        if footprint > free_bytes:
            raise MemoryError(
                f"num_blocks={num_blocks} needs {footprint / GiB:.2f} GiB (KV {sectors * bps / GiB:.2f} GiB + "
                f"activations + logits{' + CUDA graphs' if graphs else ''}) but only {free_bytes / GiB:.2f} GiB is "
                "free"
            )
        explicit = True
    else:
        sectors = (budget - fixed - act) // per_sector
        if sectors < 1:
            raise MemoryError(
                f"no room for the KV cache: {budget / GiB:.2f} GiB budget (max_memory_percent="
                f"{max_memory_percent}) minus {act / GiB:.2f} GiB activations for max_batch_tokens="
                f"{max_batch_tokens}, {logits / GiB:.2f} GiB logits and {graphs / GiB:.2f} GiB for CUDA graphs "
                "leaves no room for one block of every layer group "
                f"({bps} bytes); lower max_batch_tokens or page_size, or set num_blocks"
            )
        explicit = False
    sectors = int(sectors)
    capacity = max(layout.page_size * sectors * layout.blocks_per_sector(g.index) for g in layout.groups)
    return MemoryPlan(
        num_sectors=sectors,
        num_blocks=layout.whole_model_blocks(sectors),
        cache_bytes=(sectors + 2) * bps,
        activation_bytes=act + tokens_per_sector * gathered_per_token * sectors,
        logits_bytes=logits,
        weight_bytes=weight_bytes,
        packed_weight_bytes=packed_weight_bytes,
        free_bytes=free_bytes,
        budget_bytes=budget,
        capacity_tokens=capacity,
        explicit=explicit,
        graph_bytes=graphs,
    )


def swap_sectors(layout: KVLayout, cpu_offload_space_gib: float | None, safety_threshold: float,
                 available_host_bytes: int) -> int:
    """Host swap pool size in sectors: `cpu_offload_space` GiB, clamped to `threshold * available` host RAM.

    None means "as much as the threshold allows" (transformers' rule); 0 disables the pool.
    """
    cap = int(safety_threshold * available_host_bytes)
    if cpu_offload_space_gib is None:
        want = cap
    else:
        want = min(int(cpu_offload_space_gib * GiB), cap)
    return max(0, want // layout.bytes_per_sector) if want > 0 else 0


def plan_memory(config: Any, spec: dict[str, Any], itemsize: int, *, device_type: str, free_bytes: int,
                weight_bytes: int, host_available_bytes: int | Callable[[], int],
                cuda_graphs_supported: bool | None = None,
                packed_weight_bytes: int = 0) -> tuple[Any, KVLayout, MemoryPlan, int]:
    """Resolve a config for a device and size its cache and swap pool, allocating nothing (torch-free).

    The one sizing path: `cbnb.engine.build.EngineBuilder` (hence `cbnb.Engine.plan_memory`) runs it with measured free
    memory; `cbnb.sim.SimEngine` runs it with a hardware profile's figures. CUDA-graph memory is counted when the
    resolved config uses graphs (`resolve` turns them off where the backend cannot capture them), with two IO pairs
    under async batching (see `graph_bytes`).

    Args:
        config: a `ContinuousBatchingConfig` (not modified).
        spec: `model_kv_spec(...)` output plus "intermediate_size".
        itemsize: bytes per KV element.
        device_type: "cpu", "cuda", ... (for `ContinuousBatchingConfig.resolve`).
        free_bytes: device memory free once the weights are loaded.
        weight_bytes: the weights' bytes (reported in the plan).
        host_available_bytes: host RAM available (clamps the swap pool), or a function returning it (only called
            when the config asks for a swap pool).
        cuda_graphs_supported: whether the backend can capture CUDA graphs (None: on "cuda" only).
        packed_weight_bytes: the CPU runner's packed weight copies (reported; see `plan_cache`).

    Returns:
        (resolved config with num_blocks filled in, the layout, the memory plan, host swap sectors).

    Raises:
        ValueError: an invalid page size or layer layout. MemoryError: as `plan_cache`.
    """
    r = config.resolve(device_type, cuda_graphs_supported=cuda_graphs_supported)
    layout = layout_for(spec, itemsize, r.page_size)
    graphs = r.cuda_graph_booleans
    mp = plan_cache(layout, spec, max_batch_tokens=r.max_batch_tokens, max_requests_per_batch=r.max_requests_per_batch,
                    max_memory_percent=r.max_memory_percent, free_bytes=free_bytes, weight_bytes=weight_bytes,
                    packed_weight_bytes=packed_weight_bytes, num_blocks=r.num_blocks, cuda_graphs=graphs,
                    io_pairs=2 if r.use_async_batching and any(graphs) else 1)
    swap = 0
    if r.cpu_offload_space is None or r.cpu_offload_space > 0:
        host = host_available_bytes() if callable(host_available_bytes) else host_available_bytes
        swap = swap_sectors(layout, r.cpu_offload_space, r.cpu_offload_space_safety_threshold, int(host))
    r.num_blocks = mp.num_blocks
    return r, layout, mp, swap
