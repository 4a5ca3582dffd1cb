"""SGLang server flags (``python -m sglang.launch_server``) for a `ContinuousBatchingConfig`.

Checked against SGLang 0.5.23: every flag emitted is in the option list read from its wheel
(cbnb/export/data/sglang-0.5.23.json, written by scripts/refresh_export_flags.py), and the semantics come from that
release's `ServerArgs` namespaces (python/sglang/srt/arg_groups/fields/): ``page_size``, ``max_total_tokens`` (the
token pool, which otherwise comes from ``mem_fraction_static``, the share of GPU memory for weights + KV pool),
``chunked_prefill_size``, ``max_running_requests``, ``max_queued_requests`` (waiting requests), ``schedule_policy``
(lpm | random | fcfs | dfs-weight | lof | priority | routing-key | hrrn | shortest-prefill-first),
``schedule_conservativeness``, ``disable_overlap_schedule``, ``disable_radix_cache``, ``radix_eviction_policy``
(lru | lfu | slru | priority | tlru), ``random_seed``, and ``cuda_graph_backend_decode`` /
``cuda_graph_backend_prefill`` (full | breakable | disabled; ``--disable-cuda-graph`` is a deprecated spelling in
this release). SGLang derives each flag from the field name (``page_size`` -> ``--page-size``).

The table (`MAPPING`) is printed in docs/exports.md.
"""

from __future__ import annotations

from typing import Any

from .common import NO_SERVING_EQUIVALENT, Export, MappingRow, cache_blocks, drop_unknown, model_shape, short_cache
from .flags import flag_list

__all__ = ["to_sglang", "MAPPING", "CHECKED_AGAINST", "VERSION"]

#: The SGLang release whose flag list (cbnb/export/data) the export is checked against.
VERSION = "0.5.23"
CHECKED_AGAINST = f"SGLang {VERSION}"

MAPPING: tuple[MappingRow, ...] = (
    MappingRow("page_size", "--page-size", "same",
               "tokens per page; some attention backends accept only certain sizes (SGLang checks at start)"),
    MappingRow("num_blocks", "--max-total-tokens", "mapped",
               "num_blocks * page_size: SGLang sizes its pool in tokens (with num_blocks=None, pass "
               "resolved=engine.config to export the size the sizing chose)"),
    MappingRow("max_memory_percent", "", "none",
               "not exported: SGLang's --mem-fraction-static is a share of GPU memory for weights + KV pool, "
               "transformers' a share of free memory for KV + activations; the pool size itself is exported as "
               "--max-total-tokens"),
    MappingRow("max_batch_tokens", "--chunked-prefill-size", "approx",
               "SGLang's bound is on prompt tokens per prefill chunk; cbnb's budget also counts decode tokens"),
    MappingRow("max_requests_per_batch", "--max-running-requests", "approx",
               "SGLang bounds running requests; cbnb bounds requests in one step"),
    MappingRow("allow_block_sharing", "--disable-radix-cache", "mapped", "False -> --disable-radix-cache"),
    MappingRow("scheduler_type", "--schedule-policy", "mapped", "fifo -> fcfs; prefill_first has no named equivalent"),
    MappingRow("use_cuda_graph", "--cuda-graph-backend-decode / --cuda-graph-backend-prefill", "mapped",
               "False -> both disabled; one path off alone has no equivalent (cbnb's varlen graphs are not "
               "SGLang's prefill graphs)"),
    MappingRow("use_async_batching", "--disable-overlap-schedule", "mapped",
               "False -> --disable-overlap-schedule (SGLang overlaps CPU scheduling with the GPU by default)"),
    MappingRow("seed", "--random-seed", "same", ""),
    MappingRow("max_queue_size", "--max-queued-requests", "approx",
               "SGLang bounds waiting requests, cbnb all unfinished ones (waiting + running); 0 (unbounded) is "
               "not exported"),
    MappingRow("prefix_eviction", "--radix-eviction-policy", "mapped",
               "lru -> lru; transformers' order has no equivalent"),
    MappingRow("safety_margin", "", "none",
               "closest knob: --schedule-conservativeness (room kept for running requests' future tokens), "
               "different units"),
    MappingRow("cpu_offload_space", "", "none",
               "SGLang retracts requests (recompute) when the pool is full; its host tier (--enable-hierarchical-"
               "cache) holds evicted prefixes, not swapped requests"),
    MappingRow("max_blocks_per_request", "", "none",
               "not a length cap: it is the block-table width of cbnb's CUDA decode path; a request's length is "
               "capped by --context-length"),
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


def to_sglang(config: Any, model: str = "MODEL", *, resolved: Any = None, shape: Any = None) -> Export:
    """SGLang server flags for `config`, every one an option of SGLang `VERSION` (fields left None are left to
    SGLang's own defaults, except the pool size).

    Args:
        config: a `ContinuousBatchingConfig` (usually ``engine.user_config``).
        model: the ``--model-path`` argument.
        resolved: the config the engine ran with (``engine.config``, after sizing): its ``num_blocks`` gives
            ``--max-total-tokens`` when `config.num_blocks` is None.
        shape: the served model's shape (`cbnb.export.common.model_shape`), for its context length.

    Warns:
        UserWarning: the pool holds fewer tokens than the model's context (``--context-length`` is added).
    """
    flags = flag_list("sglang", VERSION)
    ex = Export("sglang", CHECKED_AGAINST, "python -m sglang.launch_server --model-path", model)
    f = ex.flags
    f += ["--page-size", str(config.page_size)]
    blocks, how = cache_blocks(config, resolved)
    if blocks is None:
        ex.notes.append("num_blocks=None and no resolved config: SGLang will size its pool from "
                        "--mem-fraction-static, not the cache tuned here; pass resolved=engine.config to pin it")
    else:
        ex.add("--max-total-tokens", blocks * config.page_size)
        if how:
            ex.notes.append(f"--max-total-tokens {blocks * config.page_size}: {how}")
        short_cache(ex, blocks * config.page_size, model_shape(model, shape)[0], "--context-length", config.page_size)
    if config.max_memory_percent is not None:
        ex.unmapped.append(("max_memory_percent", config.max_memory_percent,
                            "not --mem-fraction-static (weights + KV pool share of GPU memory); the pool size is "
                            "exported instead (--max-total-tokens)"))
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
        f += ["--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled"]
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
    elif config.effective_safety_margin > 0:
        ex.notes.append(f"cbnb ran with safety_margin {config.effective_safety_margin:g} (the {config.scheduler_type} "
                        "default); SGLang has no equivalent (closest: --schedule-conservativeness)")
    if config.cpu_offload_space:
        ex.unmapped.append(("cpu_offload_space", config.cpu_offload_space,
                            "SGLang retracts and recomputes instead of swapping requests to host memory"))
    handled = {"page_size", "num_blocks", "max_memory_percent", "max_batch_tokens", "max_requests_per_batch",
               "allow_block_sharing", "prefix_eviction", "scheduler_type", "use_cuda_graph", "use_async_batching",
               "seed", "max_queue_size", "safety_margin", "cpu_offload_space", "block_size"}
    ex.report_unmapped(config, handled, MAPPING, "no SGLang equivalent")
    drop_unknown(ex, flags)
    return ex
