"""The compiled CPU decode-attention kernel against torch's attention, and its fallback when it cannot be built."""

from __future__ import annotations

import random
import shutil
import warnings

import pytest
import torch
import torch.nn.functional as F

import cbnb
from cbnb.runner import cpu_kernels

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
def test_kernel_matches_sdpa_per_row(H, Hkv, D, P, spread):
    assert cpu_kernels.available(), cpu_kernels.build_error()
    g = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    nb = 12
    # Strided pages as in the pool: [blocks, layers, 2, P, Hkv, D], layer 1.
    pool = torch.randn(nb, 3, 2, P, Hkv, D, generator=g)
    k_pages, v_pages = pool[:, 1, 0], pool[:, 1, 1]
    T = 7
    q = torch.randn(T, H, D, generator=g) * spread
    rows = torch.tensor([0, 2, 3, 6])
    lens = torch.tensor([1, P, P + 1, 3 * P - 2])
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
    fresh = cpu_kernels.LazyLibrary("paged_decode.c", cpu_kernels._bind_paged, "the CPU decode-attention kernel",
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
