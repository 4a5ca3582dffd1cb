"""`cbnb.runner.processors` against transformers' own logits processors, row by row: random histories of different
lengths, random parameters per row, one batched `apply` for all rows. Plus the sampler's no-host-sync property with
processors and logprobs, and seeded samples independent of the batch with processors on."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from transformers.generation.logits_process import (
    ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, LogitsProcessorList, MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor, MinPLogitsWarper, NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor, SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from cbnb.core.requests import SamplingParams
from cbnb.runner.sampling import Sampler

from helpers_sync import HostSyncProbe
from test_processors import OpenAIPenalties

V = 40
EOS = 3


def request(rid, prompt, made, params):
    return SimpleNamespace(request_id=rid, prompt_ids=prompt, output_ids=made, sampling=params,
                           max_new_tokens=params.max_new_tokens,
                           tokens_left=None if params.max_new_tokens is None else params.max_new_tokens - len(made))


def entry(req):
    n = len(req.prompt_ids) + len(req.output_ids)
    return SimpleNamespace(request_id=req.request_id, request=req, start=n - 1, num_tokens=1)


def random_params(rng: random.Random) -> dict:
    kw: dict = {}
    pick = rng.sample(["rep", "ngram", "bad", "bias", "minlen", "minnew", "feos", "supp", "bsupp", "fbos", "oa",
                       "lb"], rng.randint(1, 4))
    if "rep" in pick:
        kw["repetition_penalty"] = rng.choice([0.6, 1.3, 2.0])
    if "ngram" in pick:
        kw["no_repeat_ngram_size"] = rng.randint(1, 4)
    if "bad" in pick:
        kw["bad_words_ids"] = [[rng.randrange(V)] for _ in range(2)] + [
            [rng.randrange(V) for _ in range(rng.randint(2, 3))] for _ in range(2)] + [[EOS]]
    if "bias" in pick:
        kw["sequence_bias"] = {tuple(rng.randrange(V) for _ in range(rng.randint(1, 3))): rng.uniform(-5, 5)
                               for _ in range(4)}
    if "minlen" in pick:
        kw["min_length"] = rng.randint(1, 20)
    if "minnew" in pick:
        kw["min_new_tokens"] = rng.randint(1, 6)
    if "feos" in pick:
        kw["forced_eos_token_id"] = [rng.randrange(V), EOS]
    if "supp" in pick:
        kw["suppress_tokens"] = [rng.randrange(V) for _ in range(3)]
    if "bsupp" in pick:
        kw["begin_suppress_tokens"] = [rng.randrange(V) for _ in range(3)]
    if "fbos" in pick:
        kw["forced_bos_token_id"] = rng.randrange(V)
    if "oa" in pick:
        kw["frequency_penalty"], kw["presence_penalty"] = rng.uniform(-2, 2), rng.uniform(-2, 2)
    if "lb" in pick:
        kw["logit_bias"] = {rng.randrange(V): rng.uniform(-100, 100) for _ in range(3)}
    return kw


def reference(scores, prompt, made, kw, max_new):
    """transformers' processors for one row, in `_get_logits_processor`'s order (OpenAI's after the repetition
    penalty, where cbnb applies them)."""
    ids = torch.tensor([prompt + made])
    plen = len(prompt)
    procs = []
    bias = dict(kw.get("sequence_bias", {}))
    for t, b in kw.get("logit_bias", {}).items():
        bias[(t,)] = bias.get((t,), 0.0) + b
    if bias:
        procs.append(SequenceBiasLogitsProcessor({k: float(v) for k, v in bias.items()}))
    if "repetition_penalty" in kw:
        procs.append(RepetitionPenaltyLogitsProcessor(kw["repetition_penalty"]))
    if "frequency_penalty" in kw:
        procs.append(OpenAIPenalties(plen, kw["frequency_penalty"], kw["presence_penalty"]))
    if "no_repeat_ngram_size" in kw:
        procs.append(NoRepeatNGramLogitsProcessor(kw["no_repeat_ngram_size"]))
    if "bad_words_ids" in kw:
        procs.append(NoBadWordsLogitsProcessor(kw["bad_words_ids"], EOS))
    if "min_length" in kw:
        procs.append(MinLengthLogitsProcessor(kw["min_length"], EOS))
    if "min_new_tokens" in kw:
        procs.append(MinNewTokensLengthLogitsProcessor(plen, kw["min_new_tokens"], EOS))
    if "forced_bos_token_id" in kw:
        procs.append(ForcedBOSTokenLogitsProcessor(kw["forced_bos_token_id"]))
    if "forced_eos_token_id" in kw:
        procs.append(ForcedEOSTokenLogitsProcessor(plen + max_new, kw["forced_eos_token_id"]))
    if "suppress_tokens" in kw:
        procs.append(SuppressTokensLogitsProcessor(kw["suppress_tokens"]))
    if "begin_suppress_tokens" in kw:
        begin = plen if (plen > 1 or "forced_bos_token_id" not in kw) else plen + 1
        procs.append(SuppressTokensAtBeginLogitsProcessor(kw["begin_suppress_tokens"], begin))
    return LogitsProcessorList(procs)(ids, scores[None].clone())[0]


@pytest.mark.parametrize("seed", range(6))
def test_batched_processors_equal_transformers_row_by_row(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    sampler = Sampler(torch.device("cpu"), seed=0)
    rows = []
    for i in range(12):
        plen = rng.choice([1, 1, 2, 5, 9])
        prompt = [rng.randrange(4, 12) for _ in range(plen)]  # a small alphabet: n-grams and prefixes repeat
        made = [rng.randrange(4, 12) for _ in range(rng.choice([0, 0, 1, 3, 8, 15]))]
        kw = random_params(rng)
        max_new = len(made) + rng.choice([1, 2, 5])
        rows.append((request(f"r{i}", prompt, made, SamplingParams(max_new_tokens=max_new, eos_token_ids=[EOS],
                                                                    logprobs=0, **kw)), kw, max_new))
    entries = [entry(r) for r, _, _ in rows]
    logits = torch.randn(len(rows), V) * 3
    got_rows = sampler.rows(entries, V)
    got = sampler.process(logits, got_rows)
    for i, (req, kw, max_new) in enumerate(rows):
        ref = reference(logits[i], req.prompt_ids, req.output_ids, kw, max_new)
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref)), (i, kw)
        fin = torch.isfinite(ref)
        torch.testing.assert_close(got[i][fin], ref[fin], rtol=1e-5, atol=1e-5, msg=lambda m: f"{i} {kw}: {m}")


def test_history_grows_on_the_device_across_steps():
    # Two decode steps of one request without the host learning the first token (as with async batching): the second
    # step's repetition penalty sees the first step's token, appended on the device.
    sampler = Sampler(torch.device("cpu"), seed=0)
    p = SamplingParams(repetition_penalty=100.0, logprobs=0)
    req = request("a", [5, 6], [], p)
    logits = torch.zeros(1, V)
    logits[0, 9] = 5.0
    logits[0, 10] = 4.0
    tok, _ = sampler.sample(logits, [SimpleNamespace(request_id="a", request=req, start=0, num_tokens=2)])
    assert tok.tolist() == [9]
    # next step: the host has not applied token 9 yet (pending), the row draws output token 1
    nxt = SimpleNamespace(request_id="a", request=req, start=2, num_tokens=1)
    tok, _ = sampler.sample(logits.clone(), [nxt])
    assert tok.tolist() == [10]  # 9 is in the history: 5.0 / 100 < 4.0


def test_warpers_equal_transformers():
    torch.manual_seed(4)
    sampler = Sampler(torch.device("cpu"), seed=0)
    settings = [dict(temperature=0.7, top_k=5), dict(top_p=0.6), dict(min_p=0.2), dict(temperature=1.5, top_k=10,
                top_p=0.9, min_p=0.05), dict(min_p=0.0)]
    reqs = [request(f"w{i}", [4, 5], [], SamplingParams(do_sample=True, seed=i, **kw)) for i, kw in enumerate(settings)]
    logits = torch.randn(len(reqs), V) * 2
    got = sampler.process(logits, sampler.rows([entry(r) for r in reqs], V))
    for i, kw in enumerate(settings):
        procs = []
        if "temperature" in kw:
            procs.append(TemperatureLogitsWarper(kw["temperature"]))
        if "top_k" in kw:
            procs.append(TopKLogitsWarper(kw["top_k"]))
        if "top_p" in kw:
            procs.append(TopPLogitsWarper(kw["top_p"]))
        if kw.get("min_p"):
            procs.append(MinPLogitsWarper(kw["min_p"]))
        ref = LogitsProcessorList(procs)(torch.tensor([[4, 5]]), logits[i:i + 1].clone())[0]
        assert torch.equal(torch.isinf(got[i]), torch.isinf(ref)), kw
        fin = torch.isfinite(ref)
        torch.testing.assert_close(got[i][fin], ref[fin])


def test_processors_and_logprobs_have_no_host_sync():
    rng = random.Random(9)
    sampler = Sampler(torch.device("cpu"), seed=0)
    reqs = [request(f"r{i}", [rng.randrange(4, 12) for _ in range(6)], [rng.randrange(4, 12) for _ in range(4)],
                    SamplingParams(do_sample=bool(i % 2), temperature=0.8, top_p=0.9, logprobs=3,
                                   eos_token_ids=[EOS], **random_params(rng))) for i in range(8)]
    entries = [entry(r) for r in reqs]
    logits = torch.randn(len(reqs), V)
    sampler.sample(logits, entries)  # first draw: the histories are filled from the host
    for r in reqs:
        r.output_ids.append(5)
    entries = [entry(r) for r in reqs]
    rows = sampler.rows(entries, V)  # host side: parameter tensors
    with HostSyncProbe() as probe:
        tok, x = sampler.draw(logits, rows)
    assert probe.calls == []
    assert tok.shape == (8,)


def test_seeded_samples_with_processors_do_not_depend_on_the_batch():
    p = SamplingParams(do_sample=True, temperature=0.9, top_p=0.95, repetition_penalty=1.3, no_repeat_ngram_size=2,
                       seed=77, logprobs=2)
    row = torch.randn(V)
    alone = Sampler(torch.device("cpu"), seed=1)
    a = alone.sample(row[None], [entry(request("x", [4, 5, 6, 4, 5], [6], p))])[0].tolist()
    crowd = Sampler(torch.device("cpu"), seed=2)
    rng = random.Random(0)
    others = [request(f"o{i}", [rng.randrange(4, 12) for _ in range(7)], [],
                      SamplingParams(do_sample=True, seed=i, **random_params(rng))) for i in range(5)]
    reqs = others[:2] + [request("y", [4, 5, 6, 4, 5], [6], p)] + others[2:]
    logits = torch.randn(len(reqs), V)
    logits[2] = row
    b = crowd.sample(logits, [entry(r) for r in reqs])[0].tolist()
    assert b[2] == a[0]
