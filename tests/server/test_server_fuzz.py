"""Fuzzed request bodies (hypothesis) against a live server: every answer is a well-formed response or an OpenAI
error (never a 500), the engine stays alive, a greedy stream running alongside is unaffected, and every accepted
request ends in the engine (nothing lost)."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers_engine import TIMEOUT, torch_threads
from helpers_server import ended, served_engine, wait_until

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "robot"])},
    optional={"content": st.text(max_size=24) | st.lists(st.fixed_dictionaries({"type": st.just("text"),
                                                                              "text": st.text(max_size=8)}),
                                                        max_size=2) | JSON,
              "name": st.text(max_size=6) | JSON},
)
FIELDS = {
    "model": st.sampled_from(["tiny", "other"]) | JSON,
    "prompt": st.text(max_size=40) | st.lists(st.integers(-3, 600), max_size=12)
    | st.lists(st.text(max_size=10) | st.lists(st.integers(-3, 600), max_size=4), max_size=3) | JSON,
    "messages": st.lists(MESSAGE, max_size=3) | JSON,
    "max_tokens": st.integers(-2, 14) | JSON,
    "max_completion_tokens": st.integers(-2, 14),
    "temperature": st.floats(-1, 3) | JSON,
    "top_p": st.floats(-0.5, 1.5),
    "top_k": st.integers(-2, 50),
    "seed": st.integers(-2**64, 2**64),
    "stop": st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}) | JSON,
    "n": st.integers(0, 3),
    "frequency_penalty": st.floats(-3, 3),
    "logit_bias": st.dictionaries(st.sampled_from(["1", "7", "x"]), st.floats(-200, 200), max_size=2),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=10),
    "logprobs": st.integers(-1, 22) | st.booleans() | JSON,
    "top_logprobs": st.integers(-1, 22) | JSON,
    "min_p": st.floats(-0.5, 1.5) | JSON,
    "repetition_penalty": st.floats(-1, 12) | JSON,
    "stop_token_ids": st.lists(st.integers(-2, 600), max_size=3) | JSON,
    "metadata": st.dictionaries(st.text(max_size=4), st.text(max_size=4) | JSON, max_size=2) | JSON,
    "echo": st.booleans() | JSON,
}
HOSTILE = st.tuples(st.fixed_dictionaries({}, optional=FIELDS), st.dictionaries(st.text(max_size=6), JSON, max_size=2))
# Valid bodies (for either endpoint: the other one refuses them), so that a good share of the examples generate.
VALID_FIELDS = {
    "model": st.just("tiny"),
    "max_tokens": st.integers(1, 12),
    "temperature": st.sampled_from([0, 0.7, 1]) | st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(1, 50),
    "seed": st.integers(0, 2**32),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=10),
    "n": st.integers(1, 3),
    "min_p": st.floats(0, 0.5),
    "repetition_penalty": st.floats(0.5, 2),
    "stop_token_ids": st.lists(st.integers(3, 511), max_size=2),
}
VALID = st.tuples(
    st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=40)}, optional=VALID_FIELDS)
    | st.fixed_dictionaries({"messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=24)}),
        min_size=1, max_size=3)}, optional=VALID_FIELDS),
    st.just({}))
BODY = VALID | HOSTILE


@pytest.fixture(scope="module")
def served():
    with torch_threads(1), served_engine(max_tokens_limit=12) as (engine, server):
        yield engine, server


def _check_response(r: httpx.Response, stream: bool) -> str | None:
    """The request id of a 200 answer (None for an error); asserts the body is well formed either way."""
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    if r.status_code != 200:
        e = r.json()["error"]
        assert isinstance(e["message"], str) and e["message"] and e["type"] == "invalid_request_error"
        return None
    if stream:
        lines = [x for x in r.text.split("\n") if x]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(x[6:]) for x in lines[:-1]]
        assert all("error" not in c for c in chunks), chunks
        finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finals[-1] in ("stop", "length")
        return chunks[0]["id"].split("-", 1)[1]
    body = r.json()
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    return body["id"].split("-", 1)[1]


def test_fuzzed_bodies_never_hurt_the_engine(served):
    engine, server = served
    accepted: list[str] = []
    with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c:
        ref = c.post("/completions", json={"prompt": "the lazy dog", "max_tokens": 12, "temperature": 0}).json()
        bystander: dict = {}

        def watch():  # a well-behaved greedy stream while the fuzz runs
            with httpx.Client(base_url=server.url, timeout=TIMEOUT) as c2:
                r = c2.post("/completions", json={"prompt": "the lazy dog", "max_tokens": 12, "temperature": 0,
                                                  "stream": True})
                bystander["text"] = "".join(json.loads(x[6:])["choices"][0]["text"] for x in r.text.split("\n")
                                            if x.startswith("data: {"))

        @settings(max_examples=150, deadline=None, derandomize=True,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
        @given(body=BODY, chat=st.booleans(), raw=st.none() | st.binary(max_size=64))
        def one(body, chat, raw):
            fields, extra = body
            obj = {**extra, **fields}
            path = "/chat/completions" if chat or "messages" in fields else "/completions"
            content = raw if raw is not None else json.dumps(obj).encode()
            r = c.post(path, content=content, headers={"content-type": "application/json"})
            rid = _check_response(r, raw is None and obj.get("stream") is True)
            if rid is not None:
                accepted.append(rid)

        t = threading.Thread(target=watch)
        t.start()
        one()
        t.join(TIMEOUT)
    assert engine.running and server.running
    assert bystander["text"] == ref["choices"][0]["text"]
    print(f"{len(accepted)} of the fuzzed requests were valid and generated")
    assert len(accepted) >= 20, "too few fuzzed requests were valid to show anything"
    for rid in accepted:  # every accepted request ended in the engine
        assert wait_until(lambda: ended(engine, rid), what=f"{rid} to end").finished
    wait_until(lambda: server.counters()["in_flight"] == 0, what="no request in flight")
    assert not engine.core.requests
    assert 500 not in server.counters()["responses_by_status"]
