"""``transformers serve`` flags for a `ContinuousBatchingConfig`.

Checked against transformers 5.25's ``transformers serve`` (`transformers/cli/serve.py`; `transformers serve
--help`; `tests/lab/test_export.py` parses every export with that parser): ``--continuous-batching`` and five
``--cb-*`` options, which build a `ContinuousBatchingConfig` from ``block_size`` (the deprecated alias of
page_size), ``num_blocks``, ``max_batch_tokens``, ``max_memory_percent`` and ``use_cuda_graph``; ``--default-seed``
(new in 5.25: the server's torch seed, set when a model loads and before seeded generation); ``--max-model-len``
(the longest request, prompt and answer; default the model's context). Every other field has no flag: use the
Python API with `config.to_code()` (``model.init_continuous_batching(continuous_batching_config=...)``).

The table (`MAPPING`) is printed in docs/exports.md.
"""

from __future__ import annotations

from typing import Any

from .common import Export, MappingRow, changed_fields, model_shape, short_cache

__all__ = ["to_transformers_serve", "MAPPING", "CHECKED_AGAINST"]

CHECKED_AGAINST = "transformers 5.25 (transformers serve)"

_FLAGS = {"page_size": "--cb-block-size", "num_blocks": "--cb-num-blocks", "max_batch_tokens": "--cb-max-batch-tokens",
          "max_memory_percent": "--cb-max-memory-percent", "seed": "--default-seed"}
_NO_FLAG = "no `transformers serve` flag: use the Python API (config.to_code())"

MAPPING: tuple[MappingRow, ...] = (
    MappingRow("page_size", "--cb-block-size", "same", "block_size is transformers' deprecated alias of page_size"),
    MappingRow("num_blocks", "--cb-num-blocks", "same", ""),
    MappingRow("max_batch_tokens", "--cb-max-batch-tokens", "same", ""),
    MappingRow("max_memory_percent", "--cb-max-memory-percent", "same", ""),
    MappingRow("use_cuda_graph", "--cb-use-cuda-graph / --no-cb-use-cuda-graph", "same",
               "one bool for both paths; a (varlen, decode) pair that differs has no flag"),
    MappingRow("seed", "--default-seed", "mapped",
               "the server's torch seed (transformers 5.25), set when the model loads; cbnb's seeds its sampling"),
    *(MappingRow(name, "", "none", _NO_FLAG) for name in (
        "max_requests_per_batch", "max_blocks_per_request", "allow_block_sharing", "use_async_batching",
        "q_padding_interval_size", "kv_padding_interval_size", "varlen_compile_config", "decode_compile_config",
        "default_compile_level", "scheduler_type", "safety_margin", "return_logprobs",
        "auto_switch_to_flash", "cpu_offload_space", "cpu_offload_space_safety_threshold", "max_queue_size",
        "per_request_processors", "drop_unsupported_processors", "disable_nccl_graph_mixing", "cpu_group_timeout",
        "use_default_compile_configs", "max_cached_graphs")),
    MappingRow("block_size", "--cb-block-size", "same", "deprecated alias of page_size"),
    MappingRow("prefix_eviction", "", "none", "cbnb-only (transformers demotes the most recently freed block first)"),
)


def to_transformers_serve(config: Any, model: str = "MODEL", *, shape: Any = None) -> Export:
    """``transformers serve --continuous-batching`` flags for `config`.

    Args:
        shape: the served model's shape (`cbnb.export.common.model_shape`), for its context length.

    Warns:
        UserWarning: ``num_blocks`` holds fewer tokens than the model's context (``--max-model-len`` is added).
    """
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
    if config.num_blocks is not None:
        short_cache(ex, config.num_blocks * config.page_size, model_shape(model, shape)[0], "--max-model-len",
                    config.page_size)
    for name, value in changed_fields(config).items():
        if name in _FLAGS or name in ("use_cuda_graph", "block_size"):
            continue
        if name == "prefix_eviction":
            ex.unmapped.append((name, value, "cbnb-only option"))
        else:
            ex.unmapped.append((name, value, _NO_FLAG))
    return ex
