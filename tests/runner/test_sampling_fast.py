"""The sampler's fast paths (`cbnb.runner.sampling`, issue 24): int32 noise equal to the int64 definition, the two-pass
argmax equal to torch's, the explicit top-p mask equal to a plain full-sort definition, and the lazy (sort-free) top-p
draw equal to the explicit one, seeded, batch-invariant, and with the right distribution."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from cbnb.core.requests import SamplingParams
from cbnb.runner import sampling as sm
from cbnb.runner.cpu import cpu_kernels
from cbnb.runner import noise
from cbnb.runner.sampling import Sampler, gumbel_noise, row_key

NEG = float("-inf")


def entry(rid: str, params: SamplingParams, *, index: int = 0, prompt: int = 5):
    """A duck-typed `ScheduledRequest` whose row draws output token `index`."""
    req = SimpleNamespace(request_id=rid, sampling=params, prompt_ids=[0] * prompt, output_ids=[1] * index,
                          max_new_tokens=None, tokens_left=None)
    return SimpleNamespace(request_id=rid, request=req, start=prompt + index - 1, num_tokens=1)


def ref_top_p(x: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p on a 1-D row from the definition: the most likely tokens, in descending order, while the mass before
    them is below top_p (ties with the last kept one kept too)."""
    if top_p >= 1.0:
        return x.clone()
    p = torch.softmax(x.double(), -1)
    order = torch.argsort(x, descending=True, stable=True)
    before = torch.cumsum(p[order], 0) - p[order]
    kept = order[before < top_p]
    thr = x[kept].min()
    return torch.where(x >= thr, x, torch.full_like(x, NEG))


