"""The batched sampler (`cbnb.runner.sampling`): one draw for all rows of a step, no host synchronisation, per-row
parameters as tensors, seeded samples independent of the batch, and the right distribution."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import cbnb
from cbnb.core.requests import SamplingParams
from cbnb.runner import sampling as sm
from cbnb.runner.sampling import Sampler, gumbel_noise, row_key

from helpers_engine import STD_PROMPTS, config, results, submit_together, tiny_model
from helpers_sync import HostSyncProbe

V = 64


def entry(rid: str, params: SamplingParams, *, prompt: int = 5, start: int = 4, n: int = 1, made: int = 0):
    """A duck-typed `ScheduledRequest` whose row draws output token `start + n - prompt`."""
    req = SimpleNamespace(request_id=rid, sampling=params, prompt_ids=[0] * prompt, output_ids=[1] * made,
                          max_new_tokens=params.max_new_tokens,
                          tokens_left=None if params.max_new_tokens is None else params.max_new_tokens - made)
    return SimpleNamespace(request_id=rid, request=req, start=start, num_tokens=n)


MIXED = [SamplingParams(do_sample=True, temperature=0.7, top_k=5, seed=1),
         SamplingParams(),  # greedy
         SamplingParams(do_sample=True, top_p=0.8, seed=2),
         SamplingParams(do_sample=True, temperature=1.3, top_k=20, top_p=0.9, seed=3),
         SamplingParams(do_sample=True),  # engine seed
         SamplingParams(do_sample=True, top_k=1, seed=5)]


def reference_row(logits: torch.Tensor, p: SamplingParams, key: int) -> int:
    """One row the plain way: temperature, top-k, top-p on a 1-D row, then Gumbel-max with the row's key."""
    x = logits.float() / p.temperature
    if p.top_k is not None and p.top_k < x.numel():
        x[x < torch.topk(x, p.top_k).values[-1]] = float("-inf")
    if p.top_p is not None and p.top_p < 1.0:
        sx, order = torch.sort(x)
        drop = sx.softmax(-1).cumsum(-1) <= 1 - p.top_p
        drop[-1] = False
        x[order[drop]] = float("-inf")
    g = gumbel_noise(torch.tensor([[key & 0x7FFFFFFF]]), torch.tensor([[key >> 31]]), x.numel())[0]
    return int((x + g).argmax())


def test_batched_rows_equal_the_per_row_reference():
    torch.manual_seed(0)
    s = Sampler(torch.device("cpu"), seed=11)
    for trial in range(5):
        logits = torch.randn(len(MIXED), V) * 3
        entries = [entry(f"r{i}", p, start=4 + trial) for i, p in enumerate(MIXED)]
        got = s.sample(logits, entries)[0].tolist()
        for i, (e, p) in enumerate(zip(entries, MIXED)):
            if not p.do_sample:
                assert got[i] == int(logits[i].argmax())
                continue
            index = 4 + trial + 1 - 5
            key = row_key(p.seed, index) if p.seed is not None else row_key(11, index, s._ordinals[e.request_id])
            assert got[i] == reference_row(logits[i], p, key), (trial, i)


def test_one_batched_draw_no_per_row_calls(monkeypatch):
    # Fails on a per-row loop: warpers and the draw run once per step for all rows, and multinomial is never used.
    calls = {"draw": [], "warp": 0}
    real_draw = Sampler.draw

    def spy_draw(self, logits, rows):
        calls["draw"].append(len(rows))
        return real_draw(self, logits, rows)

    def counted(fn):
        def wrapper(x, rows):
            calls["warp"] += 1
            return fn(x, rows)
        return wrapper

    monkeypatch.setattr(Sampler, "draw", spy_draw)
    monkeypatch.setattr(sm, "WARPERS", tuple(counted(f) for f in sm.WARPERS))
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: pytest.fail("per-row multinomial"))
    s = Sampler(torch.device("cpu"), seed=0)
    s.sample(torch.randn(len(MIXED), V), [entry(f"r{i}", p) for i, p in enumerate(MIXED)])
    assert calls == {"draw": [5], "warp": len(sm.WARPERS)}


def test_draw_has_no_host_sync():
    # The accelerator path (lazy_top_p off, the default off CPU); the CPU's lazy top-p reads flags on the host.
    s = Sampler(torch.device("cpu"), seed=0, lazy_top_p=False)
    logits = torch.randn(len(MIXED), V)
    entries = [entry(f"r{i}", p) for i, p in enumerate(MIXED)]
    out = logits.argmax(-1)
    rows = s.rows(entries)  # host side: builds the parameter tensors (one copy each)
    with HostSyncProbe() as probe:
        out.index_copy_(0, rows.index, s.draw(logits, rows)[0])
    assert probe.calls == []


