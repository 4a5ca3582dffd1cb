"""Structured output and tool calls over HTTP, with the real `openai` SDK, on the bundled SmolLM2-135M-Instruct:
`response_format` (json_object, json_schema; streamed too), `tools` with `tool_choice` none / auto / required / a
named function (OpenAI's `tool_calls`, streamed as deltas), the prompt rendering of tools, and their 400s."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from cbnb.server.tools import FALLBACK_INSTRUCTIONS, CallStream, ToolStream, call_schema, parse_calls, render

from helpers_engine import TIMEOUT
from helpers_structured import MAX_JSON_TOKENS, SCHEMAS, served_smollm2, smollm2

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two small numbers",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                                    "b": {"type": "integer", "minimum": 0, "maximum": 999}},
                   "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def served():
    with served_smollm2() as pair:
        yield pair


@pytest.fixture(scope="module")
def client(served):
    _, server = served
    return openai.OpenAI(base_url=server.url, api_key="x", timeout=TIMEOUT, max_retries=0)


def _fmt(schema, name="answer"):
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ------------------------------------------------------------------------------------------------ logprobs
def test_a_chat_answer_ended_by_its_end_token_lists_logprobs_of_its_text_only(client):
    """The chat template's end token (<|im_end|>, special) ends the answer but is not in it: no logprob entry, so
    the tokens join to the content, streamed or not (as OpenAI's API)."""
    ask = dict(model="smollm2-135m", messages=[{"role": "user", "content": "Reply with one word: yes or no?"}],
               max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**ask)
    c = r.choices[0]
    assert c.finish_reason == "stop"
    assert "".join(t.token for t in c.logprobs.content) == c.message.content
    assert all(t.token != "<|im_end|>" for t in c.logprobs.content)
    streamed = [lp for ch in client.chat.completions.create(**ask, stream=True)
                for lp in ((ch.choices[0].logprobs.content or []) if ch.choices and ch.choices[0].logprobs else [])]
    assert [t.token for t in streamed] == [t.token for t in c.logprobs.content]


# ------------------------------------------------------------------------------------------------ response_format
@pytest.mark.parametrize("sampled", [False, True])
def test_json_schema_responses_validate_every_time(client, sampled):
    kw = {"temperature": 1.0, "seed": 5, "n": 2} if sampled else {"temperature": 0}
    for name, schema in SCHEMAS.items():
        r = client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": f"A {name}."}],
                                           max_tokens=MAX_JSON_TOKENS, response_format=_fmt(schema, name), **kw)
        for c in r.choices:
            assert c.finish_reason == "stop", c.message.content
            jsonschema.validate(json.loads(c.message.content), schema)


def test_streamed_json_equals_the_whole_answer(client):
    kw = dict(model="smollm2-135m", messages=[{"role": "user", "content": "A person."}], max_tokens=MAX_JSON_TOKENS,
              temperature=0, response_format=_fmt(SCHEMAS["person"]))
    whole = client.chat.completions.create(**kw).choices[0].message.content
    text = "".join(ch.choices[0].delta.content or "" for ch in client.chat.completions.create(stream=True, **kw)
                   if ch.choices)
    assert text == whole
    jsonschema.validate(json.loads(text), SCHEMAS["person"])


def test_json_object_response(client):
    r = client.chat.completions.create(
        model="smollm2-135m", max_tokens=MAX_JSON_TOKENS, temperature=0, response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Reply with a JSON object with the keys 'city' and 'country' for Paris."}])
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": _fmt({"type": "objectx"})}, "response_format", "does not compile"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format",
     "must be a JSON schema object"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be combined"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools", "tools[].function.parameters) does not compile"),
])
def test_bad_structured_requests_are_400_naming_the_field(client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=ASK, max_tokens=4, **body)
    err = e.value.body
    assert err["param"] == param and words in err["message"], err


# ------------------------------------------------------------------------------------------------ tools
def _check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert names is None or c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


