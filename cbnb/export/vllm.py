"""`vllm serve` flags for a `ContinuousBatchingConfig`.

Checked against vLLM 0.33.0: every flag emitted is in the option list read from its wheel
(cbnb/export/data/vllm-0.33.0.json, written by scripts/refresh_export_flags.py), and the semantics below come from
that release's source: `vllm/config/cache.py` (``block_size``: any int > 0, each attention backend checks the
sizes it supports at start-up; ``gpu_memory_utilization`` in (0, 1], default 0.92, the share of the whole GPU for
the model executor: weights, activations and KV; ``num_gpu_blocks_override``, which replaces the profiled block
count; ``kv_cache_memory_bytes``; ``enable_prefix_caching``) and `vllm/config/scheduler.py` (``max_num_batched_tokens``,
``max_num_seqs``, ``max_num_queued_reqs``: requests in flight, waiting or running, beyond which the server answers
HTTP 503; ``policy`` "fcfs" | "priority"; ``watermark`` in [0, 1): the fraction of all KV blocks kept free when
admitting waiting or preempted requests; ``async_scheduling``). ``--swap-space`` is not an option of 0.33 (0.16 had
it): vLLM preempts by recomputation.

The table (`MAPPING`) is printed in docs/exports.md.
"""

from __future__ import annotations

from typing import Any

from .common import NO_SERVING_EQUIVALENT, Export, MappingRow, cache_blocks, drop_unknown
from .flags import flag_list

__all__ = ["to_vllm", "MAPPING", "CHECKED_AGAINST", "VERSION"]

#: The vLLM release whose flag list (cbnb/export/data) the export is checked against.
VERSION = "0.33.0"
CHECKED_AGAINST = f"vLLM {VERSION}"

