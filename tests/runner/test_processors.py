"""The oracle, extended to logits processors: greedy outputs (CPU, float32) equal ``model.generate`` with the same
generation arguments on each prompt alone, with requests of different processor settings in one batch, under
configs that force chunking, prefix hits, swaps, soft resets and async batching."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import cbnb
from cbnb.core.requests import RequestState

from helpers_engine import (
    assert_cache_empty, async_engine, config, paused, random_prompts, results, tiny_model, torch_threads)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
N = 20
MODEL = "tiny:llama"


class OpenAIPenalties(LogitsProcessor):
    """A plain reference for OpenAI's penalties: x - count * frequency - (count > 0) * presence, counts over the
    generated tokens only."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        for t, c in Counter(input_ids[0, self.prompt_len:].tolist()).items():
            scores[0, t] -= c * self.frequency + self.presence
        return scores


def generate(model, prompt, n, eos=None, processors=None, **kw):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=0,
                             logits_processor=LogitsProcessorList(processors or []), **kw)
    return out[0, len(prompt):].tolist()


def cases(model, prompts):
    """(prompt, engine kwargs, reference tokens) per request: every processor, each with values taken from the
    request's plain greedy tokens so that it changes them."""
    plain = [generate(model, p, N) for p in prompts]
    out = []

    def case(i, eng, ref_kw=None, eos=None, processors=None, prompt=None):
        p = prompt if prompt is not None else prompts[i]
        ref = generate(model, p, N, eos=eos, processors=processors, **(eng if ref_kw is None else ref_kw))
        out.append((p, dict(eng, eos_token_id=-1 if eos is None else eos), ref))
        return ref

    r = plain
    case(0, dict(repetition_penalty=1.3))
    case(1, dict(no_repeat_ngram_size=2))
    case(3, dict(no_repeat_ngram_size=3, repetition_penalty=1.1))
    case(2, dict(repetition_penalty=0.7))  # < 1 favours repeats
    case(2, dict(bad_words_ids=[[r[2][1]], [r[2][4], r[2][5]]]))
    case(4, dict(sequence_bias=[[[r[4][0]], -4.0], [[r[4][2], r[4][3]], -6.0], [[r[4][6]], 2.5]]))
    case(5, dict(suppress_tokens=[r[5][0], r[5][3]], begin_suppress_tokens=[r[5][1]]))
    case(6, dict(min_new_tokens=6), eos=r[6][2])
    case(7, dict(min_length=len(prompts[7]) + 4), eos=r[7][1])
    case(8, dict(forced_eos_token_id=r[8][0]))
    case(9, dict(forced_bos_token_id=7, begin_suppress_tokens=[plain[9][0]]), prompt=prompts[9][:1])
    case(10, dict(logit_bias={r[10][0]: -5.0, r[10][1]: 3.0}),
         ref_kw=dict(sequence_bias={(r[10][0],): -5.0, (r[10][1],): 3.0}))
    case(11, dict(frequency_penalty=0.8, presence_penalty=0.5), ref_kw={},
         processors=[OpenAIPenalties(len(prompts[11]), 0.8, 0.5)])
    case(0, {})  # plain greedy alongside
    return out


@pytest.fixture(scope="module")
def workload():
    model = tiny_model(MODEL)
    common = random_prompts([24], seed=21)[0]
    prompts = [common + t for t in random_prompts([3, 9, 17, 4, 11, 30], seed=22)] + \
        random_prompts([5, 13, 40, 2, 28, 19], seed=23)
    with torch_threads(1):
        return model, cases(model, prompts)


def _check(outs, work):
    for (p, kw, ref), o in zip(work, outs):
        assert o.state == RequestState.FINISHED, (kw, o.error)
        assert o.token_ids == ref, f"{kw} differs from model.generate"


def test_each_processor_changes_the_output(workload):
    model, work = workload
    changed = [kw for p, kw, ref in work if len(kw) > 1 and ref != generate(model, p, N)[:len(ref)]]
    assert len(changed) == len(work) - 1  # every processor case, not the plain one


