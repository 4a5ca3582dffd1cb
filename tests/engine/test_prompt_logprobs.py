"""`submit(prompt_logprobs=k)`: every prompt token's logprob from the prefill equals ``log_softmax`` of the model's
own logits (tiny:llama, float32, CPU), under chunked prefill, with the prompt already in the prefix cache (such a
request bypasses it), and next to ordinary requests in the same steps."""

from __future__ import annotations

import pytest
import torch

import cbnb

from helpers_engine import TIMEOUT, async_engine, config, random_prompts, tiny_model


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


def oracle(model, prompt):
    """log_softmax of the plain forward's logits, computed before any engine routes the model's attention."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check(out, prompt, ref, k):
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for p, t in enumerate(out.prompt_logprobs[1:]):
        assert t.token_id == prompt[p + 1]
        assert abs(t.logprob - ref[p, prompt[p + 1]].item()) <= 1e-5
        values, ids = ref[p].topk(k)
        assert [i for i, _ in t.top] == ids.tolist()
        assert [v for _, v in t.top] == pytest.approx(values.tolist(), abs=1e-5)


@pytest.fixture(scope="module")
def setup():
    model = tiny_model("tiny:llama")
    prompts = random_prompts([45, 7, 33], seed=11)
    refs = [oracle(model, p) for p in prompts]
    # max_batch_tokens 16: the 45-token prompt is prefilled in chunks of at most 16, across page boundaries
    engine = cbnb.Engine(model, config=config(page_size=16, num_blocks=64, max_batch_tokens=16))
    yield engine, prompts, refs
    engine.stop()


def test_prompt_logprobs_equal_the_models_under_chunked_prefill(setup):
    engine, prompts, refs = setup
    handles = [engine.submit(p, max_new_tokens=3, prompt_logprobs=k) for p, k in zip(prompts, (3, 0, 20))]
    plain = engine.submit(prompts[0], max_new_tokens=3)  # shares steps with them, asks for nothing
    for h, p, ref, k in zip(handles, prompts, refs, (3, 0, 20)):
        check(h.result(timeout=TIMEOUT), p, ref, k)
    assert plain.result(timeout=TIMEOUT).prompt_logprobs is None


def test_a_cached_prompt_is_recomputed_so_no_position_is_lost(setup):
    engine, prompts, refs = setup
    engine.generate([prompts[0]], max_new_tokens=2, timeout=TIMEOUT)  # its full pages are now in the prefix cache
    again = engine.generate([prompts[0]], max_new_tokens=1, timeout=TIMEOUT)[0]
    assert again.prefix_cached_tokens == 32  # a plain request hits them
    out = engine.submit(prompts[0], max_new_tokens=2, prompt_logprobs=2).result(timeout=TIMEOUT)
    assert out.prefix_cached_tokens == 0
    check(out, prompts[0], refs[0], 2)
    # and its generated tokens are those of the plain request (the same greedy decode)
    assert out.token_ids[:1] == again.token_ids


@pytest.mark.parametrize("bad", [-1, 21, True, 1.5, "2"])
def test_bad_prompt_logprobs_name_the_argument(setup, bad):
    engine, prompts, _ = setup
    with pytest.raises(ValueError, match=r"prompt_logprobs must be an integer in \[0, 20\]"):
        engine.submit(prompts[1], max_new_tokens=1, prompt_logprobs=bad)


def test_the_cuda_runner_refuses_prompt_logprobs():
    engine = async_engine(tiny_model("tiny:llama"), config(page_size=16, num_blocks=32))
    try:
        with pytest.raises(ValueError, match="not supported by this engine's runner"):
            engine.submit([5, 6, 7], max_new_tokens=1, prompt_logprobs=1)
    finally:
        engine.stop()
