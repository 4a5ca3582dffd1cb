"""The server's protocol layer without a server: request parsing into engine arguments, and stop-string search."""

from __future__ import annotations

import inspect

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from cbnb.engine.engine import Engine
from cbnb.server.protocol import ApiError, parse_request
from cbnb.engine.stops import TextStopFilter

ENGINE_ARGS = frozenset(inspect.signature(Engine.submit).parameters)


def test_sampling_fields_map_to_submit_arguments():
    g = parse_request("completion", {"prompt": "hi", "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3,
                                     "ignore_eos": True, "max_tokens": 5}, ENGINE_ARGS)
    assert g.submit_kwargs == {"do_sample": True, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3,
                               "ignore_eos": True}
    assert g.max_tokens == 5 and g.prompt == "hi" and not g.stream
    greedy = parse_request("completion", {"prompt": [1, 2], "temperature": 0, "top_p": 0.5}, ENGINE_ARGS)
    assert greedy.submit_kwargs == {} and greedy.max_tokens == 16  # OpenAI's default for completions
    chat = parse_request("chat", {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                                                {"type": "text", "text": "b"}]}]},
                         ENGINE_ARGS)
    assert chat.prompt == [{"role": "system", "content": "ab"}] and chat.max_tokens is None
    assert chat.submit_kwargs == {"do_sample": True, "temperature": 1.0}  # OpenAI's default temperature samples


def test_neutral_values_of_unsupported_fields_are_accepted():
    g = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "n": 1, "frequency_penalty": 0,
                               "presence_penalty": 0, "logit_bias": {}, "logprobs": False, "tool_choice": "none",
                               "response_format": {"type": "text"}}, ENGINE_ARGS)
    assert "frequency_penalty" not in g.submit_kwargs


@pytest.mark.parametrize("field, value", [("frequency_penalty", 0.5), ("presence_penalty", -1.0),
                                          ("logit_bias", {"5": 10}), ("min_tokens", 3)])
def test_fields_the_engine_lacks_are_refused_and_mapped_once_it_has_them(field, value):
    arg = {"min_tokens": "min_new_tokens"}.get(field, field)
    assert arg in ENGINE_ARGS  # the engine takes it (generation parity)
    with pytest.raises(ApiError) as e:
        parse_request("completion", {"prompt": "x", field: value}, ENGINE_ARGS - {arg})
    assert e.value.status == 400 and e.value.message == f"not supported yet: {field}" and e.value.param == field
    g = parse_request("completion", {"prompt": "x", field: value}, ENGINE_ARGS)
    assert g.submit_kwargs[arg] == ({5: 10} if field == "logit_bias" else value)


def test_stop_goes_to_the_engine_when_it_takes_stop():
    body = {"prompt": "x", "stop": "\n\n"}
    assert parse_request("completion", body, ENGINE_ARGS - {"stop"}).stop == ["\n\n"]
    g = parse_request("completion", body, ENGINE_ARGS)
    assert g.stop is None and g.submit_kwargs["stop"] == ["\n\n"]


@example(text="aaca", stops=["c", "aca"], cuts=[3]).via("a stop inside a longer one completes first")
@settings(max_examples=300, deadline=None)
@given(text=st.text(alphabet="abc\n", max_size=40), stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4),
                                                                   min_size=1, max_size=3),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_stop_matcher_equals_cutting_at_the_first_stop(text, stops, cuts):
    # Generation halts once a stop string is complete: the first end of one, character by character, cuts the text
    # (the longest of those ending there).
    hits = [e - max(len(s) for s in stops if text[:e].endswith(s))
            for e in range(1, len(text) + 1) if any(text[:e].endswith(s) for s in stops)]
    want = text[:hits[0]] if hits else text
    m, out, prev = TextStopFilter(stops), [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        out.append(m.push(text[prev:c]))
        prev = max(prev, c)
        emitted = "".join(out)
        assert want.startswith(emitted)  # never sends what a stop string would cut
    if not m.stopped:
        out.append(m.flush())
    assert "".join(out) == want
    assert m.stopped == bool(hits)


def test_extra_fields_logprobs_n_and_batches_map_to_engine_requests():
    g = parse_request("completion", {"prompt": ["a", [1, 2]], "n": 3, "logprobs": 2, "temperature": 1, "seed": 9,
                                     "min_p": 0.1, "repetition_penalty": 1.2, "stop_token_ids": [5],
                                     "metadata": {"k": "v"}, "store": True, "service_tier": "auto"}, ENGINE_ARGS)
    assert g.prompts == ["a", [1, 2]] and g.n == 3 and g.logprobs == 2 and g.stop_token_ids == [5]
    assert g.submit_kwargs == {"do_sample": True, "temperature": 1, "seed": 9, "min_p": 0.1,
                               "repetition_penalty": 1.2, "logprobs": 2}
    assert [g.seed_of(j) for j in range(3)] == [9, 10, 11]
    chat = parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                                  "top_logprobs": 5, "parallel_tool_calls": True}, ENGINE_ARGS)
    assert chat.logprobs == 5 and chat.submit_kwargs["logprobs"] == 5 and chat.n == 1
    assert parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True},
                         ENGINE_ARGS).logprobs == 0
    assert parse_request("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": False},
                         ENGINE_ARGS).logprobs is None
    with pytest.raises(ApiError) as e:
        parse_request("completion", {"prompt": "x", "logprobs": 1}, ENGINE_ARGS - {"logprobs"})
    assert e.value.message == "not supported yet: logprobs"
    with pytest.raises(ApiError) as e:
        parse_request("completion", {"prompt": "x", "min_p": 0.2}, ENGINE_ARGS - {"min_p"})
    assert e.value.param == "min_p"


def test_vllm_json_spellings_close_objects_as_vllms_default_backend_does():
    """guided_json and structured_outputs.json: an object listing properties takes no other (vLLM's xgrammar; its
    disable_additional_properties makes the guidance backend do the same), while OpenAI's response_format keeps
    JSON Schema's open objects unless strict."""
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    msgs = [{"role": "user", "content": "x"}]
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": schema}},
                  {"structured_outputs": {"json": schema, "disable_additional_properties": False}}):
        g = parse_request("chat", {"messages": msgs, **extra}, ENGINE_ARGS)
        assert g.submit_kwargs["response_format"]["json_schema"]["strict"] is True, extra
    g = parse_request("chat", {"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": schema}}}, ENGINE_ARGS)
    assert not g.submit_kwargs["response_format"]["json_schema"].get("strict")


@pytest.mark.parametrize("kind", ["chat", "completion"])
def test_vllm_fields_not_implemented_say_so(kind):
    """A vLLM user's bad_words / allowed_token_ids / cache_salt are vLLM's, not unknown: 'not supported yet'."""
    base = {"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}
    for field, value in (("bad_words", ["no"]), ("allowed_token_ids", [1, 2]), ("cache_salt", "s")):
        with pytest.raises(ApiError, match=f"not supported yet: {field}") as e:
            parse_request(kind, {**base, field: value}, ENGINE_ARGS)
        assert e.value.param == field
    with pytest.raises(ApiError, match="Unrecognized request argument supplied: no_such_field"):
        parse_request(kind, {**base, "no_such_field": 1}, ENGINE_ARGS)
