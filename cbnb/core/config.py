"""`ContinuousBatchingConfig`: transformers' field names and defaults, validated, resolvable.

Every field of transformers' `ContinuousBatchingConfig` (5.24) is here, with the same name, type and default, so a
config tuned in cbnb transfers to production with `to_transformers()`. Unlike transformers, every value is checked
when it is set (in `__init__` and on later assignment): a bad value raises `ValueError` naming the field and the
allowed range, and an unknown `scheduler_type` is an error listing the choices rather than a silent FIFO fallback.

How each `None` (and each 0 preset) is resolved, and where:

=============================  =========================================================================  ===========
field                          resolved value                                                             where
=============================  =========================================================================  ===========
num_blocks                     from free memory within `max_memory_percent` (KV + activations + logits)   cache sizing
                               (`cbnb.core.cache.sizing.plan_cache`); an explicit value is honoured
max_batch_tokens               8192 (transformers' fixed default) on an accelerator; 512 on CPU, so that  `resolve()`
                               one step stays short and streaming stays live
max_memory_percent             0.6 on CPU/MPS, 0.9 on an accelerator (transformers' rule without logits   `resolve()`
                               processors; cbnb samples in its own code)
max_requests_per_batch         1024, then capped at `max_batch_tokens`                                    `resolve()`
max_blocks_per_request         32 (transformers' fallback); it only sizes the block-table width of the     `resolve()`
                               CUDA decode path
use_cuda_graph                 (False, False) without CUDA; else (True, True) unless a path is disabled    `resolve()`
use_async_batching             `any(use_cuda_graph)` on CUDA, False elsewhere                             `resolve()`
q_padding_interval_size        0 -> 64 tokens (transformers' preset)                                      `resolve()`
kv_padding_interval_size       0 -> 16384 tokens (= 64 * 256, transformers' preset)                       `resolve()`
safety_margin                  scheduler default: 0.15 for "fifo", 0.0 for "prefill_first" and "vllm"     `resolve()`
seed                           stays None: unseeded sampling draws from torch's global RNG                runner
cpu_offload_space              None -> `cpu_offload_space_safety_threshold * available RAM`                swap pool
=============================  =========================================================================  ===========

`resolve()` never mutates the user's object: it returns a resolved copy, as transformers does. The engine's
`engine.config` is that copy with `num_blocks` and `max_batch_tokens` written back after the cache is created.

This module is torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass, field, fields
from typing import Any

__all__ = [
    "ContinuousBatchingConfig",
    "SCHEDULER_TYPES",
    "DEFAULT_SAFETY_MARGINS",
    "PREFIX_EVICTION_POLICIES",
    "TRANSFORMERS_FIELDS",
    "CBNB_FIELDS",
]

#: Scheduler names accepted by `scheduler_type`, with their default safety margin (transformers' class defaults; for
#: "vllm", vLLM V1's scheduler, it is vLLM's watermark, 0.0 by default in its KVCacheManager).
DEFAULT_SAFETY_MARGINS: dict[str, float] = {"fifo": 0.15, "prefill_first": 0.0, "vllm": 0.0}
SCHEDULER_TYPES: tuple[str, ...] = tuple(DEFAULT_SAFETY_MARGINS)

#: Order in which unreferenced cached prefix blocks are demoted when uninitialised blocks run out.
#: "transformers": the most recently freed block first (a finished request's tail first);
#: "lru": the least recently freed first (vLLM's order).
PREFIX_EVICTION_POLICIES: tuple[str, ...] = ("transformers", "lru")

# Presets transformers applies when the padding intervals are 0 (continuous_api.py).
Q_PADDING_PRESET = 64
KV_PADDING_PRESET = 16384
DEFAULT_MAX_BATCH_TOKENS = 8192
CPU_DEFAULT_MAX_BATCH_TOKENS = 512
DEFAULT_MAX_REQUESTS_PER_BATCH = 1024
FALLBACK_MAX_BLOCKS_PER_REQUEST = 32


def _fail(name: str, allowed: str, value: Any) -> None:
    raise ValueError(f"ContinuousBatchingConfig.{name} must be {allowed}; got {value!r}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_int(name: str, v: Any, lo: int, *, optional: bool) -> None:
    if v is None and optional:
        return
    if not _is_int(v) or v < lo:
        _fail(name, f"an integer >= {lo}" + (" or None" if optional else ""), v)


def _check_fraction(name: str, v: Any, lo: float, hi: float, *, optional: bool, lo_open: bool = False) -> None:
    if v is None and optional:
        return
    ok = _is_number(v) and (v > lo if lo_open else v >= lo) and v <= hi
    if not ok:
        rng = f"{'(' if lo_open else '['}{lo}, {hi}]"
        _fail(name, f"a number in {rng}" + (" or None" if optional else ""), v)


def _check_bool(name: str, v: Any, *, optional: bool) -> None:
    if v is None and optional:
        return
    if not isinstance(v, bool):
        _fail(name, "True or False" + (" or None" if optional else ""), v)


def _validate_use_cuda_graph(v: Any) -> None:
    if v is None or isinstance(v, bool):
        return
    if isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(x, bool) for x in v):
        return
    _fail("use_cuda_graph", "None, a bool, or a (varlen, decode) pair of bools", v)


def _validate_scheduler_type(v: Any) -> None:
    if v not in SCHEDULER_TYPES:
        _fail("scheduler_type", "one of " + ", ".join(repr(s) for s in SCHEDULER_TYPES), v)


def _validate_prefix_eviction(v: Any) -> None:
    if v not in PREFIX_EVICTION_POLICIES:
        _fail("prefix_eviction", "one of " + ", ".join(repr(s) for s in PREFIX_EVICTION_POLICIES), v)


def _validate_compile_config(name: str, v: Any) -> None:
    # transformers accepts a CompileConfig or a dict; cbnb stores either as given (cbnb.runner.cpu.compiled reads it).
    if v is not None and not isinstance(v, dict) and type(v).__name__ != "CompileConfig":
        _fail(name, "None, a dict, or a transformers CompileConfig", v)


_VALIDATORS: dict[str, Any] = {
    "page_size": lambda v: _check_int("page_size", v, 4, optional=False),
    "num_blocks": lambda v: _check_int("num_blocks", v, 1, optional=True),
    "max_batch_tokens": lambda v: _check_int("max_batch_tokens", v, 1, optional=True),
    "max_memory_percent": lambda v: _check_fraction("max_memory_percent", v, 0.0, 1.0, optional=True, lo_open=True),
    "max_requests_per_batch": lambda v: _check_int("max_requests_per_batch", v, 1, optional=True),
    "max_blocks_per_request": lambda v: _check_int("max_blocks_per_request", v, 0, optional=True),
    "allow_block_sharing": lambda v: _check_bool("allow_block_sharing", v, optional=False),
    "use_async_batching": lambda v: _check_bool("use_async_batching", v, optional=True),
    "use_cuda_graph": _validate_use_cuda_graph,
    "q_padding_interval_size": lambda v: _check_int("q_padding_interval_size", v, 0, optional=False),
    "kv_padding_interval_size": lambda v: _check_int("kv_padding_interval_size", v, 0, optional=False),
    "varlen_compile_config": lambda v: _validate_compile_config("varlen_compile_config", v),
    "decode_compile_config": lambda v: _validate_compile_config("decode_compile_config", v),
    "default_compile_level": lambda v: (
        None if _is_int(v) and 0 <= v <= 3 else _fail("default_compile_level", "an integer in [0, 3]", v)
    ),
    "scheduler_type": _validate_scheduler_type,
    "safety_margin": lambda v: _check_fraction("safety_margin", v, 0.0, 1.0, optional=True),
    "return_logprobs": lambda v: _check_bool("return_logprobs", v, optional=False),
    "seed": lambda v: None if v is None or _is_int(v) else _fail("seed", "an integer or None", v),
    "auto_switch_to_flash": lambda v: _check_bool("auto_switch_to_flash", v, optional=False),
    "cpu_offload_space": lambda v: (
        None if v is None or (_is_number(v) and v >= 0) else _fail("cpu_offload_space", "a number >= 0 (GiB) or None", v)
    ),
    "cpu_offload_space_safety_threshold": lambda v: _check_fraction(
        "cpu_offload_space_safety_threshold", v, 0.0, 1.0, optional=False
    ),
    "max_queue_size": lambda v: _check_int("max_queue_size", v, 0, optional=False),
    "per_request_processors": lambda v: _check_bool("per_request_processors", v, optional=False),
    "drop_unsupported_processors": lambda v: _check_bool("drop_unsupported_processors", v, optional=False),
    "disable_nccl_graph_mixing": lambda v: _check_bool("disable_nccl_graph_mixing", v, optional=False),
    "cpu_group_timeout": lambda v: (
        None if v is None or (_is_number(v) and v > 0) else _fail("cpu_group_timeout", "a number > 0 (s) or None", v)
    ),
    "use_default_compile_configs": lambda v: _check_bool("use_default_compile_configs", v, optional=True),
    "max_cached_graphs": lambda v: _check_int("max_cached_graphs", v, 0, optional=True),
    "block_size": lambda v: _check_int("block_size", v, 4, optional=True),
    "prefix_eviction": _validate_prefix_eviction,
}


@dataclass
class ContinuousBatchingConfig:
    """Continuous-batching settings, field-for-field transformers' `ContinuousBatchingConfig`.

    Units: `page_size` in tokens per page; `num_blocks` in whole-model blocks (one page per layer);
    `max_batch_tokens` in query tokens per step; `max_memory_percent`, `safety_margin` and
    `cpu_offload_space_safety_threshold` are fractions in [0, 1]; `cpu_offload_space` in GiB;
    padding intervals in tokens; `cpu_group_timeout` in seconds.

    Raises:
        ValueError: when a field is set to a value outside its allowed range (the message names the field and the
            range), at construction or on later assignment.

    The one cbnb-only field, `prefix_eviction`, is dropped by `to_transformers()`.
    """

    page_size: int = 256
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    max_blocks_per_request: int | None = None
    allow_block_sharing: bool = True
    use_async_batching: bool | None = None
    use_cuda_graph: bool | tuple[bool, bool] | None = None
    q_padding_interval_size: int = 0
    kv_padding_interval_size: int = 0
    varlen_compile_config: Any = None
    decode_compile_config: Any = None
    default_compile_level: int = 0
    scheduler_type: str = "fifo"
    safety_margin: float | None = None
    return_logprobs: bool = False
    seed: int | None = None
    auto_switch_to_flash: bool = True
    cpu_offload_space: float | None = 0.0
    cpu_offload_space_safety_threshold: float = 0.8
    max_queue_size: int = 0
    per_request_processors: bool = False
    drop_unsupported_processors: bool = True
    disable_nccl_graph_mixing: bool = True
    cpu_group_timeout: float | None = 300.0
    # Deprecated in transformers; kept for field-for-field compatibility.
    use_default_compile_configs: bool | None = None
    max_cached_graphs: int | None = None
    block_size: int | None = None
    # cbnb-only (not sent to transformers).
    prefix_eviction: str = field(default="transformers")

    def __setattr__(self, name: str, value: Any) -> None:
        validator = _VALIDATORS.get(name)
        if validator is not None:
            if name == "use_cuda_graph" and isinstance(value, list):
                value = tuple(value)
            validator(value)
        object.__setattr__(self, name, value)

    def __post_init__(self) -> None:
        # Same deprecation handling as transformers.
        if self.block_size is not None:
            warnings.warn("block_size is deprecated: use page_size (block_size is used as page_size)", FutureWarning)
            self.page_size = self.block_size
            self.block_size = None
        if self.use_default_compile_configs is not None:
            self.default_compile_level = 3 if self.use_default_compile_configs else 0
            self.use_default_compile_configs = None

    # ----------------------------------------------------------------------------------------------------------
    @property
    def cuda_graph_booleans(self) -> tuple[bool, bool]:
        """`use_cuda_graph` as a (varlen, decode) pair; None counts as (False, False)."""
        if self.use_cuda_graph is None:
            return (False, False)
        if isinstance(self.use_cuda_graph, bool):
            return (self.use_cuda_graph, self.use_cuda_graph)
        return tuple(self.use_cuda_graph)  # type: ignore[return-value]

    @property
    def effective_safety_margin(self) -> float:
        """`safety_margin`, or the scheduler's default when it is None (0.15 FIFO, 0.0 prefill_first)."""
        if self.safety_margin is not None:
            return float(self.safety_margin)
        return DEFAULT_SAFETY_MARGINS[self.scheduler_type]

    def copy(self, **changes: Any) -> "ContinuousBatchingConfig":
        """A validated copy with `changes` applied (the original is not modified)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """All fields as a plain dict (tuples kept)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def diff(self, other: "ContinuousBatchingConfig") -> dict[str, tuple[Any, Any]]:
        """Fields whose values differ: {name: (self's value, other's value)}."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        }

    # ----------------------------------------------------------------------------------------------------------
    def resolve(self, device_type: str = "cpu", *, cuda_graphs_supported: bool | None = None) -> "ContinuousBatchingConfig":
        """A copy with every None and 0-preset resolved for `device_type` ("cpu", "cuda", "mps", ...).

        `num_blocks` stays None here when unset: it needs memory figures, and the cache sizing fills it in.
        `cuda_graphs_supported` (default: True on "cuda" only) says whether this backend can capture graphs.
        """
        r = self.copy()
        device_type = str(device_type).split(":", 1)[0]  # "cuda:0" -> "cuda"
        on_accel = device_type not in ("cpu", "mps")
        graphs_ok = (device_type == "cuda") if cuda_graphs_supported is None else cuda_graphs_supported
        if r.max_batch_tokens is None:
            r.max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS if on_accel else CPU_DEFAULT_MAX_BATCH_TOKENS
        if r.max_memory_percent is None:
            r.max_memory_percent = 0.9 if on_accel else 0.6
        if r.max_requests_per_batch is None:
            r.max_requests_per_batch = DEFAULT_MAX_REQUESTS_PER_BATCH
        r.max_requests_per_batch = min(r.max_requests_per_batch, r.max_batch_tokens)
        if r.max_blocks_per_request is None:
            r.max_blocks_per_request = FALLBACK_MAX_BLOCKS_PER_REQUEST
        if not graphs_ok:
            r.use_cuda_graph = (False, False)
        elif r.use_cuda_graph is None:
            r.use_cuda_graph = (True, True)
        else:
            r.use_cuda_graph = r.cuda_graph_booleans
        if r.use_async_batching is None:
            r.use_async_batching = bool(graphs_ok and any(r.cuda_graph_booleans))
        elif r.use_async_batching and not graphs_ok:
            r.use_async_batching = False  # async double-buffering needs CUDA streams
        if r.q_padding_interval_size == 0:
            r.q_padding_interval_size = Q_PADDING_PRESET
        if r.kv_padding_interval_size == 0:
            r.kv_padding_interval_size = KV_PADDING_PRESET
        if r.safety_margin is None:
            r.safety_margin = DEFAULT_SAFETY_MARGINS[r.scheduler_type]
        return r

    # ----------------------------------------------------------------------------------------------------------
    @classmethod
    def from_transformers(cls, obj: Any) -> "ContinuousBatchingConfig":
        """Build from a transformers `ContinuousBatchingConfig` (or any object/dict with its field names).

        Fields that this version of transformers lacks keep cbnb's defaults; unknown attributes are ignored.
        """
        src = obj if isinstance(obj, dict) else {f: getattr(obj, f) for f in TRANSFORMERS_FIELDS if hasattr(obj, f)}
        kwargs = {k: v for k, v in src.items() if k in TRANSFORMERS_FIELDS or k in CBNB_FIELDS}
        # Deprecated aliases, resolved as transformers' __post_init__ does (a transformers object has already done
        # it, so this changes nothing there; a plain dict gets the same meaning).
        block_size = kwargs.pop("block_size", None)
        if block_size is not None:
            kwargs["page_size"] = block_size
        use_default = kwargs.pop("use_default_compile_configs", None)
        if use_default is not None:
            kwargs["default_compile_level"] = 3 if use_default else 0
        return cls(**kwargs)

    def to_transformers(self) -> Any:
        """The equivalent transformers `ContinuousBatchingConfig` (requires transformers).

        Only fields that the installed transformers version knows are passed; the cbnb-only `prefix_eviction` is
        dropped.
        """
        self._check_transformers_scheduler()
        from transformers.generation.configuration_utils import ContinuousBatchingConfig as HFConfig

        hf_fields = {f.name for f in fields(HFConfig)}
        kwargs = {k: v for k, v in self.transformers_dict().items() if k in hf_fields}
        return HFConfig(**kwargs)

    def _check_transformers_scheduler(self) -> None:
        if self.scheduler_type not in ("fifo", "prefill_first"):
            raise ValueError(f"scheduler_type={self.scheduler_type!r} is cbnb's simulation of vLLM's scheduler; "
                             "transformers has no such scheduler (it would fall back to FIFO silently): export it "
                             "with cbnb.export.to_vllm, or set scheduler_type='fifo' or 'prefill_first'")

    def transformers_dict(self) -> dict[str, Any]:
        """The transformers fields and their values (deprecated ones left out when None)."""
        out = {}
        for name in TRANSFORMERS_FIELDS:
            v = getattr(self, name)
            if name in _DEPRECATED and v is None:
                continue
            out[name] = v
        return out

    def to_code(self, *, only_changed: bool = True) -> str:
        """Ready-to-paste transformers code, e.g. ``ContinuousBatchingConfig(page_size=16, ...)``.

        With `only_changed`, fields equal to transformers' defaults are left out. scheduler_type="vllm" (no
        transformers scheduler) is left out too, with a comment saying so.
        """
        default = ContinuousBatchingConfig()
        parts = []
        for name, v in self.transformers_dict().items():
            if (only_changed and getattr(default, name) == v) or (name == "scheduler_type" and v == "vllm"):
                continue
            parts.append(f"{name}={v!r}")
        body = ",\n    ".join(parts)
        head = "from transformers.generation.configuration_utils import ContinuousBatchingConfig\n\n"
        if self.scheduler_type == "vllm":
            head += ("# scheduler_type='vllm' (cbnb's simulation of vLLM's scheduler) has no transformers equivalent: "
                     "left out (FIFO)\n")
        if not parts:
            return head + "config = ContinuousBatchingConfig()"
        return head + f"config = ContinuousBatchingConfig(\n    {body},\n)"


_DEPRECATED = ("use_default_compile_configs", "max_cached_graphs", "block_size")
CBNB_FIELDS: tuple[str, ...] = ("prefix_eviction",)
TRANSFORMERS_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(ContinuousBatchingConfig) if f.name not in CBNB_FIELDS
)
