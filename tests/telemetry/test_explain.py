"""`Engine.explain`: a request's story from the event log, as data and as text (`cbnb.telemetry.explain`)."""

from __future__ import annotations

import json

import pytest

import cbnb
from cbnb.telemetry.events import EventLog, RequestAdded, StepPlanned
from cbnb.telemetry.explain import REASONS, StoryBuilder, explain_request, reason_numbers
from cbnb.core.plan import SkipReason

from helpers_engine import TIMEOUT, paused, tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_every_skip_reason_has_a_meaning_and_config_fields():
    assert set(REASONS) == {r.value for r in SkipReason}
    assert REASONS["token_budget"].fields == ("max_batch_tokens",)
    assert REASONS["safety_margin"].fields[0] == "safety_margin"
    assert REASONS["request_cap"].fields == ("max_requests_per_batch",)
    assert set(REASONS["no_free_blocks"].fields) == {"num_blocks", "page_size", "cpu_offload_space"}
    assert reason_numbers("token_budget", {"budget_tokens": 64, "left_tokens": 0}) == "budget 64 tokens, 0 left"
    assert "free 12.0 %" in reason_numbers("safety_margin", {"safety_margin": 0.15, "free_fraction": 0.12})
    assert reason_numbers("no_free_blocks", {"needed_blocks": (3,), "available_blocks": (1,)}) == \
        "needs 3 more blocks, 1 obtainable"


def test_waiting_chunks_decodes_and_the_end_in_order():
    eng = cbnb.Engine(tiny_model("tiny:llama"),
                      config=cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=32))
    with paused(eng):
        hs = [eng.submit(list(range(5 + k, 45 + k)), max_new_tokens=3, eos_token_id=-1) for k in range(2)]
    for h in hs:
        h.result(TIMEOUT)
    story = eng.explain(hs[1].request_id)
    kinds = [e.kind for e in story.entries]
    assert kinds == ["arrival", "waiting", "prefill", "decode", "end"], story.text()
    wait = story.entries[1]
    assert wait.reason == "token_budget" and wait.fields == ["max_batch_tokens"]
    assert wait.numbers == {"budget_tokens": 32, "left_tokens": 0} and wait.count == len(wait.steps) >= 1
    assert "now max_batch_tokens=32" in wait.advice
    chunks = [n for _s, n in story.entries[2].steps]
    assert sum(c["tokens"] for c in chunks) == 40 and chunks[0]["start"] == 0
    assert story.state == "FINISHED" and story.output_tokens == 3 and story.prompt_tokens == 40
    assert story.waited_steps == {"token_budget": wait.count}
    text = story.text()
    assert text.splitlines()[0] == story.headline and "most for token budget" in story.headline
    assert "-> max_batch_tokens: a larger max_batch_tokens" in text and "FINISHED: 3 tokens" in text
    d = story.to_dict()
    assert json.loads(json.dumps(d))["entries"][1]["span"] == wait.span() and d["entries"][1]["steps"]
    with pytest.raises(KeyError, match="no event of request 'nope'"):
        eng.explain("nope")
    assert eng.explain(hs[1]).to_dict() == story.to_dict()  # a handle stands for its id
    with pytest.raises(TypeError, match="request id"):
        eng.explain(5)


def test_async_story_is_in_step_order():
    """With async batching the next step is planned before the previous step's prefix hit reaches the log: the
    story still lists the hit before the prompt's prefill, and the decode steps as one run."""
    from cbnb.sim import SimEngine

    sim = SimEngine("llama-3.1-8b", "h100-sxm", cbnb.ContinuousBatchingConfig(page_size=16))
    assert sim.async_batching
    sim.submit([7] * 300, 64).result()
    h = sim.submit([7] * 100, 16)
    h.result()
    story = sim.explain(h)
    kinds = [e.kind for e in story.entries]
    assert kinds.index("prefix_hit") < kinds.index("prefill") and kinds.count("decode") == 1, story.text()
    firsts = [e.step for e in story.entries if e.kind != "end"]
    assert firsts == sorted(firsts), story.text()


def test_soft_reset_then_recompute_is_told_with_its_numbers():
    """A cache too small for 4 growing requests: one is soft-reset, and its later prefill is a recomputation."""
    eng = cbnb.Engine(tiny_model("tiny:llama"),
                      config=cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=12, max_batch_tokens=32))
    with paused(eng):
        hs = [eng.submit(list(range(5 + k, 45 + k)), max_new_tokens=40, eos_token_id=-1) for k in range(4)]
    for h in hs:
        assert h.result(TIMEOUT).state.name == "FINISHED"
    stories = [eng.explain(h.request_id) for h in hs]
    reset = next(s for s in stories if any(e.kind == "offload" for e in s.entries))
    off = next(e for e in reset.entries if e.kind == "offload")
    assert off.reason == "soft_reset" and off.numbers["tokens_to_recompute"] > 0 and "cpu_offload_space" in off.fields
    after = reset.entries[reset.entries.index(off) + 1:]
    assert any(e.kind == "prefill" and e.reason == "recompute" and "recomputing its KV" in e.text for e in after)
    assert any(e.kind == "waiting" for s in stories for e in s.entries)


def test_prefix_hit_and_a_story_built_incrementally():
    eng = cbnb.Engine(tiny_model("tiny:llama"),
                      config=cbnb.ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64))
    prompt = list(range(5, 55))
    with eng:
        eng.generate([prompt], max_new_tokens=2, eos_token_id=-1, timeout=TIMEOUT)
        b = StoryBuilder("req-x")
        h = eng.submit(prompt, max_new_tokens=2, eos_token_id=-1, request_id="req-x")
        h.result(TIMEOUT)
    events = eng.events.events()
    for k in range(0, len(events), 7):  # fed in small batches, as the "Why?" panel does
        b.feed(events[k:k + 7])
    story = b.story()
    assert story.to_dict() == eng.explain("req-x").to_dict()
    hit = next(e for e in story.entries if e.kind == "prefix_hit")
    assert hit.numbers["tokens"] == 48 and len(hit.numbers["blocks"]) == 3


def test_partial_log_is_said():
    log = EventLog(10)
    log.append(RequestAdded(0, 0.0, "a", 10, 4))
    for s in range(1, 20):
        log.append(StepPlanned(s, 0.0, "fifo", [], [("request_cap", ["a"], {"cap": 1})], [], 64, 0, 0, 0))
    story = explain_request(log, "a")
    assert story.partial and "no longer holds" in story.text()


def test_a_live_request_with_no_event_yet_is_not_said_to_be_dropped():
    """Found in the teacher's trial (issue 40): Why? on a request whose first step was still running (the board:
    DECODING, "1st token in flight") said "the log no longer holds this request's first events" of a log that had
    dropped nothing: nothing was logged for it yet."""
    from cbnb.core.requests import RequestOutput, RequestState

    now = RequestOutput("b", [1] * 16, [], state=RequestState.DECODING, max_new_tokens=3)
    story = StoryBuilder("b").story(now)
    assert not story.partial and "no longer holds" not in story.text()
    assert "nothing logged for it yet" in story.text() and story.headline.startswith("b (16 prompt tokens): DECODING")
