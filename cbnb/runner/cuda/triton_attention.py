"""Paged attention for the CUDA runner: Triton kernels that read the KV pages in place, and their PyTorch references.

Everything here works on one layer of one step, over *static* metadata tensors (int32, on the device) that the CUDA
runner packs once per step (`cbnb.runner.cuda.cuda_runner`). Nothing is gathered from the whole cache and no mask is
built: each program reads only the pages of its own request through the block table.

Metadata (per step; ``R`` sequence slots, ``T`` query rows, padded slots have ``q_len == 0``):

- ``q_start[R]``, ``q_len[R]``, ``past[R]``: the request's query rows ``[q_start, q_start + q_len)`` sit at positions
  ``past .. past + q_len - 1``;
- ``table[R, W]`` (per layer group): the request's block table (block ids of the group's allocator);
- ``slots[T]`` (per layer group): flat write slot ``block * page_size + offset`` of every query row (padded rows and
  tokens a sliding layer drops point at the write-padding block);
- ``dec_seq[Rd]``: the slots decoded by the split-KV decode kernel (one query token), -1 for unused entries;
- ``tile_seq[NT]``, ``tile_m0[NT]``: the prefill work list, one entry per ``BLOCK_M`` query rows of a multi-token
  chunk (-1: unused entry).

Sliding-window layers keep a ring of ``window`` slots per request: position ``p`` lives at ring index ``p % window``,
i.e. block ``table[(p % window) // page_size]``, offset ``(p % window) % page_size`` (`SlidingAttentionCacheAllocator`).
A full-attention layer stores position ``p`` at ``table[p // page_size]``, offset ``p % page_size``.

Order inside a layer (`paged_attention`), which makes ring overwrites safe without any copy:

1. **prefill** (chunks of 2+ tokens, with or without a past: fresh prompts, prefix hits, chunked prefill): the past
   positions ``[lo, past)`` are read from the pages *before* this step writes anything (so a chunk that wraps a
   sliding ring still sees the keys it is about to overwrite) and the chunk's own keys come from the new K/V tensors;
   causal and sliding-window masks are computed from positions;
2. **store**: every row's new K/V is written to its slot;
3. **decode** (one query token): keys ``[lo, p]`` (its own included) are read from the pages after the store;
   split-KV: programs over (request, KV head, split), all query heads of a GQA group in one program, online softmax,
   then a reduce kernel combines the splits.

Kernels accumulate in fp32 (bf16/fp16/fp32 inputs; fp32 dots use IEEE precision, not TF32). Each kernel has a
PyTorch reference (``ref_*``) with the same signature, computed in fp32 from the same pages; the tests check
kernel == reference under ``TRITON_INTERPRET=1``, and the CUDA runner can use the references as its attention
(``attention="torch"``) on CPU, where they drive whole-engine tests of the GPU path's batching logic.

Triton features used are limited to what Triton 3.6 has (loads/stores with masks, `tl.dot` with `input_precision`,
`tl.exp2`, runtime-bounded loops).
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:  # Triton is optional: the CPU path never needs it.
    import triton
    import triton.language as tl

    HAS_TRITON = True
    TRITON_ERROR = ""
except Exception as _e:  # pragma: no cover - depends on the environment
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]
    HAS_TRITON = False
    TRITON_ERROR = f"{type(_e).__name__}: {_e}"

__all__ = [
    "HAS_TRITON", "TRITON_ERROR", "LOG2E", "KernelConfig", "kernel_config", "num_decode_splits",
    "store_kv", "paged_decode", "paged_prefill", "ref_store_kv", "ref_paged_decode", "ref_paged_prefill",
    "paged_attention",
]

LOG2E = 1.4426950408889634


class KernelConfig:
    """Block sizes for one head_dim (fixed, not autotuned: graphs need a fixed launch per shape)."""

    def __init__(self, head_dim: int) -> None:
        self.head_dim = head_dim
        self.block_d = max(16, 1 << (head_dim - 1).bit_length())
        big = self.block_d > 128
        self.prefill_m = 32 if big else 64
        self.prefill_n = 32 if big else 64
        self.decode_n = 32 if big else 64
        self.num_warps = 4
        self.num_stages = 2


_CONFIGS: dict[int, KernelConfig] = {}


def kernel_config(head_dim: int) -> KernelConfig:
    cfg = _CONFIGS.get(head_dim)
    if cfg is None:
        cfg = _CONFIGS[head_dim] = KernelConfig(head_dim)
    return cfg


def num_decode_splits(num_seqs: int, num_kv_heads: int, kv_len: int, num_sms: int, *, min_chunk: int = 256,
                      max_splits: int = 64) -> int:
    """Splits per (request, KV head) for the decode kernel: enough programs for about two waves of `num_sms`
    multiprocessors, each split reading at least `min_chunk` tokens of the longest request. A power of two (few
    kernel specialisations); a function of the padded shape only, so it is fixed per CUDA graph."""
    base = max(1, num_seqs * num_kv_heads)
    s = 1
    while s < max_splits and base * s * 2 <= 2 * num_sms and (s * 2) * min_chunk <= max(kv_len, min_chunk):
        s *= 2
    return s


# ------------------------------------------------------------------------------------------------ Triton kernels
if HAS_TRITON:

    @triton.jit
    def _mm(a, b, PREC: tl.constexpr):
        """a @ b with fp32 accumulation. PREC 0: native (tensor cores; bf16/fp16), 1: fp32 inputs in IEEE precision
        (no TF32), 2: inputs upcast to fp32 (Triton's CPU interpreter mis-multiplies bf16 dots)."""
        if PREC == 1:
            r = tl.dot(a, b, input_precision="ieee")
        elif PREC == 2:
            r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            r = tl.dot(a, b)
        return r

    @triton.jit
    def _store_kv_kernel(K, V, KC, VC, SLOTS,
                         s_kt, s_kh, s_vt, s_vh, s_cb, s_cp, s_ch,
                         HKV: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr, P: tl.constexpr):
        t = tl.program_id(0)
        slot = tl.load(SLOTS + t).to(tl.int64)
        blk = slot // P
        off = slot % P
        h = tl.arange(0, BH)
        d = tl.arange(0, BD)
        m = (h[:, None] < HKV) & (d[None, :] < D) & ((h[:, None] * 0 + slot) >= 0)
        dst = blk * s_cb + off * s_cp + h[:, None] * s_ch + d[None, :]
        k = tl.load(K + t * s_kt + h[:, None] * s_kh + d[None, :], mask=m, other=0.0)
        tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=m)
        v = tl.load(V + t * s_vt + h[:, None] * s_vh + d[None, :], mask=m, other=0.0)
        tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=m)

    @triton.jit
    def _decode_kernel(Q, KC, VC, O, PO, PML,
                       DEC_SEQ, Q_START, PAST, TABLE,
                       qk_scale, window,
                       s_qt, s_qh, s_cb, s_cp, s_ch, s_tab, s_ot, s_oh,
                       H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                       P: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, SLIDING: tl.constexpr,
                       PREC: tl.constexpr):
        i = tl.program_id(0)
        kvh = tl.program_id(1)
        sp = tl.program_id(2)
        # Masks are built from vectors only (scalar booleans in masks trip Triton's interpreter).
        b_raw = tl.load(DEC_SEQ + i)
        vi = (b_raw >= 0).to(tl.int32)
        b = tl.maximum(b_raw, 0)
        p = tl.load(PAST + b)
        qrow = tl.load(Q_START + b)
        if SLIDING:
            lo = tl.maximum(p - window + 1, 0)
        else:
            lo = p * 0
        hi = lo + (p + 1 - lo) * vi
        chunk = tl.cdiv(tl.cdiv(hi - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        s0 = lo + sp * chunk
        s1 = tl.minimum(s0 + chunk, hi)
        g = tl.arange(0, GP)
        gm = (g < G) & ((g * 0 + vi) > 0)
        heads = kvh * G + g
        d = tl.arange(0, BD)
        dm = d < D
        q = tl.load(Q + qrow * s_qt + heads[:, None] * s_qh + d[None, :], mask=gm[:, None] & dm[None, :], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, BD], tl.float32)
        tab = TABLE + b.to(tl.int64) * s_tab
        for start in range(s0, s1, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pm = pos < s1
            if SLIDING:
                idx = pos % window
            else:
                idx = pos
            blk = tl.load(tab + idx // P, mask=pm, other=0).to(tl.int64)
            base = blk * s_cb + (idx % P).to(tl.int64) * s_cp + kvh * s_ch
            kvm = pm[:, None] & dm[None, :]
            k = tl.load(KC + base[:, None] + d[None, :], mask=kvm, other=0.0)
            s = _mm(q, tl.trans(k), PREC)
            s = tl.where(pm[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            pr = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(VC + base[:, None] + d[None, :], mask=kvm, other=0.0)
            acc = acc * alpha[:, None] + _mm(pr.to(v.dtype), v, PREC)
            m_i = m_new
        om = gm[:, None] & dm[None, :]
        if NUM_SPLITS == 1:
            o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(O + qrow * s_ot + heads[:, None] * s_oh + d[None, :], o.to(O.dtype.element_ty), mask=om)
        else:
            row = (i * H + heads) * NUM_SPLITS + sp  # [GP]
            tl.store(PO + row[:, None] * BD + d[None, :], acc, mask=om)
            tl.store(PML + row * 2, m_i, mask=gm)
            tl.store(PML + row * 2 + 1, l_i, mask=gm)

    @triton.jit
    def _decode_reduce_kernel(O, PO, PML, DEC_SEQ, Q_START, s_ot, s_oh,
                              H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                              NSP: tl.constexpr):
        i = tl.program_id(0)
        h = tl.program_id(1)
        b_raw = tl.load(DEC_SEQ + i)
        vi = (b_raw >= 0).to(tl.int32)
        qrow = tl.load(Q_START + tl.maximum(b_raw, 0))
        s = tl.arange(0, NSP)
        sm = (s < NUM_SPLITS) & ((s * 0 + vi) > 0)
        row = (i * H + h) * NUM_SPLITS + s
        m = tl.load(PML + row * 2, mask=sm, other=float("-inf"))
        l = tl.load(PML + row * 2 + 1, mask=sm, other=0.0)
        mx = tl.max(m, 0)
        mx = tl.where(mx == float("-inf"), 0.0, mx)
        w = tl.exp2(m - mx)
        total = tl.sum(w * l, 0)
        d = tl.arange(0, BD)
        dm = d < D
        po = tl.load(PO + row[:, None] * BD + d[None, :], mask=sm[:, None] & dm[None, :], other=0.0)
        o = tl.sum(po * w[:, None], 0) / tl.where(total > 0, total, 1.0)
        tl.store(O + qrow * s_ot + h * s_oh + d, o.to(O.dtype.element_ty), mask=dm & ((d * 0 + vi) > 0))

    @triton.jit
    def _prefill_kernel(Q, K, V, KC, VC, O,
                        TILE_SEQ, TILE_M0, Q_START, Q_LEN, PAST, TABLE,
                        qk_scale, window,
                        s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_cb, s_cp, s_ch, s_tab, s_ot, s_oh,
                        G: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, P: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING: tl.constexpr, PREC: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // G
        b_raw = tl.load(TILE_SEQ + t)
        vi = (b_raw >= 0).to(tl.int32)
        b = tl.maximum(b_raw, 0)
        m0 = tl.load(TILE_M0 + t)
        qs = tl.load(Q_START + b)
        n = tl.load(Q_LEN + b) * vi
        past = tl.load(PAST + b)
        rows = m0 + tl.arange(0, BLOCK_M)
        rm = rows < n
        qpos = past + rows
        d = tl.arange(0, BD)
        dm = d < D
        q = tl.load(Q + (qs + rows)[:, None] * s_qt + h * s_qh + d[None, :], mask=rm[:, None] & dm[None, :],
                    other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BD], tl.float32)
        busy = (m0 < n).to(tl.int32)
        # Phase 1: the request's cached past [lo, past), read before this step's writes.
        if SLIDING:
            lo = tl.maximum(past + m0 - window + 1, 0)
        else:
            lo = past * 0
        hi = lo + (past - lo) * busy
        tab = TABLE + b.to(tl.int64) * s_tab
        for start in range(lo, hi, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pm = pos < hi
            if SLIDING:
                idx = pos % window
            else:
                idx = pos
            blk = tl.load(tab + idx // P, mask=pm, other=0).to(tl.int64)
            base = blk * s_cb + (idx % P).to(tl.int64) * s_cp + kvh * s_ch
            kvm = pm[:, None] & dm[None, :]
            k = tl.load(KC + base[:, None] + d[None, :], mask=kvm, other=0.0)
            s = _mm(q, tl.trans(k), PREC)
            msk = pm[None, :] & rm[:, None]
            if SLIDING:
                msk = msk & (pos[None, :] > qpos[:, None] - window)
            s = tl.where(msk, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(VC + base[:, None] + d[None, :], mask=kvm, other=0.0)
            acc = acc * alpha[:, None] + _mm(pr.to(v.dtype), v, PREC)
            m_i = m_new
        # Phase 2: the chunk's own keys (causal), from the new K/V tensors.
        if SLIDING:
            jlo = tl.maximum(m0 - window + 1, 0)
        else:
            jlo = m0 * 0
        jhi = jlo + (tl.minimum(n, m0 + BLOCK_M) - jlo) * busy
        for start in range(jlo, jhi, BLOCK_N):
            j = start + tl.arange(0, BLOCK_N)
            jm = j < jhi
            kvm = jm[:, None] & dm[None, :]
            k = tl.load(K + (qs + j)[:, None] * s_kt + kvh * s_kh + d[None, :], mask=kvm, other=0.0)
            s = _mm(q, tl.trans(k), PREC)
            msk = jm[None, :] & (j[None, :] <= rows[:, None]) & rm[:, None]
            if SLIDING:
                msk = msk & (j[None, :] > rows[:, None] - window)
            s = tl.where(msk, s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            pr = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pr, 1)
            v = tl.load(V + (qs + j)[:, None] * s_vt + kvh * s_vh + d[None, :], mask=kvm, other=0.0)
            acc = acc * alpha[:, None] + _mm(pr.to(v.dtype), v, PREC)
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(O + (qs + rows)[:, None] * s_ot + h * s_oh + d[None, :], o.to(O.dtype.element_ty),
                 mask=rm[:, None] & dm[None, :])


def _require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError(f"Triton is not available ({TRITON_ERROR}); use attention='torch'")


def _prec(dtype: torch.dtype) -> int:
    if dtype == torch.float32:
        return 1
    if dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return 2
    return 0


def _last_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _cache_strides(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError(f"K/V page views must share strides with a unit last stride; got {k_cache.stride()} and "
                         f"{v_cache.stride()}")
    return k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)


# ------------------------------------------------------------------------------------------------ wrappers
def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write ``k``/``v`` ``[T, Hkv, D]`` into the pages at ``slots[T]`` (flat ``block * P + offset``; < 0: skip)."""
    _require_triton()
    k, v = _last_contiguous(k), _last_contiguous(v)
    T, hkv, D = k.shape
    if T == 0:
        return
    cfg = kernel_config(D)
    s_cb, s_cp, s_ch = _cache_strides(k_cache, v_cache)
    _store_kv_kernel[(T,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                           s_cb, s_cp, s_ch, HKV=hkv, D=D, BH=max(2, 1 << (hkv - 1).bit_length()), BD=cfg.block_d,
                           P=k_cache.shape[1], num_warps=cfg.num_warps)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                 dec_seq: torch.Tensor, q_start: torch.Tensor, past: torch.Tensor, table: torch.Tensor,
                 scale: float, window: int, num_splits: int = 1) -> None:
    """Decode attention of the slots in ``dec_seq`` (one query row each) over their pages, written into ``out``.

    Args:
        q: ``[T, H, D]`` queries (last dim contiguous); out: ``[T, H, D]``.
        k_cache, v_cache: the layer's page views ``[num_blocks, P, Hkv, D]`` (strided).
        table: ``[R, W]`` int32 block table; window: sliding window (0: full attention).
        num_splits: KV splits per (request, KV head); > 1 adds a reduce kernel.
    """
    _require_triton()
    q = _last_contiguous(q)
    nd = dec_seq.shape[0]
    if nd == 0:
        return
    T, H, D = q.shape
    hkv = k_cache.shape[2]
    G = H // hkv
    cfg = kernel_config(D)
    s_cb, s_cp, s_ch = _cache_strides(k_cache, v_cache)
    qk_scale = float(scale) * LOG2E
    if num_splits > 1:
        po = torch.empty((nd * H * num_splits, cfg.block_d), dtype=torch.float32, device=q.device)
        pml = torch.empty((nd * H * num_splits, 2), dtype=torch.float32, device=q.device)
    else:
        po = pml = out  # unused
    _decode_kernel[(nd, hkv, num_splits)](
        q, k_cache, v_cache, out, po, pml, dec_seq, q_start, past, table, qk_scale, int(window),
        q.stride(0), q.stride(1), s_cb, s_cp, s_ch, table.stride(0), out.stride(0), out.stride(1),
        H=H, G=G, GP=max(16, 1 << (G - 1).bit_length()), D=D, BD=cfg.block_d, P=k_cache.shape[1],
        BLOCK_N=cfg.decode_n, NUM_SPLITS=num_splits, SLIDING=window > 0, PREC=_prec(q.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if num_splits > 1:
        _decode_reduce_kernel[(nd, H)](out, po, pml, dec_seq, q_start, out.stride(0), out.stride(1), H=H, D=D,
                                       BD=cfg.block_d, NUM_SPLITS=num_splits,
                                       NSP=max(2, 1 << (num_splits - 1).bit_length()), num_warps=cfg.num_warps)


def paged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  out: torch.Tensor, tile_seq: torch.Tensor, tile_m0: torch.Tensor, q_start: torch.Tensor,
                  q_len: torch.Tensor, past: torch.Tensor, table: torch.Tensor, scale: float, window: int) -> None:
    """Varlen prefill attention over the work list ``tile_seq``/``tile_m0`` (``BLOCK_M`` rows per entry, see
    `kernel_config`): past keys from the pages (read before this step's writes), chunk keys from ``k``/``v``."""
    _require_triton()
    q, k, v = _last_contiguous(q), _last_contiguous(k), _last_contiguous(v)
    nt = tile_seq.shape[0]
    if nt == 0:
        return
    T, H, D = q.shape
    hkv = k_cache.shape[2]
    cfg = kernel_config(D)
    s_cb, s_cp, s_ch = _cache_strides(k_cache, v_cache)
    _prefill_kernel[(nt, H)](
        q, k, v, k_cache, v_cache, out, tile_seq, tile_m0, q_start, q_len, past, table,
        float(scale) * LOG2E, int(window),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), s_cb, s_cp, s_ch,
        table.stride(0), out.stride(0), out.stride(1),
        G=H // hkv, D=D, BD=cfg.block_d, P=k_cache.shape[1], BLOCK_M=cfg.prefill_m, BLOCK_N=cfg.prefill_n,
        SLIDING=window > 0, PREC=_prec(q.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages)


# ------------------------------------------------------------------------------------------------ references
def _page_rows(positions: torch.Tensor, table_row: torch.Tensor, page: int, window: int) -> tuple[torch.Tensor, ...]:
    idx = positions % window if window > 0 else positions
    return table_row[idx // page].long(), idx % page


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q ``[n, H, D]``, k/v ``[m, Hkv, D]`` -> ``[n, H, D]`` in fp32; mask ``[n, m]`` True = attend."""
    H, hkv = q.shape[1], k.shape[1]
    kf = k.float().repeat_interleave(H // hkv, dim=1)
    vf = v.float().repeat_interleave(H // hkv, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    if mask is not None:
        s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", s.softmax(-1), vf)


def ref_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slots: torch.Tensor) -> None:
    """Reference of `store_kv`."""
    s = slots.long()
    keep = s >= 0
    P = k_cache.shape[1]
    blk, off = s[keep] // P, s[keep] % P
    k_cache[blk, off] = k[keep].to(k_cache.dtype)
    v_cache[blk, off] = v[keep].to(v_cache.dtype)


def ref_paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     dec_seq: torch.Tensor, q_start: torch.Tensor, past: torch.Tensor, table: torch.Tensor,
                     scale: float, window: int, num_splits: int = 1) -> None:
    """Reference of `paged_decode` (fp32 softmax over keys ``[lo, p]`` read from the pages)."""
    P = k_cache.shape[1]
    qs_l, past_l = q_start.tolist(), past.tolist()
    for b in dec_seq.tolist():
        if b < 0:
            continue
        p, row = past_l[b], qs_l[b]
        lo = max(0, p - window + 1) if window > 0 else 0
        pos = torch.arange(lo, p + 1, device=q.device)
        blk, off = _page_rows(pos, table[b], P, window)
        o = _attend(q[row:row + 1], k_cache[blk, off], v_cache[blk, off], None, scale)
        out[row] = o[0].to(out.dtype)


def ref_paged_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, tile_seq: torch.Tensor, tile_m0: torch.Tensor, q_start: torch.Tensor,
                      q_len: torch.Tensor, past: torch.Tensor, table: torch.Tensor, scale: float,
                      window: int) -> None:
    """Reference of `paged_prefill`: every sequence named in ``tile_seq``, whole chunk at once."""
    P = k_cache.shape[1]
    qs_l, n_l, past_l = q_start.tolist(), q_len.tolist(), past.tolist()
    for b in sorted({x for x in tile_seq.tolist() if x >= 0}):
        a, n, pst = qs_l[b], n_l[b], past_l[b]
        if n <= 0:
            continue
        lo = max(0, pst - (window - 1)) if window > 0 else 0
        pos = torch.arange(lo, pst, device=q.device)
        blk, off = _page_rows(pos, table[b], P, window)
        keys = torch.cat([k_cache[blk, off].to(k.dtype), k[a:a + n]], 0)
        vals = torch.cat([v_cache[blk, off].to(v.dtype), v[a:a + n]], 0)
        kpos = torch.cat([pos, torch.arange(pst, pst + n, device=q.device)])
        qpos = torch.arange(pst, pst + n, device=q.device)
        mask = kpos[None, :] <= qpos[:, None]
        if window > 0:
            mask &= kpos[None, :] > qpos[:, None] - window
        out[a:a + n] = _attend(q[a:a + n], keys, vals, mask, scale).to(out.dtype)


# ------------------------------------------------------------------------------------------------ one layer
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: Any, group: Any, scale: float, impl: str = "triton") -> torch.Tensor:
    """One layer of a step: prefill (pre-write reads), store, decode. Returns ``[T, H, D]``.

    Args:
        q: ``[T, H, D]``; k, v: ``[T, Hkv, D]`` (views are fine: the last dim must be contiguous or is copied).
        meta: the step's device metadata (``q_start``, ``q_len``, ``past``, ``dec_seq``, ``tile_seq``, ``tile_m0``
            int32 tensors, ``has_prefill``/``has_decode`` bools).
        group: the layer group's metadata (``slots``, ``table``, ``window`` (0 = full), ``num_splits``).
        impl: "triton" (kernels) or "torch" (the references).
    """
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    if impl == "triton":
        prefill, store, decode = paged_prefill, store_kv, paged_decode
    else:
        prefill, store, decode = ref_paged_prefill, ref_store_kv, ref_paged_decode
    if meta.has_prefill:
        prefill(q, k, v, k_cache, v_cache, out, meta.tile_seq, meta.tile_m0, meta.q_start, meta.q_len, meta.past,
                group.table, scale, group.window)
    store(k, v, k_cache, v_cache, group.slots)
    if meta.has_decode:
        decode(q, k_cache, v_cache, out, meta.dec_seq, meta.q_start, meta.past, group.table, scale, group.window,
               group.num_splits)
    return out


def attention_flops(q_len: int, kv_len: int, num_heads: int, head_dim: int) -> float:
    """FLOPs of one request's attention (QK^T and PV), for reports."""
    return 4.0 * q_len * kv_len * num_heads * head_dim
