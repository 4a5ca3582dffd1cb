"""Engine outputs == ``model.generate`` for each request alone (CPU, float32, greedy), across models and configs.

Every test checks token equality against the per-request oracle *and* that the config really exercised the path it
names (a prompt split into chunks, prefix hits, swaps, soft resets), so a config that silently degenerates into the
easy path fails. After every run the cache must be empty and its invariants hold.

The whole module runs twice: with the fast path (the compiled CPU decode-attention kernel, `cbnb.runner.cpu.cpu_kernels`;
every engine run must then have called it) and with the torch attention path (``CBNB_CPU_KERNELS=0``).
"""

from __future__ import annotations

import pytest

import cbnb
from cbnb.core.requests import RequestState
from cbnb.runner.cpu import cpu_kernels
from cbnb.runner import model_runner

from helpers_engine import (
    SHARING_MODELS, STD_NEW, STD_PROMPTS, TIMEOUT, TINY_MODELS, WINDOW, StepRecorder, assert_cache_empty, config,
    Oracle, oracle_for, random_prompts, results, submit_together, tiny_model,
)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


KERNEL_CALLS = {"mode": None, "n": 0, "decode_steps": 0}


@pytest.fixture(scope="module", autouse=True, params=["fast", "torch"], ids=["fast_path", "torch_path"])
def fast_path(request):
    """Run the module with the CPU kernel (counting its calls) or with ``CBNB_CPU_KERNELS=0``."""
    mp = pytest.MonkeyPatch()
    if request.param == "torch":
        mp.setenv("CBNB_CPU_KERNELS", "0")
    else:
        mp.delenv("CBNB_CPU_KERNELS", raising=False)
        if not cpu_kernels.available():
            pytest.skip(f"the CPU kernel cannot be built here: {cpu_kernels.build_error()}")
    real = cpu_kernels.paged_decode

    def counted(*a, **k):
        KERNEL_CALLS["n"] += 1
        return real(*a, **k)

    mp.setattr(cpu_kernels, "paged_decode", counted)
    build = model_runner.build_step_batch

    def counting_build(entries, *a, **k):
        if any(e.num_tokens == 1 and e.start > 0 for e in entries):
            KERNEL_CALLS["decode_steps"] += 1
        return build(entries, *a, **k)

    mp.setattr(model_runner, "build_step_batch", counting_build)
    KERNEL_CALLS["mode"] = request.param
    yield request.param
    mp.undo()


@pytest.fixture(autouse=True)
def _kernel_used():
    """On the fast path every test whose engines decoded went through the kernel; on the torch path none did."""
    before, steps = KERNEL_CALLS["n"], KERNEL_CALLS["decode_steps"]
    yield
    if KERNEL_CALLS["decode_steps"] == steps:
        return
    if KERNEL_CALLS["mode"] == "fast":
        assert KERNEL_CALLS["n"] > before, "the fast path never called the decode kernel"
    else:
        assert KERNEL_CALLS["n"] == before


@pytest.fixture(scope="module", params=TINY_MODELS)
def tiny(request):
    """(name, model, oracle) with the standard references computed once for the module."""
    name = request.param
    model = tiny_model(name)
    oracle = oracle_for(name)
    for p in STD_PROMPTS:
        oracle(p, STD_NEW)
    return name, model, oracle


def _run(model, cfg, prompts=STD_PROMPTS, max_new_tokens=STD_NEW, **kw):
    engine = cbnb.Engine(model, config=cfg)
    rec = StepRecorder(engine)
    with engine:
        outs = results(submit_together(engine, prompts, max_new_tokens, **kw))
    assert_cache_empty(engine)
    return engine, rec, outs


def _assert_match(oracle, prompts, outs, ns):
    ns = ns if isinstance(ns, list) else [ns] * len(prompts)
    for i, (p, o, n) in enumerate(zip(prompts, outs, ns)):
        assert o.state == RequestState.FINISHED, (i, o.state, o.error)
        assert o.prompt_token_ids == p
        assert o.token_ids == oracle(p, n), f"request {i} (prompt {len(p)} tokens) differs from model.generate"
        assert o.finish_reason == "length"


