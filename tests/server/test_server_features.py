"""The server's OpenAI/vLLM feature surface, driven by the real `openai` SDK (tiny:llama, float32, CPU, the byte-level
tokenizer): logprobs (chat and completions, streamed too) equal to the engine's own `submit(logprobs=k)`; `n` > 1 and
batched prompts in OpenAI's index order, each seeded choice equal to the engine's request with seed + j; vLLM's
sampling fields and OpenAI's metadata fields; `/tokenize`, `/detokenize`, `/v1/models/{id}` and model aliases."""

from __future__ import annotations

import httpx
import openai
import pytest

from cbnb.server.generation import TokenText

from helpers_engine import TIMEOUT
from helpers_server import one_thread, byte_tokenizer, make_engine, served_engine, wait_until  # noqa: F401 (fixtures)


@pytest.fixture(scope="module")
def http(served):
    _, server = served
    with httpx.Client(base_url=server.url.removesuffix("/v1"), timeout=TIMEOUT) as c:
        yield c


def engine_out(engine, prompt, n, chat=False, **kw):
    """The engine's own output for this prompt (greedy unless sampling keywords are given)."""
    ids = engine.encode(prompt, chat=chat) if isinstance(prompt, (str, list)) and not (
        isinstance(prompt, list) and isinstance(prompt[0], int)) else list(prompt)
    return engine.submit(ids, max_new_tokens=n, **kw).result(timeout=TIMEOUT)


def dec(i):
    return TokenText(byte_tokenizer()).text(i)


def err(r, status=400):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"} and e["message"]
    return e


# ------------------------------------------------------------------------------------------------ logprobs
def test_completion_logprobs_equal_the_engines(served, client):
    engine, _ = served
    ref = engine_out(engine, "the quick brown fox", 8, logprobs=3)
    r = client.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=8, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == [dec(t.token_id) for t in ref.logprobs]
    assert lp.token_logprobs == pytest.approx([t.logprob for t in ref.logprobs], abs=1e-6)
    for got, t in zip(lp.top_logprobs, ref.logprobs):
        want = {dec(i): v for i, v in t.top}
        want.setdefault(dec(t.token_id), t.logprob)  # OpenAI's: the alternatives and the sampled token
        assert got == pytest.approx(want, abs=1e-6)
        assert 3 <= len(got) <= 4
    check_offsets(r.choices[0].text, lp)
    assert all(v <= 0 for v in lp.token_logprobs)


def check_offsets(text, lp):
    """text_offset starts at 0, never decreases, and each whole-character token sits at its offset in the text."""
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for tok, off in zip(lp.tokens, lp.text_offset):
        if not tok.startswith("bytes:") and tok not in ("<|im_end|>", "<|endoftext|>"):
            assert text[off:off + len(tok)] == tok


def test_chat_logprobs_equal_the_engines_with_bytes(served, client):
    engine, _ = served
    messages = [{"role": "user", "content": "hello lazy dog"}]
    ref = engine_out(engine, messages, 6, chat=True, logprobs=4)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=4)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ref.logprobs)
    tt = TokenText(byte_tokenizer())
    for got, t in zip(content, ref.logprobs):
        assert got.token == dec(t.token_id) and got.logprob == pytest.approx(t.logprob, abs=1e-6)
        assert got.bytes == tt.bytes(t.token_id)
        assert [(a.token, a.bytes) for a in got.top_logprobs] == [(dec(i), tt.bytes(i)) for i, _ in t.top]
        assert [a.logprob for a in got.top_logprobs] == pytest.approx([v for _, v in t.top], abs=1e-6)
        assert len(got.top_logprobs) == 4
    # logprobs without top_logprobs: the tokens' own, no alternatives
    r0 = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True)
    assert [c.top_logprobs for c in r0.choices[0].logprobs.content] == [[]] * len(ref.logprobs)
    assert [c.logprob for c in r0.choices[0].logprobs.content] == pytest.approx(
        [t.logprob for t in ref.logprobs], abs=1e-6)
    # not asked: null, as OpenAI
    assert client.chat.completions.create(model="tiny", messages=messages, max_tokens=2).choices[0].logprobs is None