MAPPING: tuple[MappingRow, ...] = (
    MappingRow("page_size", "--block-size", "same",
               "any positive integer in vLLM 0.33; the attention backend checks at start-up that it supports it"),
    MappingRow("num_blocks", "--num-gpu-blocks-override", "same",
               "the cache size cbnb ran with, in blocks of page_size tokens (with num_blocks=None, pass "
               "resolved=engine.config to export the size the sizing chose); without it vLLM sizes the cache "
               "from --gpu-memory-utilization"),
    MappingRow("max_memory_percent", "", "none",
               "not exported: vLLM's --gpu-memory-utilization is the share of the whole GPU for weights + "
               "activations + KV (default 0.92), transformers' a share of free memory for KV + activations; the "
               "cache size itself is exported as --num-gpu-blocks-override"),
    MappingRow("max_batch_tokens", "--max-num-batched-tokens", "same", ""),
    MappingRow("max_requests_per_batch", "--max-num-seqs", "same", ""),
    MappingRow("allow_block_sharing", "--enable-prefix-caching / --no-enable-prefix-caching", "same", ""),
    MappingRow("cpu_offload_space", "", "none",
               "vLLM 0.33 has no swap space (--swap-space is gone): a preempted request is recomputed; "
               "--kv-offloading-size is a host tier for KV blocks, not a swap pool for preempted requests"),
    MappingRow("scheduler_type", "--scheduling-policy", "mapped",
               "fifo -> fcfs; vllm (cbnb's simulation of vLLM's own policy) -> fcfs; prefill_first has no equivalent"),
    MappingRow("use_cuda_graph", "--enforce-eager", "mapped",
               "False -> --enforce-eager; vLLM cannot turn off one of the two graph paths alone"),
    MappingRow("use_async_batching", "--async-scheduling / --no-async-scheduling", "same", ""),
    MappingRow("seed", "--seed", "same", ""),
    MappingRow("safety_margin", "--watermark", "approx",
               "both keep a share of the cache free when admitting a request once one is already in the step; vLLM "
               "needs the new request's blocks plus the watermark free, cbnb stops admitting when the free share is "
               "below the margin; None exports the scheduler default cbnb ran with (0.15 fifo, 0 prefill_first; "
               "vLLM's own default is 0); vLLM needs < 1"),
    MappingRow("max_blocks_per_request", "", "none",
               "not a length cap: it is the block-table width of cbnb's CUDA decode path; vLLM sizes its block "
               "tables itself (a request's length is capped by --max-model-len)"),
    MappingRow("max_queue_size", "--max-num-queued-reqs", "same",
               "requests in flight (waiting or running) at once; beyond it vLLM answers HTTP 503 where cbnb's "
               "submit raises queue.Full; 0 (unbounded) is not exported"),
    MappingRow("q_padding_interval_size", "", "none",
               "vLLM pads to its CUDA-graph capture sizes (--cudagraph-capture-sizes)"),
    MappingRow("kv_padding_interval_size", "", "none", "as q_padding_interval_size"),
    MappingRow("varlen_compile_config", "", "none", "use --compilation-config"),
    MappingRow("decode_compile_config", "", "none", "use --compilation-config"),
    MappingRow("default_compile_level", "", "none", "use --compilation-config"),
    MappingRow("return_logprobs", "", "none", "per request in vLLM (SamplingParams.logprobs)"),
    MappingRow("auto_switch_to_flash", "", "none", "vLLM picks its attention backend itself"),
    MappingRow("cpu_offload_space_safety_threshold", "", "none", "no swap space in vLLM 0.33"),
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


def to_vllm(config: Any, model: str = "MODEL", *, resolved: Any = None,
            tensor_parallel_size: int | None = None) -> Export:
    """`vllm serve` flags for `config`, every one an option of vLLM `VERSION` (fields left None are left to vLLM's
    own defaults, except the cache size and the safety margin, which are exported as cbnb ran them).

    Args:
        config: a `ContinuousBatchingConfig` (usually ``engine.user_config``).
        model: the model argument of ``vllm serve``.
        resolved: the config the engine ran with (``engine.config``, after sizing): its ``num_blocks`` is exported
            when `config.num_blocks` is None, so vLLM builds the cache that was tuned.
        tensor_parallel_size: GPUs per engine (``--tensor-parallel-size``; a simulated fleet's,
            `cbnb.sim.fleet.Fleet`); None: not exported (vLLM's default, 1).
    """
    flags = flag_list("vllm", VERSION)
    ex = Export("vllm", CHECKED_AGAINST, "vllm serve", model)
    f = ex.flags
    ex.add("--block-size", config.page_size)
    blocks, how = cache_blocks(config, resolved)
    if blocks is None:
        ex.notes.append("num_blocks=None and no resolved config: vLLM will size its own cache from "
                        "--gpu-memory-utilization (default 0.92 of the whole GPU), not the cache tuned here; pass "
                        "resolved=engine.config to pin it")
    elif "--num-gpu-blocks-override" in flags:
        ex.add("--num-gpu-blocks-override", blocks)
        if how:
            ex.notes.append(f"--num-gpu-blocks-override {blocks}: {how}")
    else:
        ex.problems.append(f"num_blocks={blocks}: vLLM {VERSION} has no --num-gpu-blocks-override; "
                           "--kv-cache-memory-bytes needs the cache's bytes on the target GPU "
                           "(blocks x bytes per block)")
    if config.max_memory_percent is not None:
        ex.unmapped.append(("max_memory_percent", config.max_memory_percent,
                            "not --gpu-memory-utilization: that is the share of the whole GPU for weights + "
                            "activations + KV; the cache size is exported instead (--num-gpu-blocks-override)"))
    ex.add("--max-num-batched-tokens", config.max_batch_tokens)
    ex.add("--max-num-seqs", config.max_requests_per_batch)
    f.append("--enable-prefix-caching" if config.allow_block_sharing else "--no-enable-prefix-caching")
    if config.cpu_offload_space:
        ex.unmapped.append(("cpu_offload_space", config.cpu_offload_space,
                            "vLLM 0.33 has no swap space: preempted requests are recomputed (cbnb's soft reset)"))
    ex.add("--tensor-parallel-size", tensor_parallel_size)
    if config.scheduler_type in ("fifo", "vllm"):
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
    margin = config.effective_safety_margin
    if margin < 1.0:
        ex.add("--watermark", float(margin))
        if config.safety_margin is None:
            ex.notes.append(f"--watermark {margin:g}: safety_margin=None ran with the {config.scheduler_type} "
                            "default; vLLM's own default is 0")
    else:
        ex.problems.append(f"safety_margin={margin:g}: vLLM's --watermark must be in [0, 1); not exported")
    if config.max_queue_size:
        ex.add("--max-num-queued-reqs", config.max_queue_size)
    if config.prefix_eviction != "lru" and config.allow_block_sharing:
        ex.notes.append("vLLM evicts cached blocks least recently used first (cbnb's prefix_eviction='lru'); "
                        f"this config used {config.prefix_eviction!r}")
    handled = {"page_size", "num_blocks", "max_memory_percent", "max_batch_tokens", "max_requests_per_batch",
               "allow_block_sharing", "cpu_offload_space", "scheduler_type", "use_cuda_graph", "use_async_batching",
               "seed", "safety_margin", "max_queue_size", "prefix_eviction", "block_size"}
    ex.report_unmapped(config, handled, MAPPING, "no vLLM equivalent")
    drop_unknown(ex, flags)
    return ex
