"""A vLLM user's requests against the tiny served engine: messages as the openai SDK dumps them, vLLM's extra fields
(structured output spellings, template fields, detokenization options, prompt logprobs, truncation, request ids),
the Responses API (plain, streamed, with previous_response_id and function tools), and /version, /ping."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessage

from helpers_engine import TIMEOUT
from helpers_server import one_thread, byte_tokenizer  # noqa: F401 (fixtures)

HI = [{"role": "user", "content": "the quick brown fox"}]
POINT = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                          "ok": {"type": "boolean"}}, "required": ["x", "ok"],
         "additionalProperties": False}


@pytest.fixture(scope="module")
def http(served):
    _, server = served
    with httpx.Client(base_url=server.url.removesuffix("/v1"), timeout=TIMEOUT) as c:
        yield c


def greedy(engine, ids, n, **kw):
    return engine.submit(list(ids), max_new_tokens=n, **kw).result(timeout=TIMEOUT)


def chat_ids(messages, **kw):
    return list(byte_tokenizer().apply_chat_template(messages, tokenize=True, **kw)["input_ids"])


def chat(client, messages=HI, **kw):
    kw.setdefault("max_tokens", 6)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


# ------------------------------------------------------------------------------------------------ messages
def test_history_of_model_dumped_messages_is_accepted_and_changes_nothing(served, client):
    first = chat(client)
    dumped = first.choices[0].message.model_dump()  # refusal, annotations, audio, function_call: null
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    plain = {"role": "assistant", "content": first.choices[0].message.content}
    follow = {"role": "user", "content": "and then?"}
    a = chat(client, [*HI, dumped, follow])
    b = chat(client, [*HI, plain, follow])
    assert a.choices[0].message.content == b.choices[0].message.content
    # a full ChatCompletionMessage with every field set the SDK's way, and content parts with refusal parts
    msg = ChatCompletionMessage(role="assistant", content=None, refusal="I cannot", annotations=[])
    c = chat(client, [*HI, msg.model_dump(), {"role": "user", "content": [{"type": "text", "text": "ok"}]}])
    d = chat(client, [*HI, {"role": "assistant", "content": "I cannot"}, {"role": "user", "content": "ok"}])
    assert c.choices[0].message.content == d.choices[0].message.content


def test_legacy_function_call_message_and_function_role(client):
    msgs = [*HI, {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}},
            {"role": "function", "name": "f", "content": "42"}]
    r = chat(client, msgs, functions=[{"name": "f", "parameters": {"type": "object", "properties": {}}}])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


# ------------------------------------------------------------------------------------------------ structured
def test_structured_output_spellings_all_constrain_the_answer(client):
    comp = client.completions
    kw = dict(max_tokens=24, temperature=1.0, seed=3)
    for extra in ({"guided_choice": ["yes", "no", "maybe so"]},
                  {"structured_outputs": {"choice": ["yes", "no", "maybe so"]}}):
        r = chat(client, **{**kw, "max_tokens": 8}, extra_body=extra)
        assert r.choices[0].message.content in ("yes", "no", "maybe so"), extra
    for extra in ({"guided_regex": "[a-c]{2,4}-[0-9]{1,3}"}, {"structured_outputs": {"regex": "[a-c]{2,4}-[0-9]{1,3}"}}):
        r = comp.create(model="tiny", prompt="code:", **kw, extra_body=extra)
        assert re.fullmatch("[a-c]{2,4}-[0-9]{1,3}", r.choices[0].text), (extra, r.choices[0].text)
    for extra in ({"guided_json": POINT}, {"guided_json": json.dumps(POINT)}, {"structured_outputs": {"json": POINT}},
                  {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": POINT}}}):
        r = comp.create(model="tiny", prompt="point:", **kw, extra_body=extra)  # completions take response_format too (vLLM)
        jsonschema.validate(json.loads(r.choices[0].text), POINT)
    r = chat(client, **kw, extra_body={"structured_outputs": {"json_object": True}})
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    grammar = 'root ::= "pick " item\nitem ::= "a" | "b"'  # GBNF, as vLLM's docs write it
    r = chat(client, **kw, extra_body={"guided_grammar": grammar})
    assert r.choices[0].message.content in ("pick a", "pick b")
    r = chat(client, **kw, extra_body={"structured_outputs": {"grammar": 'start: "x" ("y" | "z")'}})  # Lark
    assert r.choices[0].message.content in ("xy", "xz")


# ------------------------------------------------------------------------------------------------ template
def test_chat_template_fields(served, client):
    engine, _ = served
    tok = byte_tokenizer()
    template = "{{ greeting }}:{% for m in messages %}{{ m['content'] }};{% endfor %}"
    r = chat(client, extra_body={"chat_template": template, "chat_template_kwargs": {"greeting": "hello"}})
    ids = tok("hello:the quick brown fox;", add_special_tokens=False)["input_ids"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tok.decode(greedy(engine, ids, 6).token_ids, skip_special_tokens=True)
    # continue_final_message: the assistant's last message is continued; echo puts it first in the answer
    msgs = [*HI, {"role": "assistant", "content": "over the"}]
    r = chat(client, msgs, extra_body={"continue_final_message": True, "add_generation_prompt": False,
                                       "echo": True})
    ids = chat_ids(msgs, continue_final_message=True, add_generation_prompt=False)
    assert r.usage.prompt_tokens == len(ids)
    out = tok.decode(greedy(engine, ids, 6).token_ids, skip_special_tokens=True)
    assert r.choices[0].message.content == "over the" + out
    # add_generation_prompt=false alone: the template without the assistant's opening
    r = chat(client, extra_body={"add_generation_prompt": False})
    assert r.usage.prompt_tokens == len(chat_ids(HI, add_generation_prompt=False))


def test_truncate_prompt_tokens_keeps_the_last_tokens(served, client):
    engine, _ = served
    ids = chat_ids(HI, add_generation_prompt=True)
    r = chat(client, extra_body={"truncate_prompt_tokens": 5})
    assert r.usage.prompt_tokens == 5
    assert r.choices[0].message.content == byte_tokenizer().decode(greedy(engine, ids[-5:], 6).token_ids,
                                                                   skip_special_tokens=True)
    c = client.completions.create(model="tiny", prompt="a b c d e f g h", max_tokens=2, temperature=0,
                                  extra_body={"truncate_prompt_tokens": 3, "add_special_tokens": False})
    assert c.usage.prompt_tokens == 3


def test_max_model_len_bounds_prompt_plus_generated_tokens(served):
    """vLLM's --max-model-len: prompt plus max_tokens at most (400 past it), the default max_tokens fills up to it,
    /v1/models reports it, and a value past the model's context is refused; --served-model-name's other names."""
    engine, _ = served
    n = len(chat_ids(HI, add_generation_prompt=True))
    server = engine.serve(port=0, model_name="tiny", model_aliases=("other-name",), max_model_len=n + 5)
    try:
        with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=TIMEOUT) as c:
            cards = c.models.list().data
            assert [m.id for m in cards][:2] == ["tiny", "other-name"]  # vLLM's --served-model-name tiny other-name
            assert {m.model_extra["max_model_len"] for m in cards} == {n + 5}
            assert c.chat.completions.create(model="other-name", messages=HI, max_tokens=1).model == "other-name"
            with pytest.raises(openai.BadRequestError, match=r"max_model_len is \d+ tokens") as e:
                chat(c, max_tokens=6)
            assert e.value.body["code"] == "context_length_exceeded"
            r = chat(c, max_tokens=None, extra_body={"ignore_eos": True})  # the default: up to the limit
            assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (n, 5)
    finally:
        server.stop()
    with pytest.raises(ValueError, match="greater than the model's context"):
        engine.serve(port=0, max_model_len=engine.max_positions + 1)


def test_beam_search_fields_at_their_defaults_are_accepted(client):
    """Clients that always send vLLM's defaults (use_beam_search false, length_penalty) get the plain answer."""
    plain = chat(client).choices[0].message.content
    assert chat(client, extra_body={"use_beam_search": False, "length_penalty": 1.0}).choices[0].message.content == (
        plain)
    with pytest.raises(openai.BadRequestError, match="not supported yet: use_beam_search"):
        chat(client, extra_body={"use_beam_search": True})


