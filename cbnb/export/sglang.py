"""SGLang server flags (``python -m sglang.launch_server``) for a `ContinuousBatchingConfig`.

Checked against SGLang's `ServerArgs` on main after v0.5.3 (python/sglang/srt/server_args.py and its "Memory and
scheduling" argument group: ``page_size``, ``mem_fraction_static``, ``max_running_requests``,
``max_queued_requests``, ``max_total_tokens``, ``chunked_prefill_size``, ``schedule_policy`` in lpm | random | fcfs |
dfs-weight | lof | priority | routing-key, default "fcfs", ``schedule_conservativeness``, ``disable_overlap_schedule``;
``disable_radix_cache``, ``radix_eviction_policy`` in lru | lfu | slru | priority, ``random_seed``,
``--disable-cuda-graph``) and the Server Arguments page at https://docs.sglang.io/advanced_features/server_arguments.html.
SGLang derives each flag from the field name (``page_size`` -> ``--page-size``).

The table (`MAPPING`) is printed in docs/exports.md.
"""

from __future__ import annotations

from typing import Any

from .common import NO_SERVING_EQUIVALENT, Export, MappingRow

__all__ = ["to_sglang", "MAPPING", "CHECKED_AGAINST"]

CHECKED_AGAINST = "SGLang main after v0.5.3 (ServerArgs)"

MAPPING: tuple[MappingRow, ...] = (
    MappingRow("page_size", "--page-size", "same",
               "tokens per page; some attention backends accept only certain sizes (SGLang checks at start)"),
    MappingRow("num_blocks", "--max-total-tokens", "mapped", "num_blocks * page_size: SGLang sizes its pool in tokens"),
    MappingRow("max_memory_percent", "--mem-fraction-static", "approx",
               "SGLang: share of GPU memory for weights + KV pool; transformers: share of free memory for KV + "
               "activations"),
    MappingRow("max_batch_tokens", "--chunked-prefill-size", "approx",
               "SGLang's bound is on prompt tokens per prefill chunk; cbnb's budget also counts decode tokens"),
    MappingRow("max_requests_per_batch", "--max-running-requests", "approx",
               "SGLang bounds running requests; cbnb bounds requests in one step"),
    MappingRow("allow_block_sharing", "--disable-radix-cache", "mapped", "False -> --disable-radix-cache"),
    MappingRow("scheduler_type", "--schedule-policy", "mapped", "fifo -> fcfs; prefill_first has no named equivalent"),
    MappingRow("use_cuda_graph", "--disable-cuda-graph", "mapped", "False -> --disable-cuda-graph"),
    MappingRow("use_async_batching", "--disable-overlap-schedule", "mapped",
               "False -> --disable-overlap-schedule (SGLang overlaps CPU scheduling with the GPU by default)"),
    MappingRow("seed", "--random-seed", "same", ""),
    MappingRow("max_queue_size", "--max-queued-requests", "same", "0 (unbounded) is not exported"),
    MappingRow("prefix_eviction", "--radix-eviction-policy", "mapped",
               "lru -> lru; transformers' order has no equivalent"),
    MappingRow("safety_margin", "", "none",
               "closest knob: --schedule-conservativeness (room kept for running requests' future tokens), "
               "different units"),
    MappingRow("cpu_offload_space", "", "none",
               "SGLang retracts requests (recompute) when the pool is full; its host tier (--enable-hierarchical-"
               "cache) holds evicted prefixes, not swapped requests"),
    MappingRow("max_blocks_per_request", "", "none", "cap a request's length with --context-length"),
    MappingRow("q_padding_interval_size", "", "none", "SGLang pads to its CUDA-graph batch sizes"),
    MappingRow("kv_padding_interval_size", "", "none", ""),
    MappingRow("varlen_compile_config", "", "none", "see --enable-torch-compile"),
    MappingRow("decode_compile_config", "", "none", "see --enable-torch-compile"),
    MappingRow("default_compile_level", "", "none", "see --enable-torch-compile"),
    MappingRow("return_logprobs", "", "none", "per request in SGLang (return_logprob)"),
    MappingRow("auto_switch_to_flash", "", "none", "see --attention-backend"),
    MappingRow("cpu_offload_space_safety_threshold", "", "none", ""),
    MappingRow("per_request_processors", "", "none", ""),
    *NO_SERVING_EQUIVALENT,
    MappingRow("block_size", "--page-size", "same", "deprecated alias of page_size"),
)


def to_sglang(config: Any, model: str = "MODEL") -> Export:
    """SGLang server flags for `config` (fields left None are left to SGLang's own defaults)."""
    ex = Export("sglang", CHECKED_AGAINST, "python -m sglang.launch_server --model-path", model)
    f = ex.flags
    f += ["--page-size", str(config.page_size)]
    ex.add("--max-total-tokens", None if config.num_blocks is None else config.num_blocks * config.page_size)
    ex.add("--mem-fraction-static", config.max_memory_percent)
    if config.max_memory_percent is not None:
        ex.notes.append("--mem-fraction-static covers weights + KV pool; max_memory_percent was a share of free "
                        "memory for KV + activations: check the pool size SGLang logs at start")
    ex.add("--chunked-prefill-size", config.max_batch_tokens)
    ex.add("--max-running-requests", config.max_requests_per_batch)
    if not config.allow_block_sharing:
        f.append("--disable-radix-cache")
    elif config.prefix_eviction == "lru":
        f += ["--radix-eviction-policy", "lru"]
    else:
        ex.notes.append(f"prefix_eviction={config.prefix_eviction!r} has no SGLang equivalent: SGLang's default "
                        "radix eviction is 'lru'")
    if config.scheduler_type == "fifo":
        f += ["--schedule-policy", "fcfs"]
    else:
        ex.unmapped.append(("scheduler_type", config.scheduler_type, "no named SGLang policy"))
    g = config.use_cuda_graph
    if g is False or (isinstance(g, tuple) and not any(g)):
        f.append("--disable-cuda-graph")
    elif isinstance(g, tuple) and not all(g):
        ex.unmapped.append(("use_cuda_graph", g, "SGLang cannot turn off one of the two graph paths alone"))
    if config.use_async_batching is False:
        f.append("--disable-overlap-schedule")
    ex.add("--random-seed", config.seed)
    if config.max_queue_size:
        f += ["--max-queued-requests", str(config.max_queue_size)]
    if config.safety_margin is not None:
        ex.unmapped.append(("safety_margin", config.safety_margin,
                            "no equivalent; closest: --schedule-conservativeness (different units)"))
    if config.cpu_offload_space:
        ex.unmapped.append(("cpu_offload_space", config.cpu_offload_space,
                            "SGLang retracts and recomputes instead of swapping requests to host memory"))
    handled = {"page_size", "num_blocks", "max_memory_percent", "max_batch_tokens", "max_requests_per_batch",
               "allow_block_sharing", "prefix_eviction", "scheduler_type", "use_cuda_graph", "use_async_batching",
               "seed", "max_queue_size", "safety_margin", "cpu_offload_space", "block_size"}
    ex.report_unmapped(config, handled, MAPPING, "no SGLang equivalent")
    return ex