def test_reference_crosses_sliding_window():
    # The workload itself must cross the 16-token window of the sliding models, in the prompt and in generation.
    assert any(len(p) > WINDOW for p in STD_PROMPTS)
    assert any(len(p) < WINDOW < len(p) + STD_NEW for p in STD_PROMPTS)
    assert tiny_model("tiny:gemma3").config.sliding_window == WINDOW
    assert tiny_model("tiny:mistral").config.sliding_window == WINDOW


# ----------------------------------------------------------------------------------------------- configs
def test_default_config(tiny):
    name, model, oracle = tiny
    engine, rec, outs = _run(model, config())
    _assert_match(oracle, STD_PROMPTS, outs, STD_NEW)
    assert engine.config.page_size == 256 and isinstance(engine.config.num_blocks, int)


def test_chunked_prefill(tiny):
    name, model, oracle = tiny
    engine, rec, outs = _run(model, config(page_size=16, max_batch_tokens=32))
    _assert_match(oracle, STD_PROMPTS, outs, STD_NEW)
    long_ids = {o.request_id for o, p in zip(outs, STD_PROMPTS) if len(p) > 32}
    assert long_ids, "the workload needs prompts longer than the token budget"
    # Every prompt longer than the budget was really split, and no step exceeded the budget.
    assert long_ids <= rec.split_prompts()
    assert rec.max_step_tokens() <= 32
    for o, p in zip(outs, STD_PROMPTS):
        chunks = [e for e in rec.entries(o.request_id) if e.phase == "prefill"]
        assert sum(e.num_tokens for e in chunks) >= len(p)
        if len(p) > 32:
            assert len(chunks) >= 2


@pytest.mark.parametrize("scheduler", ["fifo", "prefill_first", "vllm"])
def test_schedulers(tiny, scheduler):
    name, model, oracle = tiny
    engine, rec, outs = _run(model, config(page_size=16, max_batch_tokens=40, scheduler_type=scheduler))
    assert engine.core.scheduler.name == scheduler
    _assert_match(oracle, STD_PROMPTS, outs, STD_NEW)
    assert rec.split_prompts(), "chunking should occur with a 40-token budget"


def test_swap_offload(tiny):
    name, model, oracle = tiny
    # Pure sliding (mistral) requests hold at most ceil(16 / 8) = 2 blocks each: fewer blocks so that they stall.
    nb = 5 if name == "tiny:mistral" else 12
    engine, rec, outs = _run(model, config(page_size=8, num_blocks=nb, cpu_offload_space=0.001, max_batch_tokens=64))
    _assert_match(oracle, STD_PROMPTS, outs, STD_NEW)
    assert engine.cache.swap is not None
    assert sum(o.num_offloads for o in outs) > 0, "no request was swapped out: the test did not exercise swap"
    assert rec.swapped_out


@pytest.mark.parametrize("sharing", [False, True], ids=["no_sharing", "sharing"])
def test_soft_reset(tiny, sharing):
    name, model, oracle = tiny
    nb = 5 if name == "tiny:mistral" else 12
    engine, rec, outs = _run(model, config(page_size=8, num_blocks=nb, cpu_offload_space=0, max_batch_tokens=64,
                                           allow_block_sharing=sharing))
    _assert_match(oracle, STD_PROMPTS, outs, STD_NEW)
    assert engine.cache.swap is None
    assert sum(o.num_offloads for o in outs) == 0
    assert sum(o.num_soft_resets for o in outs) > 0, "no soft reset happened: the test did not exercise it"


