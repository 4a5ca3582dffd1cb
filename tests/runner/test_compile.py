"""transformers' compile knobs (`default_compile_level`, `varlen_compile_config`, `decode_compile_config`) on CPU.

The resolution order is checked as data; one real compile (tiny model, slow) checks the greedy oracle and the
compile accounting; a backend that fails checks the fallback: a warning, eager steps, no failed request.
"""

from __future__ import annotations

import pytest
import torch

import cbnb
from cbnb.core.requests import RequestState
from cbnb.runner.cpu.compiled import compile_kwargs, resolve_compile_configs

from helpers_engine import STD_PROMPTS, StepRecorder, config, oracle_for, results, submit_together, tiny_model


class _Model:
    class config:  # noqa: N801 - mimics a transformers model's config attribute
        compile_config = {"mode": "reduce-overhead"}


@pytest.mark.parametrize("kw, model, expected", [
    ({}, None, (None, None)),
    ({}, _Model, ({"mode": "reduce-overhead"}, {"mode": "reduce-overhead"})),  # the model config's fallback
    (dict(default_compile_level=1), _Model, ({"mode": "default", "fullgraph": False, "dynamic": True},) * 2),
    (dict(default_compile_level=2), None,
     ({"mode": "max-autotune-no-cudagraphs", "fullgraph": False, "dynamic": True},) * 2),
    (dict(default_compile_level=3), None,
     ({"mode": "max-autotune-no-cudagraphs", "fullgraph": False, "dynamic": False},) * 2),
    (dict(default_compile_level=1, decode_compile_config={"dynamic": False}), None,
     ({"mode": "default", "fullgraph": False, "dynamic": True}, {"dynamic": False})),  # explicit beats the level
])
def test_resolution_order(kw, model, expected):
    assert resolve_compile_configs(config(**kw), model) == expected


def test_compile_kwargs_keep_torch_compile_arguments_only():
    assert compile_kwargs({"mode": "default", "dynamic": True, "fullgraph": False, "foo": 1}) == {
        "mode": "default", "dynamic": True, "fullgraph": False}
    # torch.compile takes mode or options, not both: the options win
    assert compile_kwargs({"mode": "default", "options": {"freezing": True}}) == {"options": {"freezing": True}}


def _failing_backend(gm, example_inputs):
    raise RuntimeError("this backend always fails")


def test_failed_compile_falls_back_to_eager_with_a_warning():
    model = tiny_model("tiny:llama")
    oracle = oracle_for("tiny:llama")
    cfg = config(page_size=8, max_batch_tokens=32, varlen_compile_config={"backend": _failing_backend})
    engine = cbnb.Engine(model, config=cfg)
    with pytest.warns(RuntimeWarning, match="torch.compile of the forward failed"):
        with engine:
            outs = results(submit_together(engine, STD_PROMPTS[:4], 8))
    assert all(o.state == RequestState.FINISHED for o in outs)
    assert [o.token_ids for o in outs] == [oracle(p, 8) for p in STD_PROMPTS[:4]]
    stats = engine.runner.compile_stats()
    assert "this backend always fails" in stats["varlen"]["failed"]
    assert stats["decode"] is None  # no decode config: pure-decode steps ran eagerly from the start


@pytest.mark.slow
def test_compiled_forward_keeps_the_greedy_oracle():
    torch._dynamo.reset()
    model = tiny_model("tiny:llama")
    oracle = oracle_for("tiny:llama")
    cfg = config(page_size=8, max_batch_tokens=32, default_compile_level=1)
    engine = cbnb.Engine(model, config=cfg)
    rec = StepRecorder(engine)
    with engine:
        outs = results(submit_together(engine, STD_PROMPTS, 12))
    assert [o.token_ids for o in outs] == [oracle(p, 12) for p in STD_PROMPTS]
    assert rec.split_prompts(), "the 32-token budget must chunk the longer prompts"
    steps = rec.steps
    assert any(all(e.num_tokens == 1 for e in s) for s in steps), "no pure-decode step"
    assert any(sum(e.num_tokens for e in s) == 1 for s in steps), "no one-token step (size-1 specialization)"
    st = engine.runner.compile_stats()["varlen"]
    assert st["failed"] is None and st["compiles"] == 1, st  # one dynamic graph for every step shape
    assert st["calls"] == len(steps) and st["compile_s"] > 0
    # A second engine on the same model reuses the compiled forward: no new compile.
    again = cbnb.Engine(model, config=cfg)
    with again:
        out = again.generate([STD_PROMPTS[3]], max_new_tokens=5, eos_token_id=-1)[0]
    assert out.token_ids == oracle(STD_PROMPTS[3], 5)
    assert again.runner.compile_stats()["varlen"]["compiles"] == 1
