"""cbnb's paged attention, registered in transformers' `AttentionInterface` as "cbnb_paged".

transformers models call it once per attention layer with the layer's query/key/value after RoPE
(query ``[1, H, T, D]``, key/value ``[1, Hkv, T, D]``, T = the step's packed query tokens). The step's metadata
arrives as the `cbnb_batch` keyword argument (a `StepBatch`), which the model forwards untouched to attention.

Per layer:

1. "ring" prefill rows (sliding layers with a past) read their previous ``window - 1`` tokens first;
2. every token's K/V is written into its page through the slot mapping (``k_pages[block, offset] = k``);
3. decode rows attend over their own pages: with the CPU kernel, all of them in one call reading the pages in
   place (`cbnb.runner.cpu.cpu_kernels`); otherwise in place when a row's keys fit one page, else in one batched call
   over gathered pages (padded with the zero block, masked);
4. prefill rows of full-attention layers: with the CPU kernel, all of them in one causal call over their pages;
   otherwise (and on sliding layers) one by one: "fresh" over the chunk itself (causal), "paged" over their pages,
   "ring" over the window's previous keys and the chunk.

GQA is handled by `scaled_dot_product_attention(..., enable_gqa=True)`; nothing is repeated. No mask spans the
whole cache: masks cover each request's own keys only. Without `cbnb_batch` (a plain `model.generate` while the
engine has the model), the call falls back to transformers' sdpa.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.nn.functional as F

from . import cpu_kernels, layer_ops

__all__ = ["ATTN_NAME", "register", "paged_attention_forward", "paged_attention", "paged_attention_op",
           "current_batch"]

#: The `StepBatch` of the compiled forward running on this thread (``.batch``; published by `cbnb.runner.cpu.compiled`).
step_local = threading.local()


def current_batch() -> Any:
    """The `StepBatch` of the compiled forward running on this thread (None outside one)."""
    return getattr(step_local, "batch", None)

ATTN_NAME = "cbnb_paged"
_registered = False


def _sdpa(q, k, v, mask, causal, scale):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                          enable_gqa=True)


def _gather_pages(pages: torch.Tensor, table: torch.Tensor, keys: int) -> torch.Tensor:
    """Keys/values of the pages in `table` ``[B, W]``, flattened to ``[B, keys, Hkv, D]`` (the first `keys` slots).

    A page's slots are contiguous in the pool, so one `index_select` over whole pages is the cheapest gather.
    """
    nb, page, hkv, d = pages.shape
    rows = pages.reshape(nb, page * hkv * d).index_select(0, table.reshape(-1))
    return rows.view(table.shape[0], table.shape[1] * page, hkv, d)[:, :keys]


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over the paged cache for one layer. Returns ``([1, T, H, D], None)``.

    Raises:
        NotImplementedError: for attention-logit soft-capping (no supported model uses it).
    """
    if kwargs.get("cbnb_compiled"):  # inside cbnb's compiled forward: the opaque op (cbnb.runner.cpu.compiled)
        if kwargs.get("softcap") is not None:
            raise NotImplementedError("cbnb_paged attention does not support attention-logit soft-capping")
        scale = float(scaling) if scaling is not None else query.shape[-1] ** -0.5
        return paged_attention_op(query, key, value, module.layer_idx, scale), None
    batch = kwargs.get("cbnb_batch")
    if batch is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("cbnb_paged attention does not support attention-logit soft-capping")
    out = paged_attention(batch, module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1),
                          value[0].transpose(0, 1), scaling)
    return out.unsqueeze(0), None