@pytest.mark.parametrize("sharing", [False, True], ids=["no_sharing", "sharing"])
def test_vllm_policy_recompute_preemption(tiny, sharing):
    name, model, oracle = tiny
    nb = 5 if name == "tiny:mistral" else 12
    engine, rec, outs = _run(model, config(page_size=8, num_blocks=nb, max_batch_tokens=64, scheduler_type="vllm",
                                           allow_block_sharing=sharing))
    _assert_match(oracle, STD_PROMPTS, outs, STD_NEW)
    assert sum(o.num_soft_resets for o in outs) > 0, "nothing was preempted: the test did not exercise it"


def test_mixed_max_new_tokens(tiny):
    name, model, oracle = tiny
    ns = [1, 24, 2, 1, 17, 9]
    engine, rec, outs = _run(model, config(page_size=16, max_batch_tokens=64), max_new_tokens=ns)
    _assert_match(oracle, STD_PROMPTS, outs, ns)
    assert [len(o.token_ids) for o in outs] == ns


def test_cancel_mid_run_others_match(tiny):
    name, model, oracle = tiny
    engine = cbnb.Engine(model, config=config(page_size=16, max_batch_tokens=64))

    def before(work):
        # Cancel request 2 in the step where it produces its 5th token.
        for s in work.plan.scheduled:
            if s.request.prompt_ids == STD_PROMPTS[2] and s.samples and len(s.request.output_ids) == 4:
                engine.cancel(s.request_id)

    StepRecorder(engine, before=before)
    with engine:
        outs = results(submit_together(engine, STD_PROMPTS, STD_NEW))
    assert outs[2].state == RequestState.CANCELLED
    assert outs[2].finish_reason == "cancelled"
    assert 4 <= len(outs[2].token_ids) < STD_NEW
    assert outs[2].token_ids == oracle(STD_PROMPTS[2], len(outs[2].token_ids))
    others = [i for i in range(len(STD_PROMPTS)) if i != 2]
    _assert_match(oracle, [STD_PROMPTS[i] for i in others], [outs[i] for i in others], STD_NEW)
    assert_cache_empty(engine)


@pytest.mark.parametrize("cfg", [
    dict(page_size=12, max_batch_tokens=7),  # page size not dividing the window; 7-token chunks
    dict(page_size=5, num_blocks=20, max_batch_tokens=13, prefix_eviction="lru"),
], ids=["page12_mbt7", "page5_tight_lru"])
def test_odd_geometry(tiny, cfg):
    name, model, oracle = tiny
    engine, rec, outs = _run(model, config(**cfg), max_new_tokens=16)
    _assert_match(oracle, STD_PROMPTS, outs, 16)
    assert rec.max_step_tokens() <= cfg["max_batch_tokens"]


# ----------------------------------------------------------------------------------------------- prefix caching
@pytest.fixture(scope="module")
def shared_prefix_prompts():
    common = random_prompts([48], seed=11)[0]
    tails = random_prompts([3, 9, 16, 21], seed=12)
    return [common + t for t in tails]


@pytest.mark.parametrize("name", SHARING_MODELS)
def test_prefix_sharing(name, shared_prefix_prompts):
    model = tiny_model(name)
    oracle = oracle_for(name)
    prompts = shared_prefix_prompts
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        first = engine.generate(prompts[:1], max_new_tokens=12, eos_token_id=-1, timeout=TIMEOUT)
        rest = results(submit_together(engine, prompts[1:], 12))
        # The whole prompt cached: the last prompt token is still computed (its logits are needed).
        again = engine.generate(prompts[:1], max_new_tokens=12, eos_token_id=-1, timeout=TIMEOUT)
    assert_cache_empty(engine)
    outs = first + rest + again
    _assert_match(oracle, prompts + prompts[:1], outs, 12)
    assert first[0].prefix_cached_tokens == 0
    for o in rest:
        assert o.prefix_cached_tokens >= 48, o.prefix_cached_tokens
        assert o.prefix_cached_tokens % 16 == 0
    # Prompt (51 tokens) and 12 generated tokens: the first 3 full blocks of the prompt are cached (at most 50).
    assert 48 <= again[0].prefix_cached_tokens <= len(prompts[0]) - 1


