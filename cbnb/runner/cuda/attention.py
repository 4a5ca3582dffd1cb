"""The CUDA runner's attention hook: transformers' attention implementation "cbnb_cuda", which sends each layer of a
`CudaModelRunner` forward to the Triton paged-attention kernels (`cbnb.runner.cuda.triton_attention.paged_attention`)
through the step's `CudaStepBatch`, and anything else to the CPU path's "cbnb_paged"."""

from __future__ import annotations

from typing import Any

import torch

from ..cpu.attention import paged_attention_forward, register as register_cpu_attention
from ..kv import KVStore
from .triton_attention import paged_attention

__all__ = ["CUDA_ATTN_NAME", "CudaStepBatch", "cuda_attention_forward", "register_cuda_attention"]

CUDA_ATTN_NAME = "cbnb_cuda"
_registered = False


class CudaStepBatch:
    """What each attention layer of a CUDA-runner forward needs (passed as the `cbnb_batch` keyword).

    Attributes:
        meta: step metadata (device int32 tensors ``q_start``, ``q_len``, ``past``, ``dec_seq``, ``tile_seq``,
            ``tile_m0`` and flags ``has_prefill``, ``has_decode``).
        groups: per layer group, ``slots``, ``table``, ``window`` (0: full attention) and ``num_splits``.
        layer_group: layer -> (group, index in group); store: the `KVStore`; impl: "triton" or "torch".
    """

    def __init__(self, meta: Any, groups: list[Any], layer_group: list[tuple[int, int]], store: KVStore,
                 impl: str) -> None:
        self.meta = meta
        self.groups = groups
        self.layer_group = layer_group
        self.store = store
        self.impl = impl

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               scaling: float | None) -> torch.Tensor:
        """One layer: query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]`` -> ``[1, T, H, D]``."""
        layer = module.layer_idx
        g = self.layer_group[layer][0]
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        out = paged_attention(q, k, v, self.store.k[layer], self.store.v[layer], self.meta, self.groups[g], scale,
                              self.impl)
        return out.unsqueeze(0)


def cuda_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                           **kwargs: Any) -> tuple[torch.Tensor, None]:
    """"cbnb_cuda" attention: a `CudaStepBatch` goes to the paged kernels; anything else to "cbnb_paged" (which
    falls back to sdpa without a batch, e.g. a plain ``model.generate`` while an engine holds the model)."""
    batch = kwargs.get("cbnb_batch")
    if isinstance(batch, CudaStepBatch):
        if kwargs.get("softcap") is not None:
            raise NotImplementedError("cbnb_cuda attention does not support attention-logit soft-capping")
        return batch.attend(module, query, key, value, scaling), None
    return paged_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                   **kwargs)


def register_cuda_attention() -> None:
    """Register "cbnb_cuda" (attention and sdpa's mask function, as "cbnb_paged" does). Idempotent."""
    global _registered
    if _registered:
        return
    register_cpu_attention()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CUDA_ATTN_NAME, cuda_attention_forward)
    AttentionMaskInterface.register(CUDA_ATTN_NAME, sdpa_mask)
    _registered = True
