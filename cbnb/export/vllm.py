"""`vllm serve` flags for a `ContinuousBatchingConfig`.

Checked against vLLM v0.16.0: `vllm.config.cache.CacheConfig` (``BlockSize = Literal[1, 8, 16, 32, 64, 128, 256]``,
``gpu_memory_utilization`` in (0, 1], ``swap_space`` in GiB, ``num_gpu_blocks_override``,
``enable_prefix_caching``) and `vllm.config.scheduler.SchedulerConfig` (``max_num_batched_tokens``,
``max_num_seqs``, ``policy`` "fcfs" | "priority", ``async_scheduling``), as documented at
https://docs.vllm.ai/en/v0.16.0/api/vllm/config/cache/ and .../config/scheduler/. vLLM derives each flag from the
field name (``block_size`` -> ``--block-size``; booleans also take ``--no-...``).

The table (`MAPPING`) is printed in docs/exports.md.
"""

from __future__ import annotations

from typing import Any

from .common import NO_SERVING_EQUIVALENT, Export, MappingRow

__all__ = ["to_vllm", "MAPPING", "CHECKED_AGAINST", "BLOCK_SIZES"]

CHECKED_AGAINST = "vLLM 0.16.0"
#: Block sizes vLLM 0.16's CacheConfig accepts.
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)

MAPPING: tuple[MappingRow, ...] = (
    MappingRow("page_size", "--block-size", "same",
               "must be one of 1, 8, 16, 32, 64, 128, 256; vLLM's docstring says CUDA supports up to 32"),
    MappingRow("num_blocks", "--num-gpu-blocks-override", "same",
               "vLLM otherwise sizes the cache from --gpu-memory-utilization"),
    MappingRow("max_memory_percent", "--gpu-memory-utilization", "approx",
               "transformers: share of free memory for KV + activations; vLLM: share of total GPU memory for the "
               "whole instance, weights included"),
    MappingRow("max_batch_tokens", "--max-num-batched-tokens", "same", ""),
    MappingRow("max_requests_per_batch", "--max-num-seqs", "same", ""),
    MappingRow("allow_block_sharing", "--enable-prefix-caching / --no-enable-prefix-caching", "same", ""),
    MappingRow("cpu_offload_space", "--swap-space", "approx",
               "GiB of host memory in both; None (cbnb: a share of free RAM) is not exported"),
    MappingRow("scheduler_type", "--scheduling-policy", "mapped", "fifo -> fcfs; prefill_first has no equivalent"),
    MappingRow("use_cuda_graph", "--enforce-eager", "mapped",
               "False -> --enforce-eager; vLLM cannot turn off one of the two graph paths alone"),
    MappingRow("use_async_batching", "--async-scheduling / --no-async-scheduling", "same", ""),
    MappingRow("seed", "--seed", "same", ""),
    MappingRow("safety_margin", "", "none", "vLLM keeps no free-cache reserve before admitting new requests"),
    MappingRow("max_blocks_per_request", "", "none", "cap a request's length with --max-model-len instead"),
    MappingRow("max_queue_size", "", "none", "vLLM's server queue is unbounded"),
    MappingRow("q_padding_interval_size", "", "none",
               "vLLM pads to its CUDA-graph capture sizes (--compilation-config)"),
    MappingRow("kv_padding_interval_size", "", "none", "as q_padding_interval_size"),
    MappingRow("varlen_compile_config", "", "none", "use --compilation-config"),
    MappingRow("decode_compile_config", "", "none", "use --compilation-config"),
    MappingRow("default_compile_level", "", "none", "use --compilation-config"),
    MappingRow("return_logprobs", "", "none", "per request in vLLM (SamplingParams.logprobs)"),
    MappingRow("auto_switch_to_flash", "", "none", "vLLM picks its attention backend itself"),
    MappingRow("cpu_offload_space_safety_threshold", "", "none", "vLLM warns above 40 % and refuses above 70 % of RAM"),
    MappingRow("per_request_processors", "", "none", "vLLM applies logits processors per request"),
    *NO_SERVING_EQUIVALENT,
    MappingRow("block_size", "--block-size", "same", "deprecated alias of page_size"),
    MappingRow("prefix_eviction", "", "mapped",
               "vLLM always evicts least recently used blocks first (= cbnb's 'lru')"),
)