@pytest.mark.parametrize("cfg", [
    dict(page_size=16, max_batch_tokens=32),
    dict(page_size=8, num_blocks=14, max_batch_tokens=64, cpu_offload_space=0.001),
    dict(page_size=8, num_blocks=14, max_batch_tokens=64, cpu_offload_space=0),
], ids=["chunked", "swap", "soft_reset"])
def test_processors_match_generate(workload, cfg):
    model, work = workload
    engine = cbnb.Engine(model, config=config(**cfg))
    with engine:
        with paused(engine):
            handles = [engine.submit(p, max_new_tokens=N, **kw) for p, kw, _ in work]
        outs = results(handles)
    assert_cache_empty(engine)
    _check(outs, work)
    if "cpu_offload_space" in cfg:
        moved = sum(o.num_offloads if cfg["cpu_offload_space"] else o.num_soft_resets for o in outs)
        assert moved > 0, "the config did not exercise offloading"


def test_processors_match_generate_with_prefix_hits(workload):
    model, work = workload
    engine = cbnb.Engine(model, config=config(page_size=8))
    with engine:
        first = [engine.submit(p, max_new_tokens=N, **kw) for p, kw, _ in work[:1]]
        results(first)
        with paused(engine):
            handles = [engine.submit(p, max_new_tokens=N, **kw) for p, kw, _ in work]
        outs = results(handles)
    _check(outs, work)
    assert sum(o.prefix_cached_tokens for o in outs[:6]) >= 5 * 24


def test_processors_match_generate_async(workload):
    model, work = workload
    engine = async_engine(model, config(page_size=16, max_batch_tokens=64))
    with engine:
        with paused(engine):
            handles = [engine.submit(p, max_new_tokens=N, **kw) for p, kw, _ in work]
        outs = results(handles)
    _check(outs, work)
    assert engine.runner.carried > 0


SAMPLED = dict(do_sample=True, temperature=0.9, top_p=0.95, top_k=50, min_p=0.02, repetition_penalty=1.2,
               no_repeat_ngram_size=3, frequency_penalty=0.3, seed=1234, logprobs=2)


def _sampled_run(engine, prompts, crowd):
    with engine:
        with paused(engine):
            mine = [engine.submit(p, max_new_tokens=N, eos_token_id=-1, **dict(SAMPLED, seed=1234 + i))
                    for i, p in enumerate(prompts)]
            others = [engine.submit(p, max_new_tokens=N, **kw) for p, kw in crowd]
        outs = results(mine)
        rest = results(others)
    engine.moved = sum(o.num_soft_resets + o.num_offloads for o in outs + rest)
    return [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]


def test_seeded_sampling_with_processors_is_independent_of_the_batch(workload):
    # The same seeded requests alone, in a crowd of other processor settings, under offloading, and with the async
    # runner: the same tokens and logprobs every time.
    model, work = workload
    prompts = [work[i][0] for i in (0, 3, 7)]
    alone = _sampled_run(cbnb.Engine(model, config=config(page_size=16)), prompts, [])
    again = _sampled_run(cbnb.Engine(model, config=config(page_size=16)), prompts, [])
    crowd = [(p, kw) for p, kw, _ in work[4:12]]
    tight = cbnb.Engine(model, config=config(page_size=8, num_blocks=14, max_batch_tokens=64, cpu_offload_space=0))
    crowded = _sampled_run(tight, prompts, crowd)
    asyn = _sampled_run(async_engine(model, config(page_size=16, max_batch_tokens=64)), prompts, crowd)
    assert tight.moved > 0, "the tight config did not soft-reset anything"
    for run in (again, crowded, asyn):
        assert [t for t, _ in run] == [t for t, _ in alone]
        assert all(abs(a - b) < 1e-4 for (_, la), (_, lb) in zip(run, alone) for a, b in zip(la, lb))
    assert len({tuple(t) for t, _ in alone}) == 3
    assert sum(1 for t, _ in alone for p in prompts if t == generate(model, p, N)[:len(t)]) == 0  # really sampled
