"""Engine-wide defaults from a `GenerationConfig` (a request's arguments override them), processors cbnb does not
implement (`drop_unsupported_processors`), bad values named by field, tiny temperatures, and a non-finite row that
fails only its own request."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import GenerationConfig

import cbnb
from cbnb.engine.phases import MAX_CONSECUTIVE_FAILURES
from cbnb.core.requests import RequestState, SamplingParams

from helpers_engine import STD_PROMPTS, VOCAB, config, paused, results
from test_processors import generate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_generation_config_gives_defaults_and_requests_override_them(llama):
    model, oracle = llama
    gc = GenerationConfig(max_new_tokens=10, repetition_penalty=1.3, no_repeat_ngram_size=3, eos_token_id=None)
    engine = cbnb.Engine(model, config=config(page_size=16), generation_config=gc)
    p = STD_PROMPTS[1]
    with engine:
        default = engine.submit(p, eos_token_id=-1).result()
        plain = engine.submit(p, eos_token_id=-1, repetition_penalty=1.0, no_repeat_ngram_size=0).result()
        longer = engine.submit(p, eos_token_id=-1, max_new_tokens=14, no_repeat_ngram_size=0).result()
    assert default.token_ids == generate(model, p, 10, repetition_penalty=1.3, no_repeat_ngram_size=3)
    assert default.processors[:2] == ("repetition_penalty=1.3", "no_repeat_ngram_size=3")
    assert plain.token_ids == oracle(p, 10)
    assert longer.token_ids == generate(model, p, 14, repetition_penalty=1.3)


def test_model_generation_config_is_the_default(llama):
    model, oracle = llama
    saved = model.generation_config
    model.generation_config = GenerationConfig(**saved.to_dict())
    model.generation_config.no_repeat_ngram_size = 2
    try:
        engine = cbnb.Engine(model, config=config(page_size=16))
        with engine:
            out = engine.generate(STD_PROMPTS[:1], max_new_tokens=12, eos_token_id=-1)[0]
    finally:
        model.generation_config = saved
    assert out.token_ids == generate(model, STD_PROMPTS[0], 12, no_repeat_ngram_size=2)


def test_unsupported_processors_are_dropped_with_a_warning_or_refused(llama):
    model, oracle = llama
    gc = {"typical_p": 0.5, "epsilon_cutoff": 0.1}
    with pytest.warns(UserWarning, match="dropping logits processors cbnb does not implement: typical_p=0.5, "
                                          "epsilon_cutoff=0.1"):
        engine = cbnb.Engine(model, config=config(page_size=16), generation_config=gc)
    with engine:
        out = engine.generate(STD_PROMPTS[:1], max_new_tokens=6, eos_token_id=-1)[0]
    assert out.token_ids == oracle(STD_PROMPTS[0], 6)
    with pytest.raises(ValueError, match=r"typical_p=0\.5.*drop_unsupported_processors=True"):
        cbnb.Engine(model, config=config(drop_unsupported_processors=False), generation_config=gc)
    with pytest.raises(ValueError, match="typical_p"):
        engine.reconfigure(config(page_size=16, drop_unsupported_processors=False))
    with pytest.raises(ValueError, match="num_beams=2 is not supported"):
        cbnb.Engine(model, generation_config=GenerationConfig(num_beams=2))
    with pytest.raises(ValueError, match="generation_config: repetition_penalty"):
        cbnb.Engine(model, generation_config={"repetition_penalty": -1.0})
    with pytest.warns(UserWarning, match="max_length=30 is not used"):
        cbnb.Engine(model, generation_config={"max_length": 30})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cbnb.Engine(model, generation_config=GenerationConfig(typical_p=1.0, top_k=50))  # neutral: nothing to drop


@pytest.mark.parametrize("kw, field", [
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=-1.5), "repetition_penalty"),
    (dict(no_repeat_ngram_size=-1), "no_repeat_ngram_size"), (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
    (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(bad_words_ids=[[]]), "bad_words_ids"), (dict(bad_words_ids=[[VOCAB + 3]]), "bad_words_ids"),
    (dict(sequence_bias={(4,): float("inf")}), "sequence_bias"), (dict(min_p=1.5), "min_p"),
    (dict(min_new_tokens=-2), "min_new_tokens"), (dict(suppress_tokens=[-1]), "suppress_tokens"),
    (dict(forced_eos_token_id=VOCAB), "forced_eos_token_id"), (dict(stop=[""]), "stop"),
    (dict(stop="x"), "stop"),  # no tokenizer
])
def test_bad_values_raise_naming_the_field(llama, kw, field):
    model, _ = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        with pytest.raises(ValueError, match=field):
            engine.submit(STD_PROMPTS[0], max_new_tokens=2, **kw)
        assert engine.generate(STD_PROMPTS[:1], max_new_tokens=1, eos_token_id=-1)[0].state == RequestState.FINISHED


def test_tiny_temperatures_are_greedy(llama):
    model, oracle = llama
    assert SamplingParams(do_sample=True, temperature=1e-300).greedy
    assert not SamplingParams(do_sample=True, temperature=1e-5).greedy
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        with paused(engine):
            hs = [engine.submit(p, max_new_tokens=8, eos_token_id=-1, do_sample=True, temperature=t, top_p=0.9)
                  for p, t in zip(STD_PROMPTS[:3], (1e-300, 1e-30, 5e-6))]
        outs = results(hs)
    for p, o in zip(STD_PROMPTS, outs):
        assert o.state == RequestState.FINISHED and o.token_ids == oracle(p, 8)
        assert o.processors[0].startswith("greedy (temperature")


def test_a_non_finite_row_fails_only_its_request(llama):
    model, oracle = llama
    engine = cbnb.Engine(model, config=config(page_size=16))
    poisoned = set()

    def nan_rows(x, rows):  # a sampler hook: the poisoned requests' logits become NaN
        mask = torch.tensor([p.seed in poisoned for p in rows.params]).unsqueeze(1)
        return torch.where(mask, torch.full_like(x, float("nan")), x)

    engine.runner.sampler.processors.append(nan_rows)
    with engine:
        for round_ in range(MAX_CONSECUTIVE_FAILURES + 1):  # more bad steps in a row than kill an engine
            poisoned.add(100 + round_)
            with paused(engine):
                bad = engine.submit(STD_PROMPTS[0], max_new_tokens=6, eos_token_id=-1, do_sample=True,
                                    seed=100 + round_)
                banned = engine.submit(STD_PROMPTS[1], max_new_tokens=6, eos_token_id=-1,
                                       suppress_tokens=list(range(VOCAB)))  # every token ruled out
                good = [engine.submit(p, max_new_tokens=6, eos_token_id=-1) for p in STD_PROMPTS[2:4]]
            b, z = bad.result(), banned.result()
            assert b.state == RequestState.FAILED and "not finite" in b.error
            assert z.state == RequestState.FAILED and "suppress_tokens" in z.error
            for p, o in zip(STD_PROMPTS[2:4], results(good)):
                assert o.state == RequestState.FINISHED and o.token_ids == oracle(p, 6)
        assert engine.state == "running"
