"""The scheduling policies by name (`ContinuousBatchingConfig.scheduler_type`), torch-free.

- "fifo", "prefill_first": transformers' schedulers (`cbnb.core.scheduler`), with cbnb's fixes;
- "vllm": vLLM V1's policy (`cbnb.core.vllm_scheduler`): running requests first, recompute preemption, strict FCFS
  admission, its watermark.
"""

from __future__ import annotations

from .cache.manager import CacheManager
from .config import ContinuousBatchingConfig
from .scheduler import FIFOScheduler, PrefillFirstScheduler, Scheduler
from .vllm_scheduler import VLLMScheduler

__all__ = ["SCHEDULERS", "make_scheduler"]

SCHEDULERS: dict[str, type[Scheduler]] = {"fifo": FIFOScheduler, "prefill_first": PrefillFirstScheduler,
                                          "vllm": VLLMScheduler}


def make_scheduler(config: ContinuousBatchingConfig, cache: CacheManager) -> Scheduler:
    """The scheduler named by `config.scheduler_type`.

    Raises:
        ValueError: for an unknown name, listing the choices.
    """
    cls = SCHEDULERS.get(config.scheduler_type)
    if cls is None:
        raise ValueError(f"scheduler_type must be one of {', '.join(map(repr, SCHEDULERS))}; "
                         f"got {config.scheduler_type!r}")
    return cls(config, cache)
