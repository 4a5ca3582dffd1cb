"""ContinuousBatchingConfig: transformers' fields and defaults, validation, resolution, round trips."""

from __future__ import annotations

import dataclasses

import pytest

import cbnb.core.config as config_module
from cbnb.core.config import (
    CBNB_FIELDS,
    DEFAULT_SAFETY_MARGINS,
    PREFIX_EVICTION_POLICIES,
    SCHEDULER_TYPES,
    TRANSFORMERS_FIELDS,
    ContinuousBatchingConfig,
)

HF = pytest.importorskip("transformers.generation.configuration_utils").ContinuousBatchingConfig

# The list of defaults, written out: a change in cbnb must be deliberate.
EXPECTED_DEFAULTS = {
    "page_size": 256,
    "num_blocks": None,
    "max_batch_tokens": None,
    "max_memory_percent": None,
    "max_requests_per_batch": None,
    "max_blocks_per_request": None,
    "allow_block_sharing": True,
    "use_async_batching": None,
    "use_cuda_graph": None,
    "q_padding_interval_size": 0,
    "kv_padding_interval_size": 0,
    "varlen_compile_config": None,
    "decode_compile_config": None,
    "default_compile_level": 0,
    "scheduler_type": "fifo",
    "safety_margin": None,
    "return_logprobs": False,
    "seed": None,
    "auto_switch_to_flash": True,
    "cpu_offload_space": 0.0,
    "cpu_offload_space_safety_threshold": 0.8,
    "max_queue_size": 0,
    "per_request_processors": False,
    "drop_unsupported_processors": True,
    "disable_nccl_graph_mixing": True,
    "cpu_group_timeout": 300.0,
    "use_default_compile_configs": None,
    "max_cached_graphs": None,
    "block_size": None,
}


def _hf_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()  # type: ignore[misc]


# ------------------------------------------------------------------------------------------------ fields and defaults
def test_exact_defaults() -> None:
    c = ContinuousBatchingConfig()
    for name, want in EXPECTED_DEFAULTS.items():
        got = getattr(c, name)
        assert got == want and type(got) is type(want), (name, got, want)
    assert c.prefix_eviction == "transformers"


def test_every_transformers_field_with_the_same_default() -> None:
    hf_fields = {f.name: f for f in dataclasses.fields(HF)}
    ours = {f.name: f for f in dataclasses.fields(ContinuousBatchingConfig)}
    assert set(hf_fields) <= set(ours), set(hf_fields) - set(ours)
    assert set(ours) - set(hf_fields) == set(CBNB_FIELDS) == {"prefix_eviction"}
    for name, f in hf_fields.items():
        assert _hf_default(f) == _hf_default(ours[name]), name
    assert set(TRANSFORMERS_FIELDS) == set(hf_fields)
    # Same order as transformers, so positional use (rare) and printed configs line up.
    assert list(TRANSFORMERS_FIELDS) == [f.name for f in dataclasses.fields(HF)]


def test_defaults_match_a_fresh_transformers_object() -> None:
    hf = HF()
    c = ContinuousBatchingConfig()
    for name in TRANSFORMERS_FIELDS:
        assert getattr(hf, name) == getattr(c, name), name
    assert c.cuda_graph_booleans == hf.cuda_graph_booleans == (False, False)


def test_scheduler_defaults() -> None:
    assert SCHEDULER_TYPES == ("fifo", "prefill_first", "vllm")
    assert DEFAULT_SAFETY_MARGINS == {"fifo": 0.15, "prefill_first": 0.0, "vllm": 0.0}  # vllm: its watermark
    assert ContinuousBatchingConfig().effective_safety_margin == 0.15
    assert ContinuousBatchingConfig(scheduler_type="prefill_first").effective_safety_margin == 0.0
    assert ContinuousBatchingConfig(scheduler_type="prefill_first", safety_margin=0.4).effective_safety_margin == 0.4
    assert PREFIX_EVICTION_POLICIES == ("transformers", "lru")


