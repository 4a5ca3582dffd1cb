"""The server driven by the real `openai` SDK: completions, chat, streaming, stop sequences, usage, and 200 concurrent
streaming clients whose greedy outputs equal `engine.generate` (tiny:llama, float32, CPU, a byte-level tokenizer)."""

from __future__ import annotations

import asyncio

import openai
import pytest

from helpers_engine import TIMEOUT, assert_no_blocks
from helpers_server import one_thread, byte_tokenizer, ended, text_prompts, wait_until  # noqa: F401 (fixtures)


def reference(engine, prompt, n, chat=False):
    """What the engine alone gives for this prompt, greedy (the request's own output, EOS honoured)."""
    return engine.generate([prompt], max_new_tokens=n, chat=chat, timeout=TIMEOUT)[0]


def first_hit(ids, stop):
    """Tokens generated when the decoded text first contains `stop` (the server counts up to that token)."""
    tok = byte_tokenizer()
    for m in range(1, len(ids) + 1):
        if stop in tok.decode(ids[:m], skip_special_tokens=True):
            return m
    raise AssertionError("stop string never appears")


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_greedy_equals_engine_and_reports_usage(served, client):
    engine, _ = served
    prompt = "the quick brown fox"
    ref = reference(engine, prompt, 12)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.model == "tiny" and r.id.startswith("cmpl-http-")
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == ("length" if ref.finish_reason == "length" else "stop")
    assert r.usage.prompt_tokens == len(byte_tokenizer()(prompt)["input_ids"])
    assert r.usage.completion_tokens == len(ref.token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_completion_from_token_ids(served, client):
    engine, _ = served
    ids = [5, 77, 300, 12, 9]
    ref = reference(engine, ids, 6)
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == ref.text and r.usage.prompt_tokens == 5


def test_chat_uses_the_chat_template(served, client):
    engine, _ = served
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ref = reference(engine, messages, 10)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.text
    templated = byte_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert r.usage.prompt_tokens == len(templated["input_ids"]) == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.token_ids)


def test_chat_streaming_chunks_and_usage(served, client):
    engine, _ = served
    messages = [{"role": "user", "content": "tell me about the lazy dog"}]
    ref = reference(engine, messages, 16)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    body = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in body)
    assert text == ref.text
    assert len([c for c in body if c.choices[0].delta.content]) >= 2  # one chunk per delta, not one blob
    assert body[-1].choices[0].finish_reason in ("length", "stop")
    assert all(c.usage is None for c in body)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == len(ref.token_ids)
    assert last.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_completion_streaming_without_usage(served, client):
    engine, _ = served
    ref = reference(engine, "hello world", 9)
    chunks = list(client.completions.create(model="tiny", prompt="hello world", max_tokens=9, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequence_trims_text_and_cancels_the_request(served, client, stream):
    engine, _ = served
    prompt = "jumps over the lazy dog"
    ref = reference(engine, prompt, 40)
    text = ref.text
    # a 3-character stop string from the middle of the reference, printable so that no UTF-8 tail is held back
    k = next(i for i in range(4, len(text) - 3) if text[i:i + 3].isprintable() and text[i:i + 3].strip())
    stop = text[k:k + 3]
    want = text[:text.find(stop)]
    if stream:
        chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0,
                                                stop=[stop, "never-there"], stream=True,
                                                stream_options={"include_usage": True}))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage, rid = chunks[-1].usage, chunks[0].id.removeprefix("cmpl-")
    else:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stop=stop)
        got, finish, usage, rid = r.choices[0].text, r.choices[0].finish_reason, r.usage, r.id.removeprefix("cmpl-")
    assert got == want and stop not in got
    assert finish == "stop"
    assert usage.completion_tokens == first_hit(ref.token_ids, stop)
    out = wait_until(lambda: ended(engine, rid), what="the stopped request to end")
    if usage.completion_tokens < 40:  # the engine ended it at the stop string (or the server cancelled it)
        assert (out.state.name == "FINISHED" and out.finish_reason == "stop" and out.stop_reason == stop
                or out.state.name == "CANCELLED" or len(out.token_ids) == len(ref.token_ids))
    assert_no_blocks(engine, rid)


def test_sampling_with_seed_is_reproducible(client):
    kw = dict(model="tiny", prompt="hello", max_tokens=12, temperature=0.9, top_p=0.9, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_sdk_sees_openai_errors(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="other", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, echo=True, stream=True, logprobs=1)
    assert e.value.body["message"].startswith("not supported yet: echo") and e.value.body["param"] == "echo"
    # the engine takes the penalties (generation parity): mapped, not refused
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2, frequency_penalty=0.5).choices
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=0)
    assert e.value.body["param"] == "n"


def test_two_hundred_concurrent_streams_equal_generate(served):
    engine, server = served
    prompts = text_prompts(200, seed=3)
    lengths = [4 + i % 13 for i in range(200)]
    refs = [reference(engine, p, n) for p, n in zip(prompts, lengths)]

    async def one(client, prompt, n):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, usage = [], None
        async for c in stream:
            if c.choices:
                text.append(c.choices[0].text)
            if c.usage is not None:
                usage = c.usage
        return "".join(text), usage

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0,
                                      timeout=TIMEOUT) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    before = server.counters()["requests_total"]
    results = asyncio.run(main())
    for (text, usage), ref in zip(results, refs):
        assert text == ref.text
        assert usage.completion_tokens == len(ref.token_ids)
    counters = server.counters()
    assert counters["requests_total"] - before == 200
    print("peak requests in flight:", counters["peak_in_flight"])
    assert counters["peak_in_flight"] >= 2  # they overlapped (how many depends on timing)
    wait_until(lambda: server.counters()["in_flight"] == 0, what="no request in flight")
    assert not engine.core.requests