def test_host_sync_probe_sees_multinomial_and_item():
    # The probe itself: what the old per-row path did (multinomial; and .item() checks) is caught.
    with HostSyncProbe() as probe:
        torch.multinomial(torch.ones(4), 1)
        torch.ones(2)[torch.tensor([True, False])]
        torch.ones(1).item()
    assert probe.calls == ["multinomial", "boolean-mask indexing", "item"]


def test_seeded_samples_do_not_depend_on_the_batch():
    torch.manual_seed(1)
    s1, s2 = Sampler(torch.device("cpu"), seed=0), Sampler(torch.device("cpu"), seed=99)
    row = torch.randn(V)
    p = SamplingParams(do_sample=True, temperature=0.9, top_k=30, top_p=0.95, seed=1234)
    alone = s1.sample(row[None], [entry("a", p)])[0].tolist()[0]
    crowd_logits = torch.randn(7, V)
    crowd_logits[4] = row
    crowd = [entry(f"x{i}", MIXED[i % len(MIXED)]) for i in range(7)]
    crowd[4] = entry("another-id", p)
    assert s2.sample(crowd_logits, crowd)[0].tolist()[4] == alone
    # the next output index draws differently
    assert any(s1.sample(row[None], [entry("a", p, start=4 + k)])[0].tolist()[0] != alone for k in range(1, 6))


def test_exhausted_rows_are_not_drawn():
    s = Sampler(torch.device("cpu"), seed=0)
    p = SamplingParams(do_sample=True, max_new_tokens=3)
    assert s.rows([entry("a", p, made=4)]) is None  # async: a sample past max_new_tokens is never applied
    assert len(s.rows([entry("a", p, made=3), entry("b", p, made=2)])) == 2


def test_distribution_matches_softmax():
    # 6000 draws of one row with fixed keys: the frequencies follow softmax(logits / T) (chi-square, 7 dof).
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, -30.0])
    p = SamplingParams(do_sample=True, temperature=0.8, seed=7)
    s = Sampler(torch.device("cpu"))
    n = 6000
    entries = [entry("a", p, start=4 + k) for k in range(n)]
    got = s.sample(logits.expand(n, -1), entries)[0]
    counts = torch.bincount(got, minlength=8).double()
    expect = (logits / 0.8).softmax(-1).double() * n
    chi2 = float((((counts - expect) ** 2) / expect.clamp(min=1e-9))[:7].sum())
    assert chi2 < 24.3, (counts.tolist(), expect.tolist())  # p = 0.001 quantile of chi-square(7)
    assert counts[7] == 0


def test_top_k_and_top_p_bound_the_support():
    torch.manual_seed(3)
    logits = torch.randn(1, V) * 2
    s = Sampler(torch.device("cpu"))
    top5 = set(torch.topk(logits[0], 5).indices.tolist())
    pk = SamplingParams(do_sample=True, top_k=5, seed=1)
    drawn = {s.sample(logits, [entry("a", pk, start=4 + k)])[0].item() for k in range(300)}
    assert drawn <= top5 and len(drawn) > 1
    probs, order = logits[0].softmax(-1).sort(descending=True)
    nucleus = set(order[: int((probs.cumsum(0) < 0.5).sum()) + 1].tolist())
    pp = SamplingParams(do_sample=True, top_p=0.5, seed=1)
    drawn = {s.sample(logits, [entry("a", pp, start=4 + k)])[0].item() for k in range(300)}
    assert drawn <= nucleus and len(drawn) >= min(2, len(nucleus))


def test_gumbel_noise_is_finite_and_standard():
    g = gumbel_noise(torch.arange(64).view(-1, 1), torch.full((64, 1), 5), 4096)
    assert torch.isfinite(g).all()
    assert abs(float(g.mean()) - 0.5772) < 0.01 and abs(float(g.var()) - math.pi ** 2 / 6) < 0.03


def test_engine_step_draws_once_for_all_sampling_rows(monkeypatch):
    # Through a real engine (CPU runner): every step with sampling rows makes exactly one batched draw.
    sizes = []
    real_draw = Sampler.draw
    monkeypatch.setattr(Sampler, "draw", lambda self, lg, rows: (sizes.append(len(rows)), real_draw(self, lg, rows))[1])
    monkeypatch.setattr(torch, "multinomial", lambda *a, **k: pytest.fail("per-row multinomial"))
    eng = cbnb.Engine(tiny_model("tiny:llama"), config=config(page_size=16))
    with eng:
        outs = results(submit_together(eng, STD_PROMPTS, 6, do_sample=True, temperature=0.9, top_k=40, seed=3))
    assert all(o.state.name == "FINISHED" and len(o.token_ids) == 6 for o in outs)
    assert sum(sizes) == 6 * len(STD_PROMPTS) and max(sizes) > 1