def test_transformers_scheduler_class_defaults_agree() -> None:
    sched = pytest.importorskip("transformers.generation.continuous_batching.scheduler")
    for name, cls_name in (("fifo", "FIFOScheduler"), ("prefill_first", "PrefillFirstScheduler")):
        s = getattr(sched, cls_name)(None, None, 8)  # the cache is only stored by __init__
        assert s.safety_margin == DEFAULT_SAFETY_MARGINS[name], (name, s.safety_margin)


# ------------------------------------------------------------------------------------------------ validation
@pytest.mark.parametrize(
    "field, value, fragment",
    [
        ("page_size", 3, "integer >= 4"),
        ("page_size", 0, "integer >= 4"),
        ("page_size", 16.0, "integer >= 4"),
        ("page_size", True, "integer >= 4"),
        ("num_blocks", 0, "integer >= 1 or None"),
        ("max_batch_tokens", -1, "integer >= 1 or None"),
        ("max_memory_percent", 0.0, "(0.0, 1.0]"),
        ("max_memory_percent", 1.5, "(0.0, 1.0]"),
        ("max_requests_per_batch", 0, "integer >= 1"),
        ("max_blocks_per_request", -1, "integer >= 0"),
        ("allow_block_sharing", 1, "True or False"),
        ("use_async_batching", "yes", "True or False or None"),
        ("use_cuda_graph", (True,), "pair of bools"),
        ("use_cuda_graph", "on", "pair of bools"),
        ("q_padding_interval_size", -64, "integer >= 0"),
        ("kv_padding_interval_size", None, "integer >= 0"),
        ("default_compile_level", 4, "[0, 3]"),
        ("scheduler_type", "lifo", "'fifo', 'prefill_first'"),
        ("scheduler_type", "FIFO", "'fifo', 'prefill_first'"),
        ("safety_margin", -0.01, "[0.0, 1.0]"),
        ("safety_margin", 1.01, "[0.0, 1.0]"),
        ("safety_margin", float("nan"), "[0.0, 1.0]"),
        ("seed", 1.5, "integer or None"),
        ("cpu_offload_space", -1.0, ">= 0"),
        ("cpu_offload_space_safety_threshold", 2.0, "[0.0, 1.0]"),
        ("max_queue_size", -1, "integer >= 0"),
        ("cpu_group_timeout", 0, "> 0"),
        ("prefix_eviction", "fifo", "'transformers', 'lru'"),
        ("varlen_compile_config", 3, "CompileConfig"),
    ],
)
def test_invalid_values_name_the_field_and_range(field: str, value, fragment: str) -> None:
    with pytest.raises(ValueError) as e:
        ContinuousBatchingConfig(**{field: value})
    msg = str(e.value)
    assert f"ContinuousBatchingConfig.{field}" in msg and fragment in msg and repr(value) in msg
    # Assignment after construction is validated too, and leaves the old value in place.
    c = ContinuousBatchingConfig()
    old = getattr(c, field)
    with pytest.raises(ValueError):
        setattr(c, field, value)
    assert getattr(c, field) == old


@pytest.mark.parametrize(
    "field, value",
    [("page_size", 4), ("safety_margin", 0.0), ("safety_margin", 1.0), ("safety_margin", 0), ("max_memory_percent", 1),
     ("use_cuda_graph", (True, False)), ("use_cuda_graph", False), ("cpu_offload_space", None),
     ("cpu_offload_space", 2), ("cpu_group_timeout", None), ("max_blocks_per_request", 0),
     ("varlen_compile_config", {"mode": "default"}), ("default_compile_level", 3)],
)
def test_boundary_values_accepted(field: str, value) -> None:
    c = ContinuousBatchingConfig(**{field: value})
    assert getattr(c, field) == (tuple(value) if isinstance(value, list) else value)