def test_token_bytes_are_the_raw_bytes_of_the_text():
    # Byte-level BPE: the bytes of consecutive tokens concatenate to the UTF-8 of their decoded text, also where one
    # token holds part of a character (its string is then U+FFFD, its bytes are not).
    tok = byte_tokenizer()
    tt = TokenText(tok)
    assert tt.byte_level
    ids = list(range(3, 512))
    raw = b"".join(bytes(tt.bytes(i)) for i in ids)
    assert raw.decode("utf-8", errors="replace") == tok.decode(ids)
    partial = [i for i in ids if tt.text(i).startswith("bytes:")]
    assert partial, "the byte tokens 0x80-0xff hold parts of characters"
    for i in partial:  # named by their bytes, never U+FFFD, so they stay distinct as completions' dict keys
        assert tt.text(i) == "bytes:" + "".join(f"\\x{b:02x}" for b in tt.bytes(i))
    assert len({tt.text(i) for i in ids}) == len(ids)
    assert TokenText(None).text(7) == "token_id:7"


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streamed_logprobs_equal_the_collected_ones(client, kind):
    if kind == "completion":
        kw = dict(model="tiny", prompt="jumps over", max_tokens=10, temperature=0, logprobs=2)
        whole = client.completions.create(**kw).choices[0]
        full = whole.logprobs
        chunks = [c for c in client.completions.create(**kw, stream=True) if c.choices]
        parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        assert sum((p.tokens for p in parts), []) == full.tokens
        assert sum((p.token_logprobs for p in parts), []) == full.token_logprobs
        assert sum((p.top_logprobs for p in parts), []) == full.top_logprobs
        assert sum((p.text_offset for p in parts), []) == full.text_offset
        assert "".join(c.choices[0].text for c in chunks) == whole.text
    else:
        kw = dict(model="tiny", messages=[{"role": "user", "content": "page cache"}], max_tokens=10, temperature=0,
                  logprobs=True, top_logprobs=2)
        full = client.chat.completions.create(**kw).choices[0].logprobs.content
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        streamed = sum((c.choices[0].logprobs.content for c in chunks if c.choices[0].logprobs), [])
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in full]


# ------------------------------------------------------------------------------------------------ echo
def test_echo_alone_gives_the_prompts_logprobs(served, client):
    engine, _ = served
    prompt = "the lazy dog jumps"
    ids = engine.encode(prompt, chat=False)
    ref = engine.submit(ids, max_new_tokens=1, prompt_logprobs=2).result(timeout=TIMEOUT).prompt_logprobs
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    (c,) = r.choices
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert lp.tokens == [dec(i) for i in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([t.logprob for t in ref[1:]], abs=1e-6)
    for got, t in zip(lp.top_logprobs[1:], ref[1:]):
        want = {dec(i): v for i, v in t.top}
        want.setdefault(dec(t.token_id), t.logprob)
        assert got == pytest.approx(want, abs=1e-6)
    check_offsets(c.text, lp)


def test_echo_with_generation_and_several_choices(served, client):
    engine, _ = served
    prompts = ["hello world", [5, 77, 300]]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=4, temperature=0, echo=True,
                                  logprobs=1)
    for c in r.choices:
        p = prompts[c.index // 2]
        ids = engine.encode(p, chat=False) if isinstance(p, str) else p
        ref = engine.submit(ids, max_new_tokens=4, logprobs=1, prompt_logprobs=1).result(timeout=TIMEOUT)
        shown = p if isinstance(p, str) else byte_tokenizer().decode(p)
        assert c.text == shown + ref.text
        assert c.logprobs.token_logprobs == pytest.approx(
            [None] + [t.logprob for t in ref.prompt_logprobs[1:]] + [t.logprob for t in ref.logprobs], abs=1e-6)
        assert len(c.logprobs.tokens) == len(ids) + len(ref.token_ids)
        check_offsets(c.text, c.logprobs)
    # echo without logprobs: the prompt's text first, nothing else
    e = client.completions.create(model="tiny", prompt="cache page", max_tokens=3, temperature=0, echo=True)
    assert e.choices[0].text == "cache page" + engine_out(engine, "cache page", 3).text
    assert e.choices[0].logprobs is None
    # streamed, too: the prompt's text is each choice's first chunk
    chunks = list(client.completions.create(model="tiny", prompt=["cache page", "the dog"], max_tokens=3,
                                            temperature=0, echo=True, stream=True))
    for i, p in enumerate(["cache page", "the dog"]):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].text == p and mine[-1].finish_reason == "length"
        assert "".join(c.text for c in mine) == p + engine_out(engine, p, 3).text
    alone = list(client.completions.create(model="tiny", prompt="cache page", max_tokens=0, echo=True, stream=True))
    assert "".join(ch.choices[0].text for ch in alone if ch.choices) == "cache page"