def test_completions_logprobs_up_to_vllms_limit(client):
    """vLLM takes completions' logprobs up to 20 (its --max-logprobs), OpenAI's limit being 5."""
    r = client.completions.create(model="tiny", prompt="the quick", max_tokens=2, temperature=0, logprobs=12)
    tops = r.choices[0].logprobs.top_logprobs
    assert len(tops) == 2 and all(len(t) >= 12 for t in tops)
    with pytest.raises(openai.BadRequestError, match="less than or equal to 20"):
        client.completions.create(model="tiny", prompt="x", max_tokens=1, logprobs=21)


# ------------------------------------------------------------------------------------------------ detokenization
def test_skip_special_tokens_false_keeps_them_in_the_text(client):
    kw = dict(model="tiny", prompt="hello", max_tokens=3, temperature=0, logit_bias={"1": 100}, extra_body={})
    plain = client.completions.create(**kw)
    kept = client.completions.create(**{**kw, "extra_body": {"skip_special_tokens": False}})
    assert plain.choices[0].text == "" and kept.choices[0].text == "<|im_start|>" * 3
    streamed = client.completions.create(**{**kw, "extra_body": {"skip_special_tokens": False}}, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "<|im_start|>" * 3


def test_include_stop_str_in_output(served, client):
    engine, _ = served
    tok = byte_tokenizer()
    text = tok.decode(greedy(engine, tok("hello world")["input_ids"], 12, ignore_eos=True).token_ids,
                      skip_special_tokens=True)
    stop = text.strip()[2:4]
    assert len(stop) == 2 and stop in text
    kw = dict(model="tiny", prompt="hello world", max_tokens=12, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    cut = client.completions.create(**kw).choices[0]
    kept = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True,
                                                             "include_stop_str_in_output": True}}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop == text[:text.index(stop) + len(stop)]