@pytest.mark.parametrize("sampled", [False, True])
def test_required_and_named_tool_choice_always_give_a_valid_call(client, sampled):
    kw = {"temperature": 1.0, "seed": 11, "n": 2} if sampled else {"temperature": 0}
    for choice, names in (("required", {"get_weather", "add"}),
                          ({"type": "function", "function": {"name": "add"}}, {"add"})):
        r = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice=choice,
                                           max_tokens=MAX_JSON_TOKENS, **kw)
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            _check_calls(c.message.tool_calls, names)


@pytest.mark.parametrize("max_tokens", [3, 12])
def test_a_forced_call_cut_by_max_tokens_is_a_cut_call_never_content(client, max_tokens):
    """Cut before its name is complete: neither content nor a call; cut later: the call with its arguments so far
    (unfinished JSON) and finish_reason "length", as OpenAI returns one. Streamed, the same call and no content."""
    ask = dict(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=max_tokens,
               temperature=0)
    c = client.chat.completions.create(**ask).choices[0]
    assert c.finish_reason == "length" and c.message.content is None
    calls = c.message.tool_calls or []
    assert len(calls) == (0 if max_tokens == 3 else 1)
    if calls:
        assert calls[0].function.name in PARAMS and calls[0].id.startswith("call_")
    content, names, args = "", [], ""
    for ch in client.chat.completions.create(**ask, stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.function.name:
                names.append(t.function.name)
            args += t.function.arguments or ""
    assert content == "" and names == [x.function.name for x in calls]
    assert args == (calls[0].function.arguments if calls else "")


def test_streamed_tool_calls_are_openai_deltas(client):
    kw = dict(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=MAX_JSON_TOKENS,
              temperature=0)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    chunks = [ch for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    deltas = [d for ch in chunks for d in (ch.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert deltas[0].function.name == whole.function.name and deltas[0].function.arguments == ""
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(whole.function.arguments)
    assert len(deltas) > 2  # the arguments stream as they are generated, not in one piece at the end
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    assert all(not ch.choices[0].delta.content for ch in chunks)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_tool_choice_parses_a_call_streamed_or_not(client):
    # SmolLM2-135M never chooses a call on its own; a response_format holding the call schema makes it answer with
    # one, which "auto" must parse into tool_calls (sent when the choice ends, when streamed).
    kw = dict(model="smollm2-135m", messages=ASK, tools=TOOLS, max_tokens=MAX_JSON_TOKENS, temperature=0,
              response_format=_fmt(call_schema(TOOLS), "call"))
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    _check_calls(whole.message.tool_calls)
    chunks = [ch.choices[0] for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    deltas = [d for ch in chunks for d in (ch.delta.tool_calls or [])]
    assert [d.function.name for d in deltas if d.function.name] == [whole.message.tool_calls[0].function.name]
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == json.loads(
        whole.message.tool_calls[0].function.arguments)
    assert not any(ch.delta.content for ch in chunks) and chunks[-1].finish_reason == "tool_calls"


def test_auto_parsing_reads_a_forced_calls_text(client):
    # A forced call's output through tool_choice "auto" parsing: the held-back text becomes the same call.
    r = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="required",
                                       max_tokens=MAX_JSON_TOKENS, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    text = json.dumps({"name": call.function.name, "arguments": json.loads(call.function.arguments)})
    s = ToolStream(TOOLS)
    assert s.push(text[:5]) == "" and s.push(text[5:]) == ""
    assert s.finish() == (None, [{"name": call.function.name, "arguments": json.loads(call.function.arguments)}])


def test_auto_and_none_tool_choice(client):
    auto = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, max_tokens=16,
                                          temperature=0)
    c = auto.choices[0]
    if c.message.tool_calls:  # the model chose a call: a valid one
        assert c.finish_reason == "tool_calls"
        _check_calls(c.message.tool_calls)
    else:
        assert c.message.content and c.finish_reason in ("stop", "length")
    chunks = [ch.choices[0] for ch in client.chat.completions.create(
        model="smollm2-135m", messages=ASK, tools=TOOLS, max_tokens=16, temperature=0, stream=True) if ch.choices]
    deltas = [d for ch in chunks for d in (ch.delta.tool_calls or [])]
    assert "".join(ch.delta.content or "" for ch in chunks) == (c.message.content or "")
    assert [d.function.name for d in deltas if d.function.name] == [t.function.name for t in c.message.tool_calls or []]
    assert chunks[-1].finish_reason == c.finish_reason
    none = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="none",
                                          max_tokens=12, temperature=0)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


def test_a_tool_result_turn_is_accepted(client):
    first = client.chat.completions.create(model="smollm2-135m", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=MAX_JSON_TOKENS, temperature=0).choices[0].message
    call = first.tool_calls[0]
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                  {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = client.chat.completions.create(model="smollm2-135m", messages=msgs, tools=TOOLS, tool_choice="none",
                                       max_tokens=16, temperature=0)
    assert r.choices[0].message.content


# ------------------------------------------------------------------------------------------------ rendering, parsing
def test_smollm2_template_ignores_tools_so_the_fallback_lists_them():
    _, tok = smollm2()
    text = tok.decode(render(tok, ASK, TOOLS))
    assert FALLBACK_INSTRUCTIONS.split("\n")[0] in text and '"name": "get_weather"' in text
    assert text.index("get_weather") < text.index("Paris")  # in the system message, before the question
    with_system = tok.decode(render(tok, [{"role": "system", "content": "Be brief."}] + ASK, TOOLS))
    assert with_system.count("<|im_start|>system") == 1 and "Be brief." in with_system
    assert tok.decode(render(tok, ASK, None)) == tok.apply_chat_template(ASK, add_generation_prompt=True,
                                                                         tokenize=False)


def test_a_tool_aware_template_renders_the_tools_itself():
    _, tok = smollm2()
    aware = ("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}{% for m in messages %}<|im_start|>"
             "{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    saved = tok.chat_template
    tok.chat_template = aware
    try:
        text = tok.decode(render(tok, ASK, TOOLS))
    finally:
        tok.chat_template = saved
    assert text.startswith("<tools>") and FALLBACK_INSTRUCTIONS.split("\n")[0] not in text


def test_call_stream_splits_a_forced_call():
    cs = CallStream()
    out = []
    for piece in ['{"na', 'me":"add","argu', 'ments":{"a":', '1,"b"', ':2}', "}"]:
        out += cs.push(piece)
    out += cs.finish(complete=True)
    assert out[0]["function"] == {"name": "add", "arguments": ""} and out[0]["id"].startswith("call_")
    assert "".join(d["function"]["arguments"] for d in out) == '{"a":1,"b":2}'
    cut = CallStream()
    assert cut.push('{"name":"ad') == [] and cut.finish(complete=False) == [] and cut.text == '{"name":"ad'


def test_parse_calls_forms():
    tools = TOOLS
    assert parse_calls('{"name": "add", "arguments": {"a": 1, "b": 2}}', tools) == (
        None, [{"name": "add", "arguments": {"a": 1, "b": 2}}])
    assert parse_calls('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>', tools)[1] == [
        {"name": "add", "arguments": {"a": 1, "b": 2}}]
    assert parse_calls('{"name": "nope", "arguments": {}}', tools) == ('{"name": "nope", "arguments": {}}', [])
    assert parse_calls("Sunny, 18 degrees.", tools) == ("Sunny, 18 degrees.", [])
    assert parse_calls('{"name": "add", "arguments": "{\\"a\\": 1}"}', tools)[1] == [{"name": "add",
                                                                                    "arguments": {"a": 1}}]
    jsonschema.Draft202012Validator.check_schema(call_schema(tools))
    assert call_schema(tools, "add")["properties"]["name"] == {"const": "add"}
    s = ToolStream(tools)
    assert s.push("  {") == "" and s.push('"name": "add", "arguments": {"a": 1, "b": 2}}') == ""
    assert s.finish() == (None, [{"name": "add", "arguments": {"a": 1, "b": 2}}])
    s = ToolStream(tools)
    assert s.push(" Hello") == " Hello" and s.push(" there") == " there" and s.finish() == (None, [])