# ------------------------------------------------------------------------------------------------ n and batches
def test_n_choices_are_seeded_streams_equal_to_the_engines(served, client):
    engine, _ = served
    r = client.completions.create(model="tiny", prompt="hello world", n=3, max_tokens=8, temperature=1.0, seed=11)
    assert [c.index for c in r.choices] == [0, 1, 2]
    refs = [engine_out(engine, "hello world", 8, do_sample=True, temperature=1.0, seed=11 + j) for j in range(3)]
    assert [c.text for c in r.choices] == [x.text for x in refs]
    assert len({c.text for c in r.choices}) > 1  # distinct streams, not one sample three times
    assert r.usage.prompt_tokens == len(refs[0].prompt_token_ids)  # the prompt counts once
    assert r.usage.completion_tokens == sum(len(x.token_ids) for x in refs)
    # chat too
    messages = [{"role": "user", "content": "the fox"}]
    c = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=6, temperature=0.8, seed=5)
    crefs = [engine_out(engine, messages, 6, chat=True, do_sample=True, temperature=0.8, seed=5 + j)
             for j in range(2)]
    assert [(x.index, x.message.content) for x in c.choices] == [(j, crefs[j].text) for j in range(2)]
    assert c.usage.completion_tokens == sum(len(x.token_ids) for x in crefs)


def test_sibling_choices_take_the_prompt_from_the_prefix_cache(served, client):
    engine, _ = served
    prompt = list(range(3, 100))  # 97 tokens: six full 16-token pages
    before = {o.request_id for o in engine.requests_snapshot()}
    r = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=4, temperature=1.0, seed=8)
    refs = [engine_out(engine, prompt, 4, do_sample=True, temperature=1.0, seed=8 + j) for j in range(3)]
    assert [c.text for c in r.choices] == [x.text for x in refs]
    mine = [o for o in engine.requests_snapshot() if o.request_id not in before and o.request_id.startswith("http-")]
    assert sorted(o.prefix_cached_tokens for o in mine)[-2:] == [96, 96]


def test_batched_prompts_index_is_prompt_times_n_plus_choice(served, client):
    engine, _ = served
    prompts = ["the lazy dog", [5, 77, 300, 12], "cache page"]
    r = client.completions.create(model="tiny", prompt=prompts, n=2, max_tokens=5, temperature=0.9, seed=3)
    assert [c.index for c in r.choices] == list(range(6))
    refs = [engine_out(engine, p, 5, do_sample=True, temperature=0.9, seed=3 + j) for p in prompts for j in range(2)]
    assert [c.text for c in r.choices] == [x.text for x in refs]
    assert r.usage.prompt_tokens == sum(len(refs[2 * i].prompt_token_ids) for i in range(3))
    assert r.usage.completion_tokens == sum(len(x.token_ids) for x in refs)
    # a list of token-id lists, greedy: each equals its own request
    ids = [[9, 8, 7], [100, 200]]
    g = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert [c.text for c in g.choices] == [engine_out(engine, p, 4).text for p in ids]


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_streaming_several_choices(client, kind):
    if kind == "completion":
        kw = dict(model="tiny", prompt=["a quick", "brown"], n=2, max_tokens=6, temperature=1.0, seed=21)
        full = client.completions.create(**kw)
        want = {c.index: c.text for c in full.choices}
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = lambda ch: ch.text  # noqa: E731
    else:
        kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=6, temperature=1.0,
                  seed=2)
        full = client.chat.completions.create(**kw)
        want = {c.index: c.message.content for c in full.choices}
        chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        text = lambda ch: ch.delta.content or ""  # noqa: E731
    got: dict[int, str] = {}
    finished: list[int] = []
    for c in chunks[:-1]:
        (ch,) = c.choices
        got[ch.index] = got.get(ch.index, "") + text(ch)
        if ch.finish_reason is not None:
            assert ch.index not in finished
            finished.append(ch.index)
    assert got == want and sorted(finished) == sorted(want)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_a_bad_prompt_in_a_batch_queues_nothing(served, http):
    engine, server = served
    before = server.counters()["requests_total"]
    e = err(http.post("/v1/completions", json={"prompt": ["fine", [1, 99999]], "max_tokens": 2}))
    assert e["param"] == "prompt[1]" and "vocabulary" in e["message"]
    wait_until(lambda: server.counters()["in_flight"] == 0, what="no request in flight")
    assert not engine.core.requests and server.counters()["requests_total"] == before + 1