def paged_attention(batch: Any, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scaling: float | None) -> torch.Tensor:
    """Layer `layer`'s attention for the step `batch` (a `StepBatch`): writes the step's K/V into the pages, then
    attends (the steps of the module docstring). `q` ``[T, H, D]``, `k` and `v` ``[T, Hkv, D]`` (the step's packed
    tokens, any strides); returns ``[T, H, D]``. `scaling` None: ``D ** -0.5``. Called by
    `paged_attention_forward`, and directly by the CPU decoder-layer forward (`cbnb.runner.cpu.cpu_layers`), which
    has q, k and v in this layout already."""
    g, _ = batch.layer_group[layer]
    gb = batch.groups[g]
    k_pages = batch.store.k[layer]
    v_pages = batch.store.v[layer]
    if (gb.dec_lens is not None or gb.pre_counts is not None) and q.stride(-1) != 1:
        q = q.contiguous()  # the kernels read rows of contiguous head vectors
    out = torch.empty_like(q)

    old = {}
    for row in gb.prefill:
        if row.mode == "ring":
            old[id(row)] = (k_pages[row.old_blocks, row.old_offsets], v_pages[row.old_blocks, row.old_offsets])

    if gb.write_rows is not None:
        # One `index_copy_` per K and V over the pool's token rows (advanced indexing costs ~10x more per call).
        rows, base = batch.store.token_rows, batch.store.layer_row_offset[layer]
        page = k_pages.shape[1]
        k2, v2 = k.reshape(k.shape[0], -1).to(rows.dtype), v.reshape(v.shape[0], -1).to(rows.dtype)
        if rows.dtype == torch.float32 and rows.device.type == "cpu" and layer_ops.available():
            layer_ops.write_kv(rows, gb.write_rows, base, base + page, k2, v2)  # one C call, same bytes
        else:
            rows.index_copy_(0, gb.write_rows + base, k2)
            rows.index_copy_(0, gb.write_rows + (base + page), v2)
    else:
        k_pages[gb.write_blocks, gb.write_offsets] = k.to(k_pages.dtype)
        v_pages[gb.write_blocks, gb.write_offsets] = v.to(v_pages.dtype)

    scale = scaling if scaling is not None else q.shape[-1] ** -0.5  # the C kernels' (sdpa takes None itself)
    if gb.dec_lens is not None:
        cpu_kernels.paged_decode(q, k_pages, v_pages, gb.dec_rows, gb.dec_pages, gb.dec_lens, gb.dec_keys, scale,
                                 out)

    if gb.pre_counts is not None:  # after the write: the chunks' own K/V are in their pages
        cpu_kernels.paged_prefill(q, k_pages, v_pages, gb.pre_rows, gb.pre_starts, gb.pre_counts, gb.pre_pages,
                                  scale, out)

    for row, page, valid in gb.dec_single:
        # In place: the page's first `valid` slots, viewed [1, Hkv, valid, D]; no mask needed.
        o = _sdpa(q[row:row + 1].unsqueeze(2), k_pages[page, :valid].transpose(0, 1).unsqueeze(0),
                  v_pages[page, :valid].transpose(0, 1).unsqueeze(0), None, False, scaling)
        out[row] = o[0, :, 0]

    if gb.dec_rows is not None and gb.dec_lens is None:
        kd = _gather_pages(k_pages, gb.dec_pages, gb.dec_keys).transpose(1, 2)  # [Bd, Hkv, keys, D]
        vd = _gather_pages(v_pages, gb.dec_pages, gb.dec_keys).transpose(1, 2)
        qd = q.index_select(0, gb.dec_rows).unsqueeze(2)  # [Bd, H, 1, D]
        od = _sdpa(qd, kd, vd, gb.dec_mask, False, scaling)
        out[gb.dec_rows] = od.squeeze(2)

    for row in gb.prefill:
        qs = q[row.a:row.b].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if row.mode == "fresh":
            ks, vs = k[row.a:row.b], v[row.a:row.b]
        elif row.mode == "paged":
            ks = _gather_pages(k_pages, row.pages.unsqueeze(0), row.length)[0]
            vs = _gather_pages(v_pages, row.pages.unsqueeze(0), row.length)[0]
        else:
            ok, ov = old[id(row)]
            ks = torch.cat([ok, k[row.a:row.b]], 0)
            vs = torch.cat([ov, v[row.a:row.b]], 0)
        o = _sdpa(qs, ks.transpose(0, 1).unsqueeze(0), vs.transpose(0, 1).unsqueeze(0), row.mask, True, scaling)
        out[row.a:row.b] = o[0].transpose(0, 1)
    return out


def register() -> None:
    """Register "cbnb_paged" in transformers' `AttentionInterface` and `AttentionMaskInterface` (idempotent).

    The mask function is sdpa's: a plain forward (no `cbnb_batch`, e.g. ``model.generate`` while an engine holds the
    model) falls back to sdpa attention and needs sdpa's masks. Without a registered mask function transformers
    builds no mask at all for an unknown implementation, so sliding-window layers would attend causally over the
    whole sequence. Engine forwards skip mask creation (the runner passes a prepared dummy mask).
    """
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    _registered = True


# ------------------------------------------------------------------------------------------------ the opaque op
@torch.library.custom_op("cbnb::paged_attention", mutates_args=())
def paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int,
                       scaling: float) -> torch.Tensor:
    """cbnb's paged attention for layer `layer` of the current step (`current_batch()`); ``[1, T, H, D]``.

    Writes the step's K/V into the cache pool (a side effect the compiler does not see: each layer's call depends
    on the previous layer's output, so the order holds).
    """
    batch = current_batch()
    if batch is None:
        raise RuntimeError("cbnb::paged_attention called outside a compiled cbnb step")
    out, _ = paged_attention_forward(_Layer(layer), query, key, value, None, scaling=scaling, cbnb_batch=batch)
    return out.contiguous()


@paged_attention_op.register_fake
def _(query, key, value, layer, scaling):
    return query.new_empty(query.shape[0], query.shape[2], query.shape[1], query.shape[3])


class _Layer:
    __slots__ = ("layer_idx",)

    def __init__(self, layer_idx: int) -> None:
        self.layer_idx = layer_idx
