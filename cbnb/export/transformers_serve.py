"""``transformers serve`` flags for a `ContinuousBatchingConfig`.

Checked against transformers 5.24's ``transformers serve`` (`transformers/cli/serve.py`; `transformers serve
--help`): ``--continuous-batching`` and five ``--cb-*`` options, which build a `ContinuousBatchingConfig` from
``block_size`` (the deprecated alias of page_size), ``num_blocks``, ``max_batch_tokens``, ``max_memory_percent`` and
``use_cuda_graph``. Every other field has no flag: use the Python API with `config.to_code()`
(``model.init_continuous_batching(continuous_batching_config=...)``).

The table (`MAPPING`) is printed in docs/exports.md.
"""

from __future__ import annotations

from typing import Any

from .common import Export, MappingRow, changed_fields

__all__ = ["to_transformers_serve", "MAPPING", "CHECKED_AGAINST"]

CHECKED_AGAINST = "transformers 5.24 (transformers serve)"

_FLAGS = {"page_size": "--cb-block-size", "num_blocks": "--cb-num-blocks", "max_batch_tokens": "--cb-max-batch-tokens",
          "max_memory_percent": "--cb-max-memory-percent"}
_NO_FLAG = "no `transformers serve` flag: use the Python API (config.to_code())"

MAPPING: tuple[MappingRow, ...] = (
    MappingRow("page_size", "--cb-block-size", "same", "block_size is transformers' deprecated alias of page_size"),
    MappingRow("num_blocks", "--cb-num-blocks", "same", ""),
    MappingRow("max_batch_tokens", "--cb-max-batch-tokens", "same", ""),
    MappingRow("max_memory_percent", "--cb-max-memory-percent", "same", ""),
    MappingRow("use_cuda_graph", "--cb-use-cuda-graph / --no-cb-use-cuda-graph", "same",
               "one bool for both paths; a (varlen, decode) pair that differs has no flag"),
    *(MappingRow(name, "", "none", _NO_FLAG) for name in (
        "max_requests_per_batch", "max_blocks_per_request", "allow_block_sharing", "use_async_batching",
        "q_padding_interval_size", "kv_padding_interval_size", "varlen_compile_config", "decode_compile_config",
        "default_compile_level", "scheduler_type", "safety_margin", "return_logprobs", "seed",
        "auto_switch_to_flash", "cpu_offload_space", "cpu_offload_space_safety_threshold", "max_queue_size",
        "per_request_processors", "drop_unsupported_processors", "disable_nccl_graph_mixing", "cpu_group_timeout",
        "use_default_compile_configs", "max_cached_graphs")),
    MappingRow("block_size", "--cb-block-size", "same", "deprecated alias of page_size"),
    MappingRow("prefix_eviction", "", "none", "cbnb-only (transformers demotes the most recently freed block first)"),
)


def to_transformers_serve(config: Any, model: str = "MODEL") -> Export:
    """``transformers serve --continuous-batching`` flags for `config`."""
    ex = Export("transformers-serve", CHECKED_AGAINST, "transformers serve", model, ["--continuous-batching"])
    for name, flag in _FLAGS.items():
        v = getattr(config, name)
        if not (name == "page_size" and v == 256):  # 256 is transformers' own default
            ex.add(flag, v)
    g = config.use_cuda_graph
    if isinstance(g, bool):
        ex.flags.append("--cb-use-cuda-graph" if g else "--no-cb-use-cuda-graph")
    elif isinstance(g, tuple):
        if all(g) or not any(g):
            ex.flags.append("--cb-use-cuda-graph" if g[0] else "--no-cb-use-cuda-graph")
        else:
            ex.unmapped.append(("use_cuda_graph", g, "one flag sets both graph paths"))
    for name, value in changed_fields(config).items():
        if name in _FLAGS or name in ("use_cuda_graph", "block_size"):
            continue
        if name == "prefix_eviction":
            ex.unmapped.append((name, value, "cbnb-only option"))
        else:
            ex.unmapped.append((name, value, _NO_FLAG))
    return ex