# ------------------------------------------------------------------------------------------------ fields
@pytest.mark.parametrize("path, extra, param, words", [
    ("completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ("completions", {"logprobs": True}, "logprobs", "valid integer"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("chat", {"top_logprobs": 2}, "top_logprobs", "needs logprobs=true"),
    ("chat", {"logprobs": 1}, "logprobs", "valid boolean"),
    ("completions", {"n": 0}, "n", "greater than or equal to 1"),
    ("completions", {"n": 129}, "n", "less than or equal to 128"),
    ("completions", {"n": 2.0}, "n", "valid integer"),
    ("completions", {"prompt": ["a"] * 65, "n": 2}, "n", "at most 128"),
    ("completions", {"prompt": [["a"]]}, "prompt[0]", "must be a string or a non-empty list of token ids; got list"),
    ("completions", {"prompt": ["a", 5]}, "prompt[1]", "must be a string or a non-empty list of token ids; got 5"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "digit strings); got 'abc'"),
    ("completions", {"stop": ["a"] * 5}, "stop", "at most 4 stop sequences; got 5"),
    ("completions", {"prompt": []}, "prompt", "non-empty"),
    ("completions", {"min_p": 1.5}, "min_p", "less than or equal to 1"),
    ("completions", {"min_p": "0.1"}, "min_p", "valid number"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ("completions", {"repetition_penalty": 11}, "repetition_penalty", "less than or equal to 10"),
    ("completions", {"top_k": -2}, "top_k", "greater than or equal to -1"),
    ("completions", {"min_tokens": -1}, "min_tokens", "greater than or equal to 0"),
    ("completions", {"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    ("completions", {"stop_token_ids": [512]}, "stop_token_ids", "[0, 511]"),
    ("completions", {"stop_token_ids": 5}, "stop_token_ids", "valid list"),
    ("completions", {"best_of": 2}, "best_of", "not supported yet: best_of > 1"),
    ("completions", {"suffix": "x"}, "suffix", "not supported yet: suffix"),
    ("completions", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "cannot be combined with"),
    ("chat", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ("chat", {"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "Unrecognized request argument"),
    ("chat", {"guided_regex": "(", "max_tokens": 2}, "guided_regex", "does not compile"),
    ("chat", {"continue_final_message": True}, "continue_final_message", "the last message to be the assistant's"),
    ("chat", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "greater than or equal to -1"),
    ("chat", {"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "set by the request itself"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "audio": {"id": "a"}}]}, "messages[0].audio",
     "not supported yet"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content", "'image_url' parts are not supported"),
    ("chat", {"web_search_options": {}}, "web_search_options", "not supported yet"),
    ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "with stream=true"),
    ("completions", {"echo": True, "stream": True, "logprobs": 1}, "echo", "not supported yet: echo with stream"),
    ("completions", {"max_tokens": 0}, "max_tokens", "0 is allowed only with echo=true"),
    ("chat", {"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ("completions", {"metadata": {"a": 1}}, "metadata.a", "valid string"),
    ("completions", {"store": "yes"}, "store", "valid boolean"),
    ("chat", {"service_tier": 3}, "service_tier", "valid string"),
    ("chat", {"bogus_field": 1}, "bogus_field", "Unrecognized request argument supplied: bogus_field"),
])
def test_field_errors_name_the_field(http, path, extra, param, words):
    body = {"prompt": "hi"} if path == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    body.update({"max_tokens": 2, **extra})
    e = err(http.post(f"/v1/{'chat/completions' if path == 'chat' else 'completions'}", json=body))
    assert e["param"] == param and words in e["message"], e
    assert e["message"].count("; got ") <= 1, e  # what was sent, said once


def test_vllm_fields_change_the_output_as_the_engines_arguments(served, client):
    engine, _ = served
    prompt = "the quick brown fox"
    kw = dict(do_sample=True, temperature=1.0, seed=4, top_k=20, min_p=0.05, repetition_penalty=1.3,
              min_new_tokens=3)
    ref = engine_out(engine, prompt, 8, **kw)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=1.0, seed=4,
                                  extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.3,
                                              "min_tokens": 3})
    assert r.choices[0].text == ref.text
    # stop_token_ids: the greedy run ends at the first of them (the token is generated and kept, as vLLM)
    greedy = engine_out(engine, prompt, 12, ignore_eos=True)
    stop_id = greedy.token_ids[3]
    k = greedy.token_ids.index(stop_id)
    s = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"stop_token_ids": [stop_id]})
    assert s.choices[0].finish_reason == "stop" and s.usage.completion_tokens == k + 1


def test_metadata_fields_are_accepted_and_change_nothing(served, client):
    engine, _ = served
    ref = engine_out(engine, "hello", 6)
    r = client.completions.create(model="tiny", prompt="hello", max_tokens=6, temperature=0, user="ada",
                                  extra_body={"metadata": {"team": "a"}, "store": False, "service_tier": "auto",
                                              "prompt_cache_key": "k", "safety_identifier": "s",
                                              "skip_special_tokens": True, "include_stop_str_in_output": False})
    assert r.choices[0].text == ref.text
    c = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                       metadata={"x": "y"}, store=False, service_tier="auto",
                                       parallel_tool_calls=False, temperature=0)
    assert c.choices[0].finish_reason in ("stop", "length")


# ------------------------------------------------------------------------------------------------ tokenize, models
def test_tokenize_detokenize_round_trip(served, http, client):
    engine, _ = served
    text = "the lazy dog jumps"
    r = http.post("/tokenize", json={"model": "tiny", "prompt": text}).json()
    assert r["tokens"] == byte_tokenizer()(text)["input_ids"] and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.max_positions
    assert http.post("/detokenize", json={"model": "tiny", "tokens": r["tokens"]}).json() == {"prompt": text}
    messages = [{"role": "user", "content": "hi there"}]
    t = http.post("/tokenize", json={"messages": messages}).json()
    usage = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1).usage
    assert t["count"] == usage.prompt_tokens and t["tokens"] == engine.encode(messages)
    bare = http.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert bare["tokens"] == t["tokens"][:bare["count"]] and bare["count"] < t["count"]
    assert err(http.post("/tokenize", json={"prompt": "a", "messages": messages}))["param"] == "prompt"
    assert err(http.post("/tokenize", json={}))["param"] == "prompt"
    assert err(http.post("/tokenize", json={"prompt": 5}))["param"] == "prompt"
    assert err(http.post("/detokenize", json={"tokens": [1, -1]}))["param"] == "tokens"
    assert err(http.post("/detokenize", json={"tokens": [512]}))["param"] == "tokens"
    assert err(http.post("/detokenize", json={"tokens": "abc"}))["param"] == "tokens"
    assert err(http.post("/detokenize", json={"model": "gpt-9", "tokens": [1]}), 404)["code"] == "model_not_found"


def test_model_route_and_unknown_model(http, client):
    m = client.models.retrieve("tiny")
    assert m.id == "tiny" and m.owned_by == "cbnb"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-9")
    assert e.value.body["code"] == "model_not_found"
    assert err(http.get("/v1/models/gpt-9"), 404)["param"] == "model"


def test_hf_id_alias_of_a_bundled_model(monkeypatch):
    # An engine whose model was loaded from the bundled SmolLM2's cache folder: served as "smollm2-135m", and the
    # Hugging Face id is accepted too (listed in /v1/models, echoed back in responses).
    engine = make_engine()
    monkeypatch.setattr(engine.model.config, "_name_or_path", "/no/such/cache/smollm2-135m")
    with served_engine(engine, model_name=None) as (_, server), \
            openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
        hf = "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert [m.id for m in c.models.list().data] == ["smollm2-135m", hf]
        assert c.models.retrieve(hf).id == hf  # the path route takes the slash
        a = c.completions.create(model=hf, prompt="hello", max_tokens=4, temperature=0)
        b = c.completions.create(model="smollm2-135m", prompt="hello", max_tokens=4, temperature=0)
        assert a.model == hf and b.model == "smollm2-135m" and a.choices[0].text == b.choices[0].text
        with pytest.raises(openai.NotFoundError) as e:
            c.completions.create(model="SmolLM2", prompt="hello", max_tokens=1)
        assert hf in e.value.body["message"]


def test_a_batch_that_overflows_the_engine_queue_is_429_and_leaves_nothing_queued():
    with served_engine(make_engine(max_queue_size=2)) as (engine, server), \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        e = err(c.post("/completions", json={"prompt": ["a b", "c d", "e f"], "max_tokens": 500}), 429)
        assert e["code"] == "queue_full"
        wait_until(lambda: not engine.core.requests, what="the queued choices to be cancelled")
        assert server.counters()["in_flight"] == 0
        ok = c.post("/completions", json={"prompt": ["a b", "c d"], "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and [x["index"] for x in ok.json()["choices"]] == [0, 1]