# ------------------------------------------------------------------------------------------------ logprobs, ids
def test_prompt_logprobs_token_ids_request_id_and_priority(served, client, http):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2, "temperature": 0,
                                                "prompt_logprobs": 2, "request_id": "abc-1", "priority": 5,
                                                "logprobs": True, "top_logprobs": 1,
                                                "return_tokens_as_token_ids": True}).json()
    ids = chat_ids(HI, add_generation_prompt=True)
    pl = r["prompt_logprobs"]
    assert r["id"] == "chatcmpl-abc-1" and len(pl) == len(ids) and pl[0] is None
    for tid, entry in zip(ids[1:], pl[1:]):
        assert str(tid) in entry and len(entry) <= 3
        assert all(v["logprob"] <= 0 and v["decoded_token"] for v in entry.values())
        assert sorted(v["rank"] for v in entry.values() if v["rank"] is not None)[:2] == [1, 2]
    content = r["choices"][0]["logprobs"]["content"]
    assert all(re.fullmatch(r"token_id:\d+", e["token"]) for e in content)
    c = http.post("/v1/completions", json={"model": "tiny", "prompt": "hi there", "max_tokens": 1,
                                           "prompt_logprobs": 0}).json()
    assert c["choices"][0]["prompt_logprobs"][0] is None and len(c["choices"][0]["prompt_logprobs"]) == \
        c["usage"]["prompt_tokens"]


# ------------------------------------------------------------------------------------------------ responses API
def test_responses_create_equals_the_chat_answer(client):
    r = client.responses.create(model="tiny", input="the quick brown fox", max_output_tokens=6, temperature=0,
                                instructions="be brief")
    c = chat(client, [{"role": "system", "content": "be brief"}, *HI])
    assert r.output_text == c.choices[0].message.content and r.object == "response"
    assert r.usage.input_tokens == c.usage.prompt_tokens and r.usage.output_tokens == c.usage.completion_tokens
    assert r.status in ("completed", "incomplete")
    if c.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    # a conversation as items, and previous_response_id continuing the last one
    items = [{"role": "user", "content": [{"type": "input_text", "text": "the quick brown fox"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": r.output_text,
                                                                   "annotations": []}]},
             {"role": "user", "content": "and then?"}]
    a = client.responses.create(model="tiny", input=items, max_output_tokens=6, temperature=0)
    b = client.responses.create(model="tiny", input="and then?", previous_response_id=r.id, max_output_tokens=6,
                                temperature=0)
    assert a.output_text == b.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_unknown")


