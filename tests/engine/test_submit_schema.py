"""One submit schema (`cbnb.engine.submit_schema`): both engines' `submit` show and bind the declared keywords, their
`submit_keywords` come from it, its ranges agree with the checks that raise, and the UI's submit box reads it."""

from __future__ import annotations

import inspect

import pytest

import cbnb
from cbnb.core.generation import REQUEST_ARGS
from cbnb.core.sampling_params import SamplingParams
from cbnb.engine import submit_schema as schema
from cbnb.sim import SimEngine


def test_both_signatures_are_the_schema_and_help_shows_every_keyword():
    real = inspect.signature(cbnb.Engine.submit)
    simulated = inspect.signature(SimEngine.submit)
    assert list(real.parameters) == ["self", *schema.FIELDS]
    assert list(simulated.parameters) == ["self", *schema.FIELDS, "arrival_s"]
    p = real.parameters
    assert p["max_new_tokens"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD  # submit(prompt, 16) as before
    assert p["ignore_eos"].kind is inspect.Parameter.KEYWORD_ONLY and p["temperature"].default is None
    doc = cbnb.Engine.submit.__doc__
    assert "{ARGS}" not in doc and "logit_bias: OpenAI's {token id: bias in [-100, 100]}" in doc
    for name in schema.FIELDS:
        assert name in doc, name
    assert set(REQUEST_ARGS) <= set(schema.FIELDS)  # every defaultable argument is a declared keyword
    assert cbnb.Engine.submit_keywords == frozenset(schema.FIELDS)
    assert SimEngine.submit_keywords == schema.simulated_keywords()
    assert not {"stop", "logprobs", "prompt_logprobs", "response_format"} & SimEngine.submit_keywords


def test_bind_fills_defaults_and_refuses_what_python_refuses():
    a = schema.bind([1, 2], (8, True), {"top_k": 5})
    assert a["prompt"] == [1, 2] and a["max_new_tokens"] == 8 and a["do_sample"] is True and a["top_k"] == 5
    assert a["logprobs"] is None and "arrival_s" not in a
    assert schema.bind([1], (), {"arrival_s": 2.0}, simulated=True)["arrival_s"] == 2.0
    with pytest.raises(TypeError, match="submit\\(\\) got an unexpected keyword argument 'temprature'"):
        schema.bind([1], (), {"temprature": 1.0})
    with pytest.raises(TypeError, match="multiple values for argument 'max_new_tokens'"):
        schema.bind([1], (3,), {"max_new_tokens": 4})
    with pytest.raises(TypeError, match="arrival_s"):
        schema.bind([1], (), {"arrival_s": 1.0})  # the real engine has no arrival times
    sim = SimEngine("qwen3-0.6b", "l4")
    with pytest.raises(TypeError, match="temprature"):
        sim.submit([1, 2, 3], 2, temprature=0.5)
    h = sim.submit([1, 2, 3], 2, False, 0.0, 0, 1.0, 7, None, "positional")  # the positional order of old
    assert h.request_id == "positional" and h.result().state.name == "FINISHED"


@pytest.mark.parametrize("field", [f for f in schema.FIELDS.values() if f.name in REQUEST_ARGS
                                   and (f.lo is not None or f.hi is not None)], ids=lambda f: f.name)
def test_declared_ranges_are_the_ones_sampling_params_checks(field):
    integer = "int" in field.annotation
    step = 1 if integer else 1e-6
    edges = [v for v in (field.lo, field.hi) if v is not None]
    for v in edges:
        v = int(v) if integer else float(v)
        if field.name in ("top_p", "repetition_penalty") and v == 0:
            continue  # open at 0: (0, 1] and (0, inf)
        SamplingParams(**{field.name: v})  # the edge itself is allowed
    if field.lo is not None:
        with pytest.raises(ValueError, match=field.name):
            SamplingParams(**{field.name: (int(field.lo) - step) if integer else field.lo - step})
    if field.hi is not None and field.name != "logprobs":  # (logprobs' bound is checked against the vocabulary too)
        with pytest.raises(ValueError, match=field.name):
            SamplingParams(**{field.name: (int(field.hi) + step) if integer else field.hi + step})


def test_the_submit_box_reads_its_ranges_from_the_schema():
    from cbnb.ui import submit

    assert submit._MAX_NEW is schema.FIELDS["max_new_tokens"] and submit._TEMPERATURE.lo == 0.0