def test_use_cuda_graph_list_becomes_tuple() -> None:
    c = ContinuousBatchingConfig(use_cuda_graph=[True, False])
    assert c.use_cuda_graph == (True, False) and c.cuda_graph_booleans == (True, False)
    assert ContinuousBatchingConfig(use_cuda_graph=True).cuda_graph_booleans == (True, True)


def test_deprecated_aliases() -> None:
    with pytest.warns(FutureWarning):
        c = ContinuousBatchingConfig(block_size=32)
    assert c.page_size == 32 and c.block_size is None
    with pytest.raises(ValueError, match="block_size"):
        ContinuousBatchingConfig(block_size=2)
    assert ContinuousBatchingConfig(use_default_compile_configs=True).default_compile_level == 3
    assert ContinuousBatchingConfig(use_default_compile_configs=False, default_compile_level=2).default_compile_level == 0


# ------------------------------------------------------------------------------------------------ resolution
def test_resolve_cpu() -> None:
    user = ContinuousBatchingConfig(page_size=16)
    r = user.resolve("cpu")
    assert user == ContinuousBatchingConfig(page_size=16), "resolve() must not mutate the user's object"
    assert r is not user
    assert r.max_batch_tokens == 512
    assert r.max_memory_percent == 0.6
    assert r.max_requests_per_batch == 512  # 1024 capped at max_batch_tokens
    assert r.max_blocks_per_request == 32
    assert r.use_cuda_graph == (False, False)
    assert r.use_async_batching is False
    assert r.q_padding_interval_size == 64 and r.kv_padding_interval_size == 16384
    assert r.safety_margin == 0.15
    assert r.num_blocks is None  # sized from memory later
    assert r.seed is None


def test_resolve_cuda_and_device_strings() -> None:
    r = ContinuousBatchingConfig().resolve("cuda")
    assert r.max_batch_tokens == 8192
    assert r.max_memory_percent == 0.9
    assert r.max_requests_per_batch == 1024
    assert r.use_cuda_graph == (True, True)
    assert r.use_async_batching is True
    assert ContinuousBatchingConfig().resolve("cuda:0") == r
    mps = ContinuousBatchingConfig().resolve("mps")
    assert mps.max_memory_percent == 0.6 and mps.use_cuda_graph == (False, False)


def test_resolve_keeps_user_values() -> None:
    user = ContinuousBatchingConfig(
        max_batch_tokens=100, max_requests_per_batch=7, max_memory_percent=0.5, q_padding_interval_size=8,
        kv_padding_interval_size=1024, scheduler_type="prefill_first", use_cuda_graph=(False, True),
        use_async_batching=False, max_blocks_per_request=0, num_blocks=12,
    )
    r = user.resolve("cuda")
    assert (r.max_batch_tokens, r.max_requests_per_batch, r.max_memory_percent) == (100, 7, 0.5)
    assert (r.q_padding_interval_size, r.kv_padding_interval_size) == (8, 1024)
    assert r.safety_margin == 0.0
    assert r.use_cuda_graph == (False, True) and r.use_async_batching is False
    assert r.max_blocks_per_request == 0 and r.num_blocks == 12
    # max_requests_per_batch is capped at max_batch_tokens
    assert ContinuousBatchingConfig(max_batch_tokens=4, max_requests_per_batch=64).resolve().max_requests_per_batch == 4
    # no async without CUDA graphs support
    assert ContinuousBatchingConfig(use_async_batching=True).resolve("cpu").use_async_batching is False
    # resolving twice changes nothing
    assert r.resolve("cuda") == r


def test_every_none_field_is_documented() -> None:
    doc = config_module.__doc__
    for name in ("num_blocks", "max_batch_tokens", "max_memory_percent", "max_requests_per_batch",
                 "max_blocks_per_request", "use_cuda_graph", "use_async_batching", "q_padding_interval_size",
                 "kv_padding_interval_size", "safety_margin", "seed", "cpu_offload_space"):
        assert name in doc, name