def ref_row(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on a 1-D row, straightforwardly."""
    x = x.float() / p.temperature
    if p.top_k is not None and p.top_k < x.numel():
        x = torch.where(x >= torch.sort(x, descending=True).values[p.top_k - 1], x, torch.full_like(x, NEG))
    x = ref_top_p(x, p.top_p if p.top_p is not None else 1.0)
    if p.min_p:
        x = torch.where(x >= x.max() + torch.log(torch.tensor(p.min_p)), x, torch.full_like(x, NEG))
    return x


def ref_token(x: torch.Tensor, p: SamplingParams, index: int) -> int:
    key = row_key(p.seed, index)
    g = gumbel_noise(torch.tensor([[key & 0x7FFFFFFF]]), torch.tensor([[key >> 31]]), x.numel())[0]
    return int((ref_row(x, p) + g).argmax())


def random_logits(rng: torch.Generator, n: int, V: int) -> torch.Tensor:
    x = torch.randn(n, V, generator=rng) * 3
    x[:, : V // 4] = torch.round(x[:, : V // 4])  # many exact ties
    x[0, ::7] = NEG  # ruled-out entries
    return x


PARAMS = [dict(top_p=0.9), dict(top_p=0.3), dict(top_p=1e-6), dict(top_p=1.0), dict(temperature=0.7, top_p=0.5),
          dict(top_k=1), dict(top_k=3, top_p=0.8), dict(top_k=40, top_p=0.95, min_p=0.05), dict(min_p=0.2, top_p=0.6),
          dict(temperature=1.5), dict()]


# ------------------------------------------------------------------------------------------------ building blocks
@pytest.mark.parametrize("c_pass", [True, False], ids=["c_pass", "torch_passes"])
@pytest.mark.parametrize("shape", [(1, 64), (3, 1000), (7, 50257), (40, 4096)])
def test_int32_noise_equals_the_int64_definition(monkeypatch, shape, c_pass):
    # The CPU fast path hashes in C (cbnb/runner/cpu/noise.c); with it off, int32 torch passes: both are the definition.
    monkeypatch.setenv("CBNB_CPU_KERNELS", "1" if c_pass else "0")
    calls = []
    real = noise._c_uniform
    monkeypatch.setattr(noise, "_c_uniform", lambda: calls.append(1) or real())
    S, V = shape
    lo = torch.randint(0, 2 ** 31 - 1, (S, 1))
    hi = torch.randint(0, 2 ** 31 - 1, (S, 1))
    lo[0], hi[0] = 0, 2 ** 31 - 1  # extremes of the key halves
    got = noise._noise_into(torch.empty(S, V), lo, hi)
    assert torch.equal(got, gumbel_noise(lo, hi, V))
    assert calls and (real() is not None) == (c_pass and cpu_kernels.available())


def test_int32_multiply_wraps_like_int64_low_bits():
    # What _mix31_ relies on, on every kernel path (vector body, scalar tail, broadcast).
    for n in (1, 15, 16, 17, 1000):
        a = torch.randint(0, 2 ** 31 - 1, (n,))
        got = (a.to(torch.int32) * noise._MUL).bitwise_and_(noise._M31).to(torch.int64)
        assert torch.equal(got, (a * noise._MUL) & noise._M31)


@pytest.mark.parametrize("V", [64, 256, 1000, 4096, 49152])
def test_two_pass_argmax_equals_torch_argmax(V):
    rng = torch.Generator().manual_seed(V)
    x = torch.randint(-3, 3, (9, V), generator=rng).float()  # ties everywhere: the first index must win
    x[1] = NEG
    x[2, -1] = 100.0
    x[3, 0] = 100.0
    x[4] = torch.randn(V, generator=rng)
    assert torch.equal(sm._argmax(x), x.argmax(-1))


# ------------------------------------------------------------------------------------------------ explicit masks
@pytest.mark.parametrize("seed", range(4))
def test_process_masks_equal_the_definitions(seed):
    rng = torch.Generator().manual_seed(seed)
    V = [5, 64, 300, 2048][seed]
    params = [SamplingParams(do_sample=True, seed=i, **kw) for i, kw in enumerate(PARAMS)]
    x = random_logits(rng, len(params), V)
    s = Sampler(torch.device("cpu"), seed=0)
    got = s.process(x, s.rows([entry(f"r{i}", p) for i, p in enumerate(params)], V))
    for i, p in enumerate(params):
        want = ref_row(x[i], p)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, PARAMS[i])
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[i][fin], want[fin])


# ------------------------------------------------------------------------------------------------ the lazy draw
@pytest.mark.parametrize("seed", range(6))
def test_lazy_draw_equals_the_explicit_draw_and_the_reference(seed):
    rng = torch.Generator().manual_seed(100 + seed)
    V = [5, 64, 200, 1024, 4096, 49152][seed]
    lazy, explicit = Sampler(torch.device("cpu"), seed=0), Sampler(torch.device("cpu"), seed=0, lazy_top_p=False)
    assert lazy.lazy_top_p and not explicit.lazy_top_p
    for step in range(4):
        params = [SamplingParams(do_sample=True, seed=17 * i + seed, **kw) for i, kw in enumerate(PARAMS)]
        x = random_logits(rng, len(params), V)
        entries = [entry(f"r{i}", p, index=step) for i, p in enumerate(params)]
        a = lazy.sample(x, entries)[0]
        b = explicit.sample(x, entries)[0]
        assert torch.equal(a, b), (step, a.tolist(), b.tolist())
        for i, p in enumerate(params):
            if i:  # row 0 has ruled-out entries; the reference handles them too, but ties on -inf make no sense
                assert int(a[i]) == ref_token(x[i], p, step), (step, i, PARAMS[i])


def test_lazy_rounds_run_and_rows_do_not_depend_on_the_batch(monkeypatch):
    # top_p 0.2 on a flat row: the Gumbel winner over all tokens is usually outside the nucleus, so the draw needs
    # several rounds; the token is still that of the row alone and that of the explicit mask.
    rng = torch.Generator().manual_seed(5)
    V = 4096
    row = torch.randn(V, generator=rng) * 0.5
    p = SamplingParams(do_sample=True, top_p=0.2, seed=1234)
    for index in range(20):
        alone = Sampler(torch.device("cpu")).sample(row[None], [entry("a", p, index=index)])[0].item()
        crowd = random_logits(rng, 6, V)
        crowd[3] = row
        others = [SamplingParams(do_sample=True, seed=i, top_p=0.5 + 0.1 * i) for i in range(6)]
        entries = [entry(f"o{i}", q, index=index) for i, q in enumerate(others)]
        entries[3] = entry("b", p, index=index)
        assert Sampler(torch.device("cpu")).sample(crowd, entries)[0][3].item() == alone
        assert alone == ref_token(row, p, index)
    argmaxes = []
    real = sm._argmax
    monkeypatch.setattr(sm, "_argmax", lambda t: (argmaxes.append(t.shape[0]), real(t))[1])
    s = Sampler(torch.device("cpu"))
    extra = []
    for index in range(10):
        argmaxes.clear()
        s.sample(row[None], [entry("a", p, index=index)])
        extra.append(len(argmaxes) - 2)  # beyond the greedy argmax and the first winner: one per lazy round
    assert max(extra) >= 2, extra


def test_lazy_draw_distribution_matches_the_nucleus():
    # 8000 draws of one row (distinct output indices): frequencies follow the renormalised nucleus softmax.
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0])
    p = SamplingParams(do_sample=True, temperature=1.0, top_p=0.8, seed=9)
    nucleus = torch.isfinite(ref_top_p(logits, 0.8))
    assert 1 < int(nucleus.sum()) < 8
    n = 8000
    got = Sampler(torch.device("cpu")).sample(logits.expand(n, -1), [entry("a", p, index=k) for k in range(n)])[0]
    counts = torch.bincount(got, minlength=8).double()
    assert counts[~nucleus].sum() == 0
    expect = torch.where(nucleus, logits, torch.full_like(logits, NEG)).softmax(-1).double() * n
    chi2 = float((((counts - expect) ** 2) / expect.clamp(min=1e-9))[nucleus].sum())
    dof = int(nucleus.sum()) - 1
    assert chi2 < {1: 10.8, 2: 13.8, 3: 16.3, 4: 18.5, 5: 20.5, 6: 22.5}[dof], (counts.tolist(), expect.tolist())


def test_non_finite_rows_fail_alone_without_hanging():
    V = 256
    x = torch.randn(3, V)
    x[0] = NEG  # every token ruled out
    x[1, 10] = float("nan")
    ps = [SamplingParams(do_sample=True, top_p=0.5, seed=i) for i in range(3)]
    tok, report = Sampler(torch.device("cpu")).sample(x, [entry(f"r{i}", q) for i, q in enumerate(ps)])
    assert report.data[:, 0].tolist() == [1.0, 1.0, 0.0]
    assert int(tok[2]) == ref_token(x[2], ps[2], 0)


def test_seeded_lazy_draws_are_reproducible_and_vary_with_the_index():
    rng = random.Random(3)
    x = torch.randn(1, 49152) * 2
    p = SamplingParams(do_sample=True, temperature=0.8, top_p=0.95, seed=rng.randrange(1 << 30))
    first = [Sampler(torch.device("cpu")).sample(x, [entry("a", p, index=k)])[0].item() for k in range(8)]
    again = [Sampler(torch.device("cpu"), seed=5).sample(x, [entry("z", p, index=k)])[0].item() for k in range(8)]
    assert first == again and len(set(first)) > 1
