"""Triton paged-attention kernels == their PyTorch references, and the references == dense attention.

Runs on CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set here before Triton is imported), so shapes are
tiny. Covered: random pages and block tables (shared blocks included), GQA ratios 1/3/4, head_dim 64/128, page sizes
16/32, sliding windows (ring slots, a chunk with a past that wraps the ring), decode splits, fp32 / fp16 / bf16.
The whole-layer test replays a multi-step history (prefill chunks with a past, decodes) against dense causal
attention over the full K/V history: that is the ground truth the paged layout must reproduce.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from cbnb.runner.cuda import triton_attention as ta  # noqa: E402

needs_triton = pytest.mark.skipif(not ta.HAS_TRITON, reason=f"triton is not importable: {ta.TRITON_ERROR}")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-4, torch.float16: 2e-2, torch.bfloat16: 4e-2}


def make_cache(num_blocks: int, page: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    """K/V page views ``[num_blocks, page, hkv, d]`` strided like `KVStore`'s (2 layers per block, layer 1 used)."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.randn(num_blocks, 2, 2, page, hkv, d, generator=g).to(dtype).to(DEV)
    return buf[:, 1, 0], buf[:, 1, 1]


def i32(x) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.int32, device=DEV)


def random_tables(num_seqs: int, width: int, num_blocks: int, seed: int, shared: int = 1) -> torch.Tensor:
    """Random block tables; the first `shared` columns are the same blocks for every request (a shared prefix)."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    common = perm[:shared]
    rows, k = [], shared
    for _ in range(num_seqs):
        own = perm[k:k + width - shared]
        k += width - shared
        rows.append(torch.cat([common, own]))
    return torch.stack(rows).to(torch.int32).to(DEV)


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


# ------------------------------------------------------------------------------------------------ unit: arithmetic
def test_decode_splits_power_of_two_and_bounded():
    assert ta.num_decode_splits(256, 8, 16384, 132) == 1  # plenty of programs already
    s = ta.num_decode_splits(1, 8, 16384, 132)
    assert s > 1 and s & (s - 1) == 0
    assert ta.num_decode_splits(1, 8, 100, 132) == 1  # short sequences: no split
    assert ta.num_decode_splits(1, 1, 1 << 20, 132, max_splits=64) <= 64


# ------------------------------------------------------------------------------------------------ kernels vs refs
DECODE_CASES = [
    # (heads, kv_heads, head_dim, page, window, splits, dtype)
    (4, 4, 64, 16, 0, 1, torch.float32),
    (6, 2, 64, 32, 0, 4, torch.float32),
    (8, 2, 128, 16, 0, 2, torch.float16),
    (8, 2, 64, 16, 20, 1, torch.bfloat16),
    (3, 1, 64, 32, 40, 2, torch.float32),
]


@needs_triton
@pytest.mark.parametrize("H,hkv,D,P,window,splits,dtype", DECODE_CASES)
def test_decode_kernel_matches_reference(H, hkv, D, P, window, splits, dtype):
    nb = 24
    kc, vc = make_cache(nb, P, hkv, D, dtype)
    R = 4
    past = [5, 37, 0, 70] if window == 0 else [5, 37, 0, 100]  # query positions
    width = ta_cdiv(window, P) if window else max(ta_cdiv(p + 1, P) for p in past)
    table = random_tables(R, width, nb, seed=1)
    T = 6
    q = _randn(T, H, D, dtype=dtype, seed=2)
    q_start = i32([4, 1, 5, 0])
    dec_seq = i32([0, 1, -1, 3, 2])  # a padded entry in the middle
    out_k = torch.zeros(T, H, D, dtype=dtype, device=DEV)
    out_r = torch.zeros_like(out_k)
    args = (dec_seq, q_start, i32(past), table, D ** -0.5, window)
    ta.paged_decode(q, kc, vc, out_k, *args, num_splits=splits)
    ta.ref_paged_decode(q, kc, vc, out_r, *args, num_splits=splits)
    torch.testing.assert_close(out_k.float(), out_r.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert out_k[2].abs().sum() == 0 and out_k[3].abs().sum() == 0  # rows of no decoded slot stay untouched


def ta_cdiv(a, b):
    return -(-a // b)


PREFILL_CASES = [
    # (heads, kv_heads, head_dim, page, window, dtype)
    (4, 4, 64, 16, 0, torch.float32),
    (6, 2, 64, 32, 0, torch.bfloat16),
    (4, 1, 128, 16, 0, torch.float16),
    (8, 2, 64, 16, 24, torch.float32),
]


@needs_triton
@pytest.mark.parametrize("H,hkv,D,P,window,dtype", PREFILL_CASES)
def test_prefill_kernel_matches_reference(H, hkv, D, P, window, dtype):
    nb = 24
    kc, vc = make_cache(nb, P, hkv, D, dtype)
    bm = ta.kernel_config(D).prefill_m
    # three chunks: fresh (no past), with a past (prefix hit / chunked prefill), longer than one tile
    q_len = [7, 9, bm + 5]
    past = [0, 30, 11]
    q_start, a = [], 0
    for n in q_len:
        q_start.append(a)
        a += n
    T = a + 3  # padded rows at the end
    width = ta_cdiv(window, P) if window else max(ta_cdiv(p + n, P) for p, n in zip(past, q_len))
    table = random_tables(3, width, nb, seed=3)
    q = _randn(T, H, D, dtype=dtype, seed=4)
    k = _randn(T, hkv, D, dtype=dtype, seed=5)
    v = _randn(T, hkv, D, dtype=dtype, seed=6)
    tiles = [(b, m0) for b, n in enumerate(q_len) for m0 in range(0, n, bm)] + [(-1, 0), (-1, 0)]
    tile_seq, tile_m0 = i32([t[0] for t in tiles]), i32([t[1] for t in tiles])
    out_k = torch.zeros(T, H, D, dtype=dtype, device=DEV)
    out_r = torch.zeros_like(out_k)
    args = (tile_seq, tile_m0, i32(q_start), i32(q_len), i32(past), table, D ** -0.5, window)
    ta.paged_prefill(q, k, v, kc, vc, out_k, *args)
    ta.ref_paged_prefill(q, k, v, kc, vc, out_r, *args)
    torch.testing.assert_close(out_k.float(), out_r.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert out_k[a:].abs().sum() == 0  # padded rows untouched


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kernel_matches_reference(dtype):
    P, hkv, D = 16, 3, 64
    kc1, vc1 = make_cache(8, P, hkv, D, dtype)
    kc2, vc2 = kc1.clone(), vc1.clone()
    k = _randn(5, hkv, D, dtype=torch.float32, seed=7)
    v = _randn(5, hkv, D, dtype=torch.float32, seed=8)
    slots = i32([3 * P + 2, -1, 5 * P + 15, 1 * P, 7 * P + 7])
    ta.store_kv(k, v, kc1, vc1, slots)
    ta.ref_store_kv(k, v, kc2, vc2, slots)
    # fp32 -> bf16 rounding may differ by one ulp (Triton's interpreter truncates; torch rounds to nearest even)
    tol = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-6, rtol=2 ** -7)
    torch.testing.assert_close(kc1, kc2, **tol)
    torch.testing.assert_close(vc1, vc2, **tol)
    torch.testing.assert_close(kc1[3, 2], k[0].to(dtype), **tol)
    torch.testing.assert_close(vc1[7, 7], v[4].to(dtype), **tol)
    untouched = torch.ones(8, P, dtype=torch.bool)
    for sl in (3 * P + 2, 5 * P + 15, 1 * P, 7 * P + 7):
        untouched[sl // P, sl % P] = False
    fresh_k, _ = make_cache(8, P, hkv, D, dtype)
    assert torch.equal(kc1[untouched], fresh_k[untouched])  # slot -1 and every other slot left alone


# ------------------------------------------------------------------------------------------------ layer vs dense
def _dense(q, keys, vals, qpos, kpos, window, scale):
    mask = kpos[None, :] <= qpos[:, None]
    if window:
        mask &= kpos[None, :] > qpos[:, None] - window
    H, hkv = q.shape[1], keys.shape[1]
    kf = keys.float().repeat_interleave(H // hkv, 1)
    vf = vals.float().repeat_interleave(H // hkv, 1)
    s = torch.einsum("nhd,mhd->hnm", q.float(), kf) * scale
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnm,mhd->nhd", s.softmax(-1), vf)


def _run_history(impl: str, window: int, dtype: torch.dtype, H: int = 4, hkv: int = 2, D: int = 64, P: int = 16):
    """Two requests through several steps (prefill chunks with a past, mixed decode + prefill steps), through the
    whole-layer op (prefill reads, store, decode reads). Compares every step's output with dense attention over the
    full history. With a window, positions live in a ring of `window` slots, so chunks with a past wrap it."""
    nb = 16
    kc, vc = make_cache(nb, P, hkv, D, dtype, seed=11)
    kc.zero_()
    vc.zero_()
    ring = window if window else None
    cap = 80
    width = ta_cdiv(window, P) if window else ta_cdiv(cap, P)
    tables = [list(range(1, 1 + width)), list(range(1 + width, 1 + 2 * width))]
    hist_k = [torch.zeros(0, hkv, D, dtype=dtype, device=DEV) for _ in range(2)]
    hist_v = [torch.zeros(0, hkv, D, dtype=dtype, device=DEV) for _ in range(2)]
    # steps: per request (chunk length or 0)
    plan = [(12, 0), (9, 5), (1, 30), (1, 1), (20, 1), (1, 1)] if window else [(12, 0), (9, 5), (1, 30), (1, 1), (3, 1)]
    trash = 0
    scale = D ** -0.5
    seed = 100
    pos = [0, 0]
    cfg = ta.kernel_config(D)
    for chunks in plan:
        entries = [(b, n) for b, n in enumerate(chunks) if n]
        T = sum(n for _, n in entries) + 2  # two padded rows
        seed += 1
        q = _randn(T, H, D, dtype=dtype, seed=seed)
        k = _randn(T, hkv, D, dtype=dtype, seed=seed + 1000)
        v = _randn(T, hkv, D, dtype=dtype, seed=seed + 2000)
        q_start, q_len, past, slots, dec, tiles = [], [], [], [], [], []
        a = 0
        for i, (b, n) in enumerate(entries):
            q_start.append(a)
            q_len.append(n)
            past.append(pos[b])
            first_kept = pos[b] + n - window if window else pos[b]
            for p in range(pos[b], pos[b] + n):
                if window and p < first_kept:
                    slots.append(trash)
                    continue
                r = p % window if window else p
                slots.append(tables[b][r // P] * P + r % P)
            if n == 1:
                dec.append(i)
            else:
                tiles += [(i, m0) for m0 in range(0, n, cfg.prefill_m)]
            a += n
        slots += [trash, trash]
        tab = torch.zeros(len(entries), width, dtype=torch.int32, device=DEV)
        for i, (b, _) in enumerate(entries):
            tab[i] = torch.tensor(tables[b], dtype=torch.int32)
        meta = type("M", (), {})()
        meta.q_start, meta.q_len, meta.past = i32(q_start), i32(q_len), i32(past)
        meta.dec_seq = i32(dec + [-1])
        meta.tile_seq = i32([t[0] for t in tiles] + [-1])
        meta.tile_m0 = i32([t[1] for t in tiles] + [0])
        meta.has_prefill, meta.has_decode = bool(tiles), bool(dec)
        grp = type("G", (), {})()
        grp.slots, grp.table, grp.window, grp.num_splits = i32(slots), tab, window, 2
        out = ta.paged_attention(q, k, v, kc, vc, meta, grp, scale, impl)
        for i, (b, n) in enumerate(entries):
            a = q_start[i]
            hist_k[b] = torch.cat([hist_k[b], k[a:a + n]])
            hist_v[b] = torch.cat([hist_v[b], v[a:a + n]])
            L = hist_k[b].shape[0]
            qpos = torch.arange(L - n, L, device=DEV)
            want = _dense(q[a:a + n], hist_k[b], hist_v[b], qpos, torch.arange(L, device=DEV), window, scale)
            torch.testing.assert_close(out[a:a + n].float(), want, atol=TOL[dtype], rtol=TOL[dtype])
            pos[b] += n
    assert ring is None or max(pos) > window  # the history really wrapped the ring


@pytest.mark.parametrize("window", [0, 8])
def test_layer_reference_matches_dense_history(window):
    _run_history("torch", window, torch.float32)


@needs_triton
@pytest.mark.parametrize("window,dtype", [(0, torch.float32), (8, torch.float32), (8, torch.bfloat16)])
def test_layer_kernels_match_dense_history(window, dtype):
    _run_history("triton", window, dtype)
