"""The compiled CPU paged-attention kernels (decode rows, prefill rows) against torch's attention, the step batch's
choice between them and the torch path, and the fallback when they cannot be built."""

from __future__ import annotations

import random
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

import cbnb
from cbnb.runner.cpu import cpu_kernels

from helpers_engine import STD_PROMPTS, config, oracle_for, results, submit_together, tiny_model

needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


def _reference(q, k_pages, v_pages, rows, tables, lens, scale):
    """Per row: sdpa over the first `len` slots of its pages (torch, GQA)."""
    out = {}
    P = k_pages.shape[1]
    for r, tab, n in zip(rows.tolist(), tables.tolist(), lens.tolist()):
        k = torch.cat([k_pages[b] for b in tab])[:n]  # [n, Hkv, D]
        v = torch.cat([v_pages[b] for b in tab])[:n]
        assert len(tab) * P >= n
        o = F.scaled_dot_product_attention(q[r][None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           scale=scale, enable_gqa=True)
        out[r] = o[0, :, 0]
    return out


@needs_cc
# (40, 2, ...): more query heads per KV head (20) than one accumulator block holds (16); D 320: more dimensions
# than one block holds (256); spread 40: scores far apart, so most exponentials underflow (the inline exp's clamp).
@pytest.mark.parametrize("H, Hkv, D, P, spread", [(9, 3, 64, 16, 1.0), (4, 1, 16, 5, 1.0), (4, 4, 256, 8, 1.0),
                                                  (40, 2, 64, 16, 1.0), (2, 1, 320, 8, 1.0), (9, 3, 64, 16, 40.0)])
# 4 rows: a task per (row, KV head); 24 rows on up to 6 threads: a task per row, over all its KV heads.
@pytest.mark.parametrize("n_rows", [4, 24])
def test_kernel_matches_sdpa_per_row(H, Hkv, D, P, spread, n_rows):
    assert cpu_kernels.available(), cpu_kernels.build_error()
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    nb = 12
    # Strided pages as in the pool: [blocks, layers, 2, P, Hkv, D], layer 1.
    pool = torch.randn(nb, 3, 2, P, Hkv, D, generator=g)
    k_pages, v_pages = pool[:, 1, 0], pool[:, 1, 1]
    T = 7 if n_rows == 4 else 30
    q = torch.randn(T, H, D, generator=g) * spread
    rows = torch.tensor([0, 2, 3, 6] if n_rows == 4 else sorted(rng.sample(range(T), n_rows)))
    lens = torch.tensor([1, P, P + 1, 3 * P - 2] * (n_rows // 4))
    width = 3
    tables = torch.tensor([[rng.randrange(nb) for _ in range(width)] for _ in rows])
    out = torch.full_like(q, 7.0)
    scale = D ** -0.5
    cpu_kernels.paged_decode(q, k_pages, v_pages, rows, tables, lens, int(lens.max()), scale, out)
    ref = _reference(q, k_pages, v_pages, rows, tables, lens, scale)
    for r in range(T):
        if r in ref:
            torch.testing.assert_close(out[r], ref[r], rtol=1e-5, atol=1e-5)
        else:
            assert torch.all(out[r] == 7.0), "rows that do not decode must be left untouched"


def _prefill_reference(q, k_pages, v_pages, rows, starts, counts, tables, scale):
    """Per row: sdpa of its chunk's queries over the first `start + count` slots of its pages, causal."""
    out = {}
    for a, s, n, tab in zip(rows.tolist(), starts.tolist(), counts.tolist(), tables.tolist()):
        k = torch.cat([k_pages[b] for b in tab])[:s + n]  # [keys, Hkv, D]
        v = torch.cat([v_pages[b] for b in tab])[:s + n]
        mask = torch.arange(s + n)[None, :] <= (torch.arange(n) + s)[:, None]
        o = F.scaled_dot_product_attention(q[a:a + n].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           v.transpose(0, 1)[None], attn_mask=mask, scale=scale, enable_gqa=True)
        for i in range(n):
            out[a + i] = o[0, :, i]
    return out


@needs_cc
# Chunks shorter and longer than a query block (16) and a key block (64), pasts that start mid-page, pages shorter
# than a key block (5, 16) and longer (256); GQA groups of 1-20; D 16-320; spread 40: scores far apart, so the
# running max jumps and most exponentials underflow.
@pytest.mark.parametrize("H, Hkv, D, P, spread", [(9, 3, 64, 256, 1.0), (9, 3, 64, 16, 1.0), (4, 1, 16, 5, 1.0),
                                                  (4, 4, 128, 64, 1.0), (40, 2, 64, 16, 1.0), (2, 1, 320, 8, 1.0),
                                                  (9, 3, 64, 16, 40.0)])
def test_prefill_kernel_matches_causal_sdpa_per_row(H, Hkv, D, P, spread):
    assert cpu_kernels.available(), cpu_kernels.build_error()
    g = torch.Generator().manual_seed(1)
    rng = random.Random(1)
    spec = [(0, 1), (0, 70), (37, 20), (3, 130), (200, 5)]  # (past, chunk length) per row
    rows = torch.tensor([sum(n for _, n in spec[:i]) + 2 for i in range(len(spec))])  # row 0, 1 and the end: no query
    starts = torch.tensor([s for s, _ in spec])
    counts = torch.tensor([n for _, n in spec])
    width = max(-(-(s + n) // P) for s, n in spec)
    nb = width + 8
    pool = torch.randn(nb, 3, 2, P, Hkv, D, generator=g)  # strided pages as in the pool, layer 1
    k_pages, v_pages = pool[:, 1, 0], pool[:, 1, 1]
    tables = torch.tensor([rng.sample(range(nb), width) for _ in spec])
    T = int(rows[-1] + counts[-1]) + 2
    q = torch.randn(T, H, D, generator=g) * spread
    out = torch.full_like(q, 7.0)
    scale = D ** -0.5
    cpu_kernels.paged_prefill(q, k_pages, v_pages, rows, starts, counts, tables, scale, out)
    ref = _prefill_reference(q, k_pages, v_pages, rows, starts, counts, tables, scale)
    # Scores `spread` times larger carry `spread` times larger float32 rounding into their exponentials (SDPA's
    # reductions on an AVX-512 Xeon differed from the kernel by 1.3e-5 at spread 40).
    tol = 1e-5 * max(1.0, spread / 4)
    for r in range(T):
        if r in ref:
            torch.testing.assert_close(out[r], ref[r], rtol=tol, atol=tol)
        else:
            assert torch.all(out[r] == 7.0), "rows outside the chunks must be left untouched"


@needs_cc
def test_prefill_kernel_rejects_bad_arguments():
    q, pages = torch.zeros(4, 4, 8), torch.zeros(3, 4, 2, 8)
    row, table = torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long)
    for start, count in ((0, 0), (2, 3)):  # an empty chunk; keys past the table's one page of 4 slots
        with pytest.raises(RuntimeError, match="rejected"):
            cpu_kernels.paged_prefill(q, pages, pages, row, row + start, row + count, table, 1.0, torch.empty_like(q))
    with pytest.raises(ValueError, match="int64"):
        cpu_kernels.paged_prefill(q, pages, pages, row.int(), row, row + 1, table, 1.0, torch.empty_like(q))


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:gemma3"])
@pytest.mark.parametrize("prefill", ["1", "0"])
def test_step_batch_sends_full_attention_prefill_rows_to_the_kernel(name, prefill, monkeypatch):
    """Prefill rows of full-attention groups go to the kernel in one call (sliding groups, and every group with
    CBNB_CPU_PREFILL=0, keep the per-row torch path); tokens equal the oracle either way."""
    import cbnb.runner.model_runner as mr

    monkeypatch.setenv("CBNB_CPU_PREFILL", prefill)
    seen = []
    build = mr.build_step_batch

    def spy(*a, **kw):
        seen.append(build(*a, **kw))
        return seen[-1]

    monkeypatch.setattr(mr, "build_step_batch", spy)
    engine = cbnb.Engine(tiny_model(name), config=config(page_size=8, max_batch_tokens=24))
    with engine:  # prompts of 30-60 tokens in 24-token steps: fresh and paged chunks
        outs = results(submit_together(engine, STD_PROMPTS[3:6], 4))
    oracle = oracle_for(name)
    assert [o.token_ids for o in outs] == [oracle(p, 4) for p in STD_PROMPTS[3:6]]
    groups = [gb for b in seen for gb in b.groups]
    kernel = [gb for gb in groups if gb.pre_counts is not None]
    full = [gb for gb in groups if gb.window is None]
    assert full and all(gb.window is None for gb in kernel)
    if prefill == "1" and cpu_kernels.available():
        assert {int(s) > 0 for gb in kernel for s in gb.pre_starts} == {False, True}  # fresh and paged chunks
        assert not [r for gb in full for r in gb.prefill]
    else:
        assert not kernel and {r.mode for gb in full for r in gb.prefill} == {"fresh", "paged"}
    if name == "tiny:gemma3":
        assert any(gb.window is not None and gb.prefill for gb in groups)  # sliding groups: per-row torch path


@needs_cc
def test_kernel_rejects_bad_arguments():
    assert cpu_kernels.available()
    q = torch.zeros(2, 4, 8)
    pages = torch.zeros(3, 4, 3, 8)  # Hkv = 3 does not divide H = 4
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="rejected"):
        cpu_kernels.paged_decode(q, pages, pages, one, torch.zeros(1, 1, dtype=torch.long), one + 1, 1, 1.0,
                                 torch.empty_like(q))
    with pytest.raises(ValueError, match="float32"):
        cpu_kernels.paged_decode(q.double(), pages, pages, one, one.view(1, 1), one + 1, 1, 1.0, q.double())


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("CBNB_CPU_KERNELS", "0")
    assert not cpu_kernels.enabled() and not cpu_kernels.available()


def test_build_failure_warns_once_and_the_engine_uses_the_torch_path(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("CBNB_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(shutil, "which", lambda name: None)
    fresh = cpu_kernels.LazyLibrary("paged_decode.c", cpu_kernels._Paged, "the CPU paged-attention kernel",
                                    "using the torch attention path")
    monkeypatch.setattr(cpu_kernels, "_PAGED", fresh)  # restored after the test: the real kernel stays loaded
    with pytest.warns(RuntimeWarning, match="kernel is unavailable"):
        assert not cpu_kernels.available()
    assert "no-such-compiler" in cpu_kernels.build_error()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning
        assert not cpu_kernels.available()
    model = tiny_model("tiny:llama")
    oracle = oracle_for("tiny:llama")
    engine = cbnb.Engine(model, config=config(page_size=8, max_batch_tokens=32))
    with engine:
        outs = results(submit_together(engine, STD_PROMPTS[:3], 6))
    assert [o.token_ids for o in outs] == [oracle(p, 6) for p in STD_PROMPTS[:3]]