# ------------------------------------------------------------------------------------------------ transformers
def test_round_trip_through_transformers() -> None:
    c = ContinuousBatchingConfig(page_size=16, num_blocks=80, max_batch_tokens=512, scheduler_type="prefill_first",
                                 safety_margin=0.3, allow_block_sharing=False, cpu_offload_space=1.5, seed=7,
                                 use_cuda_graph=(True, False), max_queue_size=3, return_logprobs=True)
    hf = c.to_transformers()
    assert isinstance(hf, HF)
    for name in TRANSFORMERS_FIELDS:
        if name in ("block_size", "use_default_compile_configs", "max_cached_graphs"):
            continue
        assert getattr(hf, name) == getattr(c, name), name
    back = ContinuousBatchingConfig.from_transformers(hf)
    assert back == c
    # And from transformers' own default object.
    assert ContinuousBatchingConfig.from_transformers(HF()) == ContinuousBatchingConfig()
    # A resolved config round-trips too.
    r = c.resolve("cpu")
    assert ContinuousBatchingConfig.from_transformers(r.to_transformers()) == r


def test_cbnb_only_field_is_dropped_for_transformers() -> None:
    c = ContinuousBatchingConfig(prefix_eviction="lru")
    hf = c.to_transformers()
    assert not hasattr(hf, "prefix_eviction")
    assert "prefix_eviction" not in c.transformers_dict()
    assert ContinuousBatchingConfig.from_transformers(hf).prefix_eviction == "transformers"


def test_from_transformers_deprecated_fields() -> None:
    hf = HF(block_size=32)
    assert hf.page_size == 32
    c = ContinuousBatchingConfig.from_transformers(hf)
    assert c.page_size == 32 and c.block_size is None
    assert ContinuousBatchingConfig.from_transformers({"block_size": 64}).page_size == 64
    assert ContinuousBatchingConfig.from_transformers({"use_default_compile_configs": True}).default_compile_level == 3
    assert ContinuousBatchingConfig.from_transformers({"page_size": 8, "unknown": 1}).page_size == 8


def test_from_transformers_validates() -> None:
    with pytest.raises(ValueError, match="scheduler_type"):
        ContinuousBatchingConfig.from_transformers(HF(scheduler_type="bogus"))  # transformers falls back silently
    with pytest.raises(ValueError, match="page_size"):
        ContinuousBatchingConfig.from_transformers({"page_size": 2})


def test_compile_config_dict_round_trip() -> None:
    c = ContinuousBatchingConfig(varlen_compile_config={"mode": "default", "dynamic": True})
    hf = c.to_transformers()
    assert type(hf.varlen_compile_config).__name__ == "CompileConfig"
    back = ContinuousBatchingConfig.from_transformers(hf)
    assert back.varlen_compile_config is hf.varlen_compile_config


def test_to_code_is_runnable_and_equivalent() -> None:
    c = ContinuousBatchingConfig(page_size=16, num_blocks=80, max_batch_tokens=512, use_cuda_graph=(False, False),
                                 scheduler_type="prefill_first", prefix_eviction="lru")
    code = c.to_code()
    assert "prefix_eviction" not in code
    assert "page_size=16" in code and "allow_block_sharing" not in code
    ns: dict = {}
    exec(code, ns)  # noqa: S102 - generated code
    assert ns["config"] == c.to_transformers()
    full = c.to_code(only_changed=False)
    assert "allow_block_sharing=True" in full
    ns = {}
    exec(ContinuousBatchingConfig().to_code(), ns)
    assert ns["config"] == HF()


def test_copy_diff_to_dict() -> None:
    c = ContinuousBatchingConfig()
    d = c.copy(page_size=32, scheduler_type="prefill_first")
    assert c.page_size == 256 and d.page_size == 32
    assert c.diff(d) == {"page_size": (256, 32), "scheduler_type": ("fifo", "prefill_first")}
    with pytest.raises(ValueError):
        c.copy(page_size=1)
    assert c.to_dict()["page_size"] == 256 and len(c.to_dict()) == len(dataclasses.fields(c))