def _graphs_off(v: Any) -> bool | None:
    """True: both off; False: both on / auto; None: only one of the two paths off."""
    if v is None or v is True:
        return False
    if v is False:
        return True
    a, b = v
    return True if not a and not b else (False if a and b else None)


def to_vllm(config: Any, model: str = "MODEL") -> Export:
    """`vllm serve` flags for `config` (fields left None are left to vLLM's own defaults).

    Args:
        config: a `ContinuousBatchingConfig` (usually ``engine.user_config``).
        model: the model argument of ``vllm serve``.
    """
    ex = Export("vllm", CHECKED_AGAINST, "vllm serve", model)
    f = ex.flags
    ps = config.page_size
    if ps in BLOCK_SIZES:
        f += ["--block-size", str(ps)]
        if ps > 32:
            ex.notes.append(f"--block-size {ps}: vLLM's docs say CUDA devices support block sizes up to 32")
    else:
        ex.problems.append(f"page_size={ps}: vLLM accepts --block-size in {', '.join(map(str, BLOCK_SIZES))} "
                           "only; not exported (choose one of those and re-tune)")
    ex.add("--num-gpu-blocks-override", config.num_blocks)
    ex.add("--gpu-memory-utilization", config.max_memory_percent)
    if config.max_memory_percent is not None:
        ex.notes.append("--gpu-memory-utilization is a share of total GPU memory for the whole vLLM instance "
                        "(weights included); max_memory_percent was a share of free memory for the cache")
    ex.add("--max-num-batched-tokens", config.max_batch_tokens)
    ex.add("--max-num-seqs", config.max_requests_per_batch)
    f.append("--enable-prefix-caching" if config.allow_block_sharing else "--no-enable-prefix-caching")
    ex.add("--swap-space", config.cpu_offload_space)
    if config.cpu_offload_space is None:
        ex.notes.append("cpu_offload_space=None (a share of free RAM) is not exported: vLLM's --swap-space "
                        "defaults to 4 GiB")
    if config.scheduler_type == "fifo":
        f += ["--scheduling-policy", "fcfs"]
    else:
        ex.unmapped.append(("scheduler_type", config.scheduler_type, "vLLM has no prefill-first policy"))
    off = _graphs_off(config.use_cuda_graph)
    if off:
        f.append("--enforce-eager")
    elif off is None:
        ex.unmapped.append(("use_cuda_graph", config.use_cuda_graph,
                            "vLLM cannot turn off one of the two graph paths alone"))
    if config.use_async_batching is not None:
        f.append("--async-scheduling" if config.use_async_batching else "--no-async-scheduling")
    ex.add("--seed", config.seed)
    if config.safety_margin is not None:
        ex.unmapped.append(("safety_margin", config.safety_margin,
                            "vLLM keeps no free-cache reserve before admitting new requests"))
    if config.prefix_eviction != "lru" and config.allow_block_sharing:
        ex.notes.append("vLLM evicts cached blocks least recently used first (cbnb's prefix_eviction='lru'); "
                        f"this config used {config.prefix_eviction!r}")
    handled = {"page_size", "num_blocks", "max_memory_percent", "max_batch_tokens", "max_requests_per_batch",
               "allow_block_sharing", "cpu_offload_space", "scheduler_type", "use_cuda_graph", "use_async_batching",
               "seed", "safety_margin", "prefix_eviction", "block_size"}
    ex.report_unmapped(config, handled, MAPPING, "no vLLM equivalent")
    return ex
