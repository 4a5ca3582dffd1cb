"""Standard workloads (the design's table): deterministic prompts of random token ids, EOS ignored, greedy.

=================  ========  ==============================  ===================  ================  ==========
name               requests  prompt tokens                   new tokens           model             where
=================  ========  ==============================  ===================  ================  ==========
``cpu-32``         32        U[32, 256]                      32                   smollm2-135m fp32 CPU
``shared-prefix``  64        512 common + U[16, 64] own      32                   smollm2-135m      CPU, GPU
``long-gen``       16        U[16, 64]                       512 (small cache)    smollm2-135m      CPU
``nanovllm-256``   256       U[100, 1024]                    U[100, 1024]         shape:qwen3-0.6b  GPU
=================  ========  ==============================  ===================  ================  ==========

`scale` shrinks a workload for CI and notebooks: request counts and token counts are multiplied by it (at least 1
request, 1 new token and 4 prompt tokens), keeping the shape of the distribution. Token ids are drawn from
``[FIRST_ID, vocab_size)`` so that special tokens (low ids in SmolLM2 and Gemma) are avoided.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Workload", "WORKLOADS", "get_workload", "FIRST_ID"]

FIRST_ID = 32


@dataclass(frozen=True)
class Workload:
    """A list of requests plus the model and config hints they are meant for.

    Attributes:
        name: workload name.
        model: the model name `cbnb.load_model` takes.
        prompts: token ids per request.
        max_new_tokens: per request (EOS is ignored, so exactly this many are generated).
        config_hints: `ContinuousBatchingConfig` fields the workload is designed around (e.g. a small num_blocks).
        dtype: the dtype the workload is specified for.
    """

    name: str
    model: str
    prompts: list[list[int]]
    max_new_tokens: list[int]
    config_hints: dict[str, Any] = field(default_factory=dict)
    dtype: str = "float32"
    description: str = ""

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.max_new_tokens)


def _n(x: float, scale: float, lo: int = 1) -> int:
    return max(lo, int(round(x * scale)))


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab) for _ in range(n)]


def _cpu32(rng: random.Random, vocab: int, scale: float) -> Workload:
    n = _n(32, scale)
    prompts = [_ids(rng, _n(rng.randint(32, 256), scale, 4), vocab) for _ in range(n)]
    return Workload("cpu-32", "smollm2-135m", prompts, [_n(32, scale)] * n,
                    {"page_size": 256, "num_blocks": 80, "max_batch_tokens": 512},
                    description="32 prompts of U[32,256] tokens, 32 new tokens each, on CPU")


def _shared(rng: random.Random, vocab: int, scale: float) -> Workload:
    n = _n(64, scale)
    common = _ids(rng, _n(512, scale, 4), vocab)
    prompts = [common + _ids(rng, _n(rng.randint(16, 64), scale), vocab) for _ in range(n)]
    return Workload("shared-prefix", "smollm2-135m", prompts, [_n(32, scale)] * n,
                    {"page_size": 16, "max_batch_tokens": 512},
                    description="64 prompts sharing a 512-token system prompt, 32 new tokens each")


def _longgen(rng: random.Random, vocab: int, scale: float) -> Workload:
    n = _n(16, scale)
    prompts = [_ids(rng, _n(rng.randint(16, 64), scale, 4), vocab) for _ in range(n)]
    gen = _n(512, scale)
    # A cache for about a quarter of the final tokens, so requests must be offloaded or soft-reset, but never
    # smaller than two of the longest requests (one must always fit whole, or it would fail instead).
    total = sum(len(p) + gen for p in prompts)
    page = 16
    longest = max(len(p) for p in prompts) + gen
    blocks = max(total // (4 * page), 2 * -(-longest // page))
    return Workload("long-gen", "smollm2-135m", prompts, [gen] * n,
                    {"page_size": page, "num_blocks": blocks, "max_batch_tokens": 256},
                    description="16 short prompts generating 512 tokens each in a cache too small for all")


def _nanovllm(rng: random.Random, vocab: int, scale: float) -> Workload:
    n = _n(256, scale)
    prompts = [_ids(rng, _n(rng.randint(100, 1024), scale, 4), vocab) for _ in range(n)]
    gens = [_n(rng.randint(100, 1024), scale) for _ in range(n)]
    return Workload("nanovllm-256", "shape:qwen3-0.6b", prompts, gens, {}, dtype="bfloat16",
                    description="nano-vllm's benchmark: 256 requests, random ids, U[100,1024] in and out")


_BUILDERS = {"cpu-32": _cpu32, "shared-prefix": _shared, "long-gen": _longgen, "nanovllm-256": _nanovllm}
WORKLOADS: tuple[str, ...] = tuple(_BUILDERS)
_DEFAULT_VOCAB = {"smollm2-135m": 49152, "shape:qwen3-0.6b": 151936}


def get_workload(name: str, *, vocab_size: int | None = None, seed: int = 0, scale: float = 1.0) -> Workload:
    """Build a standard workload.

    Args:
        name: one of `WORKLOADS`.
        vocab_size: ids are drawn below it (default: the workload model's vocabulary).
        seed: RNG seed (the same seed gives the same workload).
        scale: multiply request and token counts (0 < scale <= 1 shrinks it for CI/notebooks).

    Raises:
        ValueError: unknown name (lists the choices) or a non-positive scale / too small vocabulary.
    """
    if name not in _BUILDERS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    if not (scale > 0):
        raise ValueError(f"scale must be > 0; got {scale!r}")
    model = {"cpu-32": "smollm2-135m", "shared-prefix": "smollm2-135m", "long-gen": "smollm2-135m",
             "nanovllm-256": "shape:qwen3-0.6b"}[name]
    vocab = vocab_size or _DEFAULT_VOCAB[model]
    if vocab <= FIRST_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ID}; got {vocab}")
    return _BUILDERS[name](random.Random(f"{name}:{seed}"), vocab, scale)
