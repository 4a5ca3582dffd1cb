"""`make_runner`: which runner executes an engine's steps (the one place that chooses, and the only reader of
``CBNB_CUDA_RUNNER``).

- a KV store on a CUDA device gets `CudaModelRunner` (Triton paged attention, CUDA graphs, async batching);
- anything else gets `ModelRunner` (the CPU path: torch attention over the paged cache, eager).

``CBNB_CUDA_RUNNER=0`` keeps the CPU-path runner on CUDA (debugging); ``CBNB_CUDA_RUNNER=fake`` builds the CUDA
runner on any device (CPU smoke runs: fake graphs, the kernels' torch references).

`cuda_runner` imports `model_runner` (it subclasses `ModelRunner`) and nothing imports back: the choice lives
here, so the two runner modules form no import cycle.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ..core.plan import KVGeometry
from .kv import KVStore
from .model_runner import ModelRunner

__all__ = ["make_runner", "runner_kind"]


def runner_kind(device: torch.device | str | None) -> str:
    """"cuda" or "cpu": the runner `make_runner` builds for a KV store on `device` (honours CBNB_CUDA_RUNNER)."""
    mode = os.environ.get("CBNB_CUDA_RUNNER", "1")
    on_cuda = torch.device(device).type == "cuda" if device is not None else False
    return "cuda" if mode != "0" and (on_cuda or mode == "fake") else "cpu"


def make_runner(model: torch.nn.Module, geometry: KVGeometry, store: KVStore, seed: int | None = None,
                **kwargs: Any) -> ModelRunner:
    """The runner for `store`'s device (see the module docstring), built from the cache's plain `geometry`
    (`CacheManager.geometry()`); `kwargs` go to `CudaModelRunner` only."""
    if runner_kind(getattr(store, "device", None)) == "cuda":
        from .cuda.cuda_runner import CudaModelRunner  # Triton and the graph machinery load only when used

        return CudaModelRunner(model, geometry, store, seed, **kwargs)
    return ModelRunner(model, geometry, store, seed)