@pytest.mark.parametrize("name", SHARING_MODELS)
@pytest.mark.parametrize("swap", [0.001, 0], ids=["swap", "soft_reset"])
def test_shared_prefixes_under_memory_pressure(name, swap):
    # Prefix hits, deduplication, eviction and offloading together: blocks restored from the host or recomputed
    # after a soft reset are hashed again and may be shared by the next request.
    model, oracle = tiny_model(name), oracle_for(name)
    common = random_prompts([40], seed=3)[0]
    prompts = [common + t for t in random_prompts([2, 9, 17, 4, 11], seed=4)] + [common[:20]] + STD_PROMPTS[:3]
    engine = cbnb.Engine(model, config=config(page_size=5, num_blocks=20, max_batch_tokens=13,
                                              cpu_offload_space=swap))
    with engine:
        warm = engine.generate(prompts[:1], max_new_tokens=4, eos_token_id=-1, timeout=TIMEOUT)
        outs = results(submit_together(engine, prompts, 16))
    assert_cache_empty(engine)
    assert warm[0].token_ids == oracle(prompts[0], 4)
    _assert_match(oracle, prompts, outs, 16)
    assert sum(o.prefix_cached_tokens for o in outs) > 0
    moved = sum(o.num_offloads for o in outs) if swap else sum(o.num_soft_resets for o in outs)
    assert moved > 0


@pytest.mark.parametrize("name", SHARING_MODELS)
def test_prefix_hashed_in_last_forward(name):
    # transformers never hashes blocks completed in a request's last forward (max_new_tokens=1): cbnb does.
    model = tiny_model(name)
    oracle = oracle_for(name)
    p = random_prompts([40], seed=13)[0]
    engine = cbnb.Engine(model, config=config(page_size=16))
    with engine:
        a = engine.generate([p], max_new_tokens=1, eos_token_id=-1, timeout=TIMEOUT)[0]
        b = engine.generate([p + [7, 8]], max_new_tokens=5, eos_token_id=-1, timeout=TIMEOUT)[0]
    assert a.token_ids == oracle(p, 1)
    assert b.token_ids == oracle(p + [7, 8], 5)
    assert b.prefix_cached_tokens == 32


def test_no_prefix_sharing_for_sliding_models(shared_prefix_prompts):
    for name in ("tiny:gemma3", "tiny:mistral"):
        engine = cbnb.Engine(tiny_model(name), config=config(page_size=16))
        assert not engine.cache.sharing
        with engine:
            a = engine.generate(shared_prefix_prompts[:1], max_new_tokens=8, eos_token_id=-1, timeout=TIMEOUT)
            b = engine.generate(shared_prefix_prompts[1:2], max_new_tokens=8, eos_token_id=-1, timeout=TIMEOUT)
        assert b[0].prefix_cached_tokens == 0
        oracle = oracle_for(name)
        assert a[0].token_ids == oracle(shared_prefix_prompts[0], 8)
        assert b[0].token_ids == oracle(shared_prefix_prompts[1], 8)


# ----------------------------------------------------------------------------------------------- max positions
def test_max_new_tokens_unset_bounded_by_max_positions():
    model = tiny_model("tiny:llama")
    oracle = oracle_for("tiny:llama")
    max_pos = model.config.max_position_embeddings
    p = random_prompts([max_pos - 6], seed=14)[0]
    engine = cbnb.Engine(model, config=config(page_size=64))
    with engine:
        out = engine.generate([p], eos_token_id=-1, timeout=TIMEOUT)[0]
        clipped = engine.generate([p], max_new_tokens=100, eos_token_id=-1, timeout=TIMEOUT)[0]
        with pytest.raises(ValueError, match="max positions"):
            engine.submit(random_prompts([max_pos], seed=15)[0], eos_token_id=-1)
    assert out.state == RequestState.FINISHED and out.finish_reason == "length"
    assert len(out.token_ids) == 6
    assert out.token_ids == oracle(p, 6)
    assert clipped.token_ids == out.token_ids


