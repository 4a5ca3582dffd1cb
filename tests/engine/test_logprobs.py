"""Logprobs: each token's log_softmax of the processed scores (after processors and warpers), and the top-k
alternatives, equal to transformers' processed scores within 1e-5; in the output, in every streamed delta, and for
every request under ``return_logprobs=True``."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList, RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
    TopPLogitsWarper,
)

import cbnb
from cbnb.core.requests import RequestState

from helpers_engine import STD_PROMPTS, config, paused, results

pytestmark = pytest.mark.usefixtures("one_torch_thread")
N = 12
TOL = 1e-5


def generate_scores(model, prompt, **kw):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True,
                             **kw)
    return out.sequences[0, len(prompt):].tolist(), [s[0].log_softmax(-1) for s in out.scores]


def assert_logprobs(out, tokens, lps, k):
    assert out.token_ids == tokens
    assert len(out.logprobs) == len(tokens)
    for t, got, ref in zip(tokens, out.logprobs, lps):
        assert got.token_id == t
        assert abs(got.logprob - float(ref[t])) < TOL
        top = torch.topk(ref, k)
        assert [i for i, _ in got.top] == top.indices.tolist()
        assert max(abs(v - float(r)) for (_, v), r in zip(got.top, top.values)) < TOL


def test_greedy_logprobs_equal_generate_scores(llama):
    model, _ = llama
    cases = [(STD_PROMPTS[0], dict(), 3), (STD_PROMPTS[1], dict(repetition_penalty=1.3), 5),
             (STD_PROMPTS[3], dict(no_repeat_ngram_size=2, sequence_bias={(7,): 2.0}), 1)]
    refs = [generate_scores(model, p, **kw) for p, kw, _ in cases]
    engine = cbnb.Engine(model, config=config(page_size=16, max_batch_tokens=24))  # chunked prompts
    with engine:
        with paused(engine):
            hs = [engine.submit(p, max_new_tokens=N, eos_token_id=-1, logprobs=k, **kw) for p, kw, k in cases]
        streams = [list(h) for h in hs]
        outs = results(hs)
    for (p, kw, k), (tokens, lps), out, deltas in zip(cases, refs, outs, streams):
        assert_logprobs(out, tokens, lps, k)
        streamed = [lp for d in deltas for lp in d.logprobs]
        assert streamed == out.logprobs and all(len(d.logprobs) == len(d.token_ids) for d in deltas)


def test_sampled_logprobs_are_the_processed_distribution(llama):
    # Sampled tokens differ from generate's (another RNG), so the reference is teacher-forced: transformers'
    # processors applied to the model's logits over the engine's own tokens.
    model, _ = llama
    p = STD_PROMPTS[2]
    kw = dict(do_sample=True, temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.2, seed=5)
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        out = engine.generate([p], max_new_tokens=N, eos_token_id=-1, logprobs=4, **kw)[0]
    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.2), TemperatureLogitsWarper(0.8),
                                 TopKLogitsWarper(20), TopPLogitsWarper(0.9)])
    seq = p + out.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].float()
    for i, (t, got) in enumerate(zip(out.token_ids, out.logprobs)):
        ids = torch.tensor([seq[:len(p) + i]])
        ref = procs(ids, logits[len(p) + i - 1][None].clone())[0].log_softmax(-1)
        assert abs(got.logprob - float(ref[t])) < TOL, i
        finite = int(torch.isfinite(ref).sum())
        top = torch.topk(ref, min(4, finite))
        assert [j for j, _ in got.top] == top.indices.tolist()  # filtered tokens are not listed
        assert len(got.top) == min(4, finite)


def test_return_logprobs_config_gives_every_request_its_token_logprob(llama):
    model, _ = llama
    engine = cbnb.Engine(model, config=config(page_size=16, return_logprobs=True))
    with engine:
        plain, top2 = engine.generate(STD_PROMPTS[:2], max_new_tokens=4, eos_token_id=-1), None
        top2 = engine.generate(STD_PROMPTS[2:3], max_new_tokens=4, eos_token_id=-1, logprobs=2)[0]
    for o in plain:
        assert o.state == RequestState.FINISHED
        assert [lp.token_id for lp in o.logprobs] == o.token_ids
        assert all(lp.top == () and lp.logprob <= 0 for lp in o.logprobs)
    assert all(len(lp.top) == 2 for lp in top2.logprobs)
    off = cbnb.Engine(model, config=config(page_size=16))
    with off:
        assert off.generate(STD_PROMPTS[:1], max_new_tokens=2, eos_token_id=-1)[0].logprobs is None