def test_responses_stream_sends_the_sdks_events(client):
    ref = client.responses.create(model="tiny", input="hello", max_output_tokens=8, temperature=0,
                                  include=["message.output_text.logprobs"], top_logprobs=2)
    events = list(client.responses.create(model="tiny", input="hello", max_output_tokens=8, temperature=0,
                                          stream=True, include=["message.output_text.logprobs"], top_logprobs=2))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == ref.output_text
    if deltas:
        assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") < \
            kinds.index("response.output_text.delta")
        done = next(e for e in events if e.type == "response.output_text.done")
        assert done.text == ref.output_text
        assert [lp.token for e in deltas for lp in e.logprobs] == [lp.token for lp in ref.output[0].content[0].logprobs]
    assert events[-1].response.output_text == ref.output_text


def test_responses_function_tool_round_trip(client):
    tools = [{"type": "function", "name": "get_weather", "description": "weather in a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4}},
                             "required": ["city"], "additionalProperties": False}}]
    r = client.responses.create(model="tiny", input="weather in Paris?", tools=tools, max_output_tokens=80,
                                tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert set(json.loads(calls[0].arguments)) == {"city"}
    s = list(client.responses.create(model="tiny", input="weather in Paris?", tools=tools, max_output_tokens=80,
                                     tool_choice="required", temperature=0, stream=True))
    args = "".join(e.delta for e in s if e.type == "response.function_call_arguments.delta")
    done = next(e for e in s if e.type == "response.function_call_arguments.done")
    assert done.arguments == args and json.loads(args)["city"] is not None
    follow = client.responses.create(model="tiny", previous_response_id=r.id, tools=tools, max_output_tokens=6,
                                     input=[{"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": "sunny"}], temperature=0)
    assert follow.status in ("completed", "incomplete")


def test_responses_refuses_what_it_cannot_do(http):
    for body, param in (({"input": "x", "background": True}, "background"),
                        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
                        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
                         "input[0].content[0]"),
                        ({"input": "x", "bogus": 1}, "bogus"),
                        ({"input": "x", "temperature": 3}, "temperature")):
        r = http.post("/v1/responses", json={"model": "tiny", **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_version_ping_health(http):
    assert http.get("/version").json()["version"]
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert http.get("/health").json()["status"] == "ok"


# ------------------------------------------------------------------------------------------------ LangChain agent
@pytest.mark.parametrize("responses_api", [False, True])
def test_langchain_agent_tool_round_trip(served, responses_api):
    """An agent's loop: a forced call, the tool's result sent back with LangChain's own assistant message (its
    tool_calls, and the fields LangChain adds), then a free answer; over chat completions and the Responses API."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    _, server = served
    llm = ChatOpenAI(model="tiny", base_url=server.url, api_key="x", temperature=0, max_tokens=120, max_retries=0,
                     timeout=TIMEOUT, use_responses_api=responses_api)
    history = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(history)
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather"
    assert ai.tool_calls[0]["args"]["city"] in ("Paris", "Rome")
    history += [ai, ToolMessage(get_weather.invoke(ai.tool_calls[0]["args"]), tool_call_id=ai.tool_calls[0]["id"])]
    final = llm.bind_tools([get_weather]).invoke(history)
    assert final.tool_calls or final.text  # the model chose; a well-formed message either way
    streamed = list(llm.bind_tools([get_weather], tool_choice="get_weather").stream(history[:1]))
    merged = streamed[0]
    for chunk in streamed[1:]:
        merged = merged + chunk
    assert merged.tool_calls[0]["name"] == "get_weather" and merged.tool_calls[0]["args"] == ai.tool_calls[0]["args"]


def test_responses_sdk_helpers_parse_and_stream(client):
    """The SDK's own helpers over the Responses API: `responses.parse(text_format=Model)` (a strict json_schema
    text.format) and `responses.stream(...)`'s accumulated final response."""
    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool
        grade: Literal["a", "b"]

    r = client.responses.parse(model="tiny", input="judge", text_format=Verdict, max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, Verdict)
    tools = [{"type": "function", "name": "f", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}}]
    with client.responses.stream(model="tiny", input="call f", tools=tools, tool_choice="required",
                                 max_output_tokens=80, temperature=0) as s:
        kinds = [e.type for e in s]
        final = s.get_final_response()
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert [(o.type, json.loads(o.arguments)["a"] in ("x", "y")) for o in final.output] == [("function_call", True)]