# ----------------------------------------------------------------------------------------------- real model
# Under CPU contention (other processes on the 2 cores) one intra-op thread is also faster for SmolLM2's small
# matrices, so the module-wide single thread applies here too.
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "2 + 2 ="]
N_REAL = 16


@pytest.fixture(scope="module")
def smollm2():
    model, tok = cbnb.load_model("smollm2-135m", dtype=None, device=None)
    return model, tok, Oracle(model)


@pytest.mark.slow
def test_smollm2_matches_generate(smollm2):
    model, tok, oracle = smollm2
    engine = cbnb.Engine(model, tokenizer=tok, config=config(page_size=16, max_batch_tokens=32))
    rec = StepRecorder(engine)
    with engine:
        outs = engine.generate(QUESTIONS, max_new_tokens=N_REAL, eos_token_id=-1, timeout=TIMEOUT)
    assert_cache_empty(engine)
    refs = [oracle(o.prompt_token_ids, N_REAL) for o in outs]
    for o, ref in zip(outs, refs):
        assert o.state == RequestState.FINISHED
        assert len(o.prompt_token_ids) > 10  # the chat template was applied
        assert o.token_ids == ref
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    # The chat template's system prompt is a shared prefix: a later request may start from cached blocks, so check
    # that each prompt was computed exactly once (chunks + prefix hit) and that chunking happened.
    assert rec.split_prompts()
    for o in outs:
        chunks = [e for e in rec.entries(o.request_id) if e.phase == "prefill"]
        assert sum(e.num_tokens for e in chunks) + o.prefix_cached_tokens == len(o.prompt_token_ids)
        assert all(e.num_tokens <= 32 for e in chunks)
    assert "Paris" in outs[0].text
    # A cache of 6 blocks of 16 tokens cannot hold the three requests (about 50 tokens each): swaps happen.
    tight = cbnb.Engine(model, tokenizer=tok, config=config(page_size=16, num_blocks=6, max_batch_tokens=64,
                                                            cpu_offload_space=0.01))
    with tight:
        swapped = results(submit_together(tight, [o.prompt_token_ids for o in outs], N_REAL))
    assert_cache_empty(tight)
    assert [o.token_ids for o in swapped] == refs
    assert sum(o.num_offloads for o in swapped) > 0


@pytest.mark.slow
def test_smollm2_chat_streaming_with_default_eos(smollm2):
    model, tok, oracle = smollm2
    question = QUESTIONS[0]
    engine = cbnb.Engine(model, tokenizer=tok, config=config(page_size=16))
    with engine:
        h = engine.submit(question, max_new_tokens=N_REAL)  # the model's EOS (<|im_end|> = 2) may stop it
        deltas = list(h)
        out = h.result(timeout=TIMEOUT)
        as_messages = engine.submit([{"role": "user", "content": question}], max_new_tokens=1)
        plain = engine.submit(question, max_new_tokens=1, chat=False)
        msg_ids = as_messages.result(timeout=TIMEOUT).prompt_token_ids
        plain_ids = plain.result(timeout=TIMEOUT).prompt_token_ids
    assert_cache_empty(engine)
    templated = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True)
    templated = list(templated["input_ids"] if hasattr(templated, "keys") else templated)
    assert out.prompt_token_ids == msg_ids == templated
    assert plain_ids == tok(question)["input_ids"]
    ref = oracle(out.prompt_token_ids, N_REAL)
    expected = ref[: ref.index(2) + 1] if 2 in ref else ref
    assert out.token_ids == expected
    assert out.finish_reason == ("eos" if 2 in ref else "length")
    assert "Paris" in out.text
    assert "".join(d.text for d in deltas) == out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert deltas[-1].finished and len(deltas) > 2
