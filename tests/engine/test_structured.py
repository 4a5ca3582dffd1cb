"""Structured output on the engine (`cbnb.engine.structured`, `cbnb.runner.grammar`): JSON-schema / json_object grammars
as a token mask, on the bundled SmolLM2-135M-Instruct."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest

import cbnb
from cbnb.core.requests import RequestState
from cbnb.engine.structured import closed, request_grammar

from helpers_engine import TIMEOUT, Oracle, paused, tiny_model
from helpers_server import wait_until
from helpers_structured import MAX_JSON_TOKENS, SCHEMAS, smollm2, smollm2_engine

PROMPTS = ["Give me a person as JSON.", "Describe your favourite colour.", "List a few test scores."]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # one torch thread (tests/conftest.py)


@pytest.fixture(scope="module")
def engine():
    eng = smollm2_engine()
    with eng:
        yield eng


def _grammar_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("grammar-masks")]


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
def test_outputs_parse_and_validate_every_time(engine, mode):
    kw = {} if mode == "greedy" else {"do_sample": True, "temperature": 1.0, "top_p": 0.95}
    handles = []
    for name, schema in SCHEMAS.items():
        for k, p in enumerate(PROMPTS):
            seed = {} if mode == "greedy" else {"seed": k}
            handles.append((schema, engine.submit(p, max_new_tokens=MAX_JSON_TOKENS, json_schema=schema, **kw,
                                                  **seed)))
    for schema, h in handles:
        out = h.result(timeout=TIMEOUT)
        assert out.state == RequestState.FINISHED and out.finish_reason == "eos", (out.text, out.error)
        jsonschema.validate(json.loads(out.text), schema)
    wait_until(lambda: len(engine.runner.sampler.constraints) == 0, what="matchers released")


def test_openai_shapes_and_pydantic_models_give_the_same_grammar(engine):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    p = PROMPTS[0]
    by_schema = engine.submit(p, max_new_tokens=MAX_JSON_TOKENS, json_schema=Person.model_json_schema())
    by_model = engine.submit(p, max_new_tokens=MAX_JSON_TOKENS, json_schema=Person)
    by_format = engine.submit(p, max_new_tokens=MAX_JSON_TOKENS, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}})
    by_strict = engine.submit(p, max_new_tokens=MAX_JSON_TOKENS, response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True}})
    by_closed = engine.submit(p, max_new_tokens=MAX_JSON_TOKENS, json_schema=closed(Person.model_json_schema()))
    outs = [h.result(timeout=TIMEOUT) for h in (by_schema, by_model, by_format, by_strict, by_closed)]
    assert outs[0].token_ids == outs[2].token_ids  # a dict schema and response_format without strict: as written
    # strict, closed by hand, and a pydantic model class (closed as the openai SDK's parse() asks): the same grammar
    assert outs[1].token_ids == outs[3].token_ids == outs[4].token_ids
    for o in outs[1:2] + outs[3:]:
        assert o.finish_reason == "eos"
        Person.model_validate_json(o.text)
    assert "json_schema(person)" in outs[2].processors and "json_schema" in outs[0].processors  # on the board


def test_json_object_gives_a_json_object(engine):
    prompts = ["Reply with a JSON object with the keys 'city' and 'country' for Paris.",
               "Give a JSON object describing a dog: its name and age."]
    for out in engine.generate(prompts, max_new_tokens=MAX_JSON_TOKENS, response_format={"type": "json_object"},
                               timeout=TIMEOUT):
        assert out.finish_reason == "eos", out.text
        assert isinstance(json.loads(out.text), dict)
    text, free = engine.generate([PROMPTS[0]] * 2, max_new_tokens=12, timeout=TIMEOUT)
    assert engine.submit(PROMPTS[0], max_new_tokens=12, response_format={"type": "text"}).result(
        timeout=TIMEOUT).token_ids == free.token_ids  # "text" is no grammar


def test_unconstrained_requests_in_the_same_batch_keep_the_greedy_oracle(engine):
    model, _ = smollm2()
    oracle = Oracle(model)
    plain = ["What is the capital of France?", "2 + 2 ="]
    ids = [engine.encode(p) for p in plain]
    refs = [oracle(i, 12) for i in ids]
    with paused(engine):  # one first batch: the four requests share steps
        hs = [engine.submit(PROMPTS[0], max_new_tokens=MAX_JSON_TOKENS, json_schema=SCHEMAS["person"],
                            do_sample=True, seed=3)]
        hs += [engine.submit(i, max_new_tokens=12, eos_token_id=-1) for i in ids]
        hs.append(engine.submit(PROMPTS[2], max_new_tokens=MAX_JSON_TOKENS, json_schema=SCHEMAS["list"]))
    outs = [h.result(timeout=TIMEOUT) for h in hs]
    assert [o.token_ids for o in outs[1:3]] == refs
    for o, schema in ((outs[0], SCHEMAS["person"]), (outs[3], SCHEMAS["list"])):
        jsonschema.validate(json.loads(o.text), schema)


def test_cancelled_and_finished_requests_release_their_matchers(engine):
    h = engine.submit(PROMPTS[1], max_new_tokens=400, response_format={"type": "json_object"}, do_sample=True,
                      seed=0, ignore_eos=True)
    it = iter(h)
    next(it)  # running, with a matcher
    assert len(engine.runner.sampler.constraints) == 1
    h.cancel()
    assert h.result(timeout=TIMEOUT).state == RequestState.CANCELLED
    wait_until(lambda: len(engine.runner.sampler.constraints) == 0, what="matcher released")
    wait_until(lambda: not _grammar_threads(), what="mask worker stopped")
    stats = engine.runner.sampler.constraints.stats
    assert stats.steps > 0 and stats.rows >= stats.steps


@pytest.mark.parametrize("kw, words", [
    ({"json_schema": {"type": "objectx"}}, "json_schema does not compile"),
    ({"json_schema": "{not json"}, "json_schema must be a JSON schema"),
    ({"json_schema": 5}, "json_schema must be a JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": "a"}}}},
     "response_format.json_schema.schema does not compile"),
    ({"response_format": {"type": "xml"}}, "response_format.type must be"),
    ({"response_format": "json"}, "response_format must be an object"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "bogus": 1}}},
     "response_format.json_schema.bogus"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format.schema"),
    ({"response_format": {"type": "json_object"}, "json_schema": {}}, "not both"),
])
def test_bad_grammars_are_refused_at_submit_naming_the_field(engine, kw, words):
    with pytest.raises(ValueError, match=words.replace(".", r"\.")):
        engine.submit("hi", max_new_tokens=4, **kw)
    assert engine.running


def test_an_engine_without_a_tokenizer_refuses_grammars():
    with pytest.raises(ValueError, match="needs the engine's tokenizer"):
        request_grammar(None, 512, {2}, json_schema={"type": "object"})
    eng = cbnb.Engine(tiny_model("tiny:llama"), config=cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=64))
    with eng:
        with pytest.raises(ValueError, match="json_schema needs the engine's tokenizer"):
            eng.submit([1, 2, 3], max_new_tokens=2, json_schema={"type": "object"})


# ------------------------------------------------------------------------------------------------ runners, masks
def _tiny_engine(async_mode: bool, **cfg):
    from cbnb.runner.cuda.cuda_runner import CudaModelRunner

    from helpers_server import byte_tokenizer

    engine = cbnb.Engine(tiny_model("tiny:llama"), tokenizer=byte_tokenizer(),
                         config=cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=128, **cfg))
    if async_mode:  # the CUDA runner on CPU (fake graphs) with async batching: the double-buffered loop
        runner = CudaModelRunner(engine.model, engine.cache.geometry(), engine.store, seed=engine.config.seed,
                                 attention="torch")
        runner.configure(engine.config, use_cuda_graph=True, use_async_batching=True)
        assert runner.async_mode
        engine.runner = runner
    return engine


def test_async_batching_and_reconfigure_keep_each_grammar_in_step():
    prompts = [[5 + k, 9, 11 + k] for k in range(4)]
    schemas = [SCHEMAS["choice"], SCHEMAS["list"], SCHEMAS["choice"], SCHEMAS["list"]]

    def run(engine, reconfigure=False):
        with engine:
            hs = [engine.submit(p, max_new_tokens=MAX_JSON_TOKENS, json_schema=s, do_sample=k % 2 == 1, seed=k)
                  for k, (p, s) in enumerate(zip(prompts, schemas))]
            if reconfigure:  # mid-run: a new runner, whose matchers replay the tokens generated so far
                next(iter(hs[1]))
                engine.reconfigure(engine.config.copy(max_batch_tokens=64))
            return [h.result(timeout=TIMEOUT) for h in hs]

    ref = run(_tiny_engine(False))
    for out, schema in zip(ref, schemas):
        assert out.finish_reason == "eos", out.text
        jsonschema.validate(json.loads(out.text), schema)
    assert [o.token_ids for o in run(_tiny_engine(True))] == [o.token_ids for o in ref]
    assert [o.token_ids for o in run(_tiny_engine(False), reconfigure=True)] == [o.token_ids for o in ref]


def test_device_unpacking_equals_the_host_unpacking():
    import numpy as np
    import torch

    from cbnb.runner.grammar import GrammarRows, apply

    rng = np.random.default_rng(0)
    bits = rng.integers(-2**31, 2**31 - 1, size=(3, 5), dtype=np.int64).astype(np.int32)  # 160 bits for V = 150
    x = torch.randn(4, 150)
    rows = torch.tensor([0, 2, 3])
    on_device = apply(x.clone(), GrammarRows(rows, torch.from_numpy(bits), ["a", "b", "c"]))
    banned = torch.from_numpy(np.unpackbits((~bits).view(np.uint8), axis=1, bitorder="little")).view(torch.bool)
    on_host = apply(x.clone(), GrammarRows(rows, None, ["a", "b", "c"], banned=banned))
    assert torch.equal(on_device, on_host)
    for i, r in enumerate([0, 2, 3]):  # token t allowed iff bit t % 32 of word t // 32 is set
        allowed = [(int(bits[i, t // 32]) >> (t % 32)) & 1 for t in range(150)]
        assert [bool(v) for v in torch.isfinite(on_host[r])] == [bool(a) for a in allowed]
    assert torch.equal(on_host[1], x[1])  # an unconstrained row is untouched
    wide = apply(torch.zeros(1, 200), GrammarRows(torch.tensor([0]), torch.from_numpy(bits[:1]), ["a"]))
    assert torch.isinf(wide[0, 160:]).all()  # past the tokenizer's vocabulary: never allowed


def test_sim_engine_accepts_and_ignores_grammars():
    from cbnb.sim import SimEngine

    sim = SimEngine("llama-3.1-8b", "h100-sxm")
    with sim:
        a = sim.submit([1, 2, 3], max_new_tokens=4, response_format={"type": "json_object"}).result(timeout=TIMEOUT)
        b = sim.submit([1, 2, 3], max_new_tokens=4, json_schema=SCHEMAS["person"]).result(timeout=TIMEOUT)
    assert len(a.token_ids) == len(b.token_ids) == 4
    assert "response_format" not in sim.submit_keywords  # so the server refuses it for a simulation (400)


def test_strict_schemas_take_no_unlisted_property():
    from helpers_server import byte_tokenizer

    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "integer"}}},
                                               "c": {"type": "array", "items": {"properties": {"d": {}}}}},
              "$defs": {"E": {"properties": {"f": {}}, "additionalProperties": True}}}
    shut = closed(schema)
    assert shut["additionalProperties"] is False and shut["properties"]["a"]["additionalProperties"] is False
    assert shut["properties"]["c"]["items"]["additionalProperties"] is False
    assert shut["$defs"]["E"]["additionalProperties"] is True  # an explicit choice stays
    assert "additionalProperties" not in schema  # a copy
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    loose = request_grammar(byte_tokenizer(), 512, {2}, response_format=fmt)
    fmt["json_schema"]["strict"] = True
    strict = request_grammar(byte_tokenizer(), 512, {2}, response_format=fmt)
    assert loose.schema == schema and strict.schema == shut
