"""Requests: states, legal and illegal transitions, timestamps, counters, token accounting, sampling params."""

from __future__ import annotations

import itertools

import pytest

from cbnb.core.requests import (
    ALLOWED_TRANSITIONS,
    IllegalTransition,
    Request,
    RequestOutput,
    RequestState,
    SamplingParams,
)

S = RequestState


def test_states_and_terminal() -> None:
    assert [s.name for s in S] == ["PENDING", "PREFILLING", "DECODING", "FINISHED", "FAILED", "CANCELLED"]
    assert [int(s) for s in S] == [0, 1, 2, 3, 4, 5]  # transformers' values, plus CANCELLED
    assert {s for s in S if s.is_terminal} == {S.FINISHED, S.FAILED, S.CANCELLED}


LEGAL = {
    (S.PENDING, S.PREFILLING), (S.PENDING, S.DECODING), (S.PENDING, S.FAILED), (S.PENDING, S.CANCELLED),
    (S.PREFILLING, S.PREFILLING), (S.PREFILLING, S.DECODING), (S.PREFILLING, S.PENDING),
    (S.PREFILLING, S.FAILED), (S.PREFILLING, S.CANCELLED),
    # "cache_exhausted": a re-queued or recomputing request that outgrew the whole cache ends FINISHED
    (S.PENDING, S.FINISHED), (S.PREFILLING, S.FINISHED),
    (S.DECODING, S.DECODING), (S.DECODING, S.FINISHED), (S.DECODING, S.PENDING), (S.DECODING, S.FAILED),
    (S.DECODING, S.CANCELLED),
}


def _in_state(state: RequestState) -> Request:
    r = Request("r", [1, 2, 3])
    path = {
        S.PENDING: [],
        S.PREFILLING: [S.PREFILLING],
        S.DECODING: [S.DECODING],
        S.FINISHED: [S.DECODING, S.FINISHED],
        S.FAILED: [S.FAILED],
        S.CANCELLED: [S.CANCELLED],
    }[state]
    for s in path:
        r.transition(s)
    assert r.state == state
    return r


@pytest.mark.parametrize("src, dst", list(itertools.product(list(S), list(S))))
def test_transition_table(src: RequestState, dst: RequestState) -> None:
    r = _in_state(src)
    n = len(r.transitions)
    if (src, dst) in LEGAL:
        r.transition(dst, now=123.0)
        assert r.state == dst
        if src != dst:
            assert r.transitions[-1] == (dst, 123.0) and len(r.transitions) == n + 1
        else:
            assert len(r.transitions) == n  # staying put records nothing
    else:
        with pytest.raises(IllegalTransition, match=f"{src.name} -> {dst.name}"):
            r.transition(dst)
        assert r.state == src and len(r.transitions) == n
    assert {(a, b) for a, bs in ALLOWED_TRANSITIONS.items() for b in bs} == LEGAL


def test_timestamps_for_every_transition() -> None:
    r = Request("r", [1, 2, 3, 4], SamplingParams(max_new_tokens=2), now=1.0)
    assert r.transitions == [(S.PENDING, 1.0)] and r.timings.queued == 1.0
    r.transition(S.PREFILLING, now=2.0)
    r.transition(S.DECODING, now=3.0)
    r.transition(S.PENDING, now=4.0)  # offloaded
    r.transition(S.DECODING, now=5.0)
    assert r.append_token(7, now=6.0) is False
    assert r.append_token(8, now=7.0) is True
    r.transition(S.FINISHED, now=8.0)
    assert r.transitions == [(S.PENDING, 1.0), (S.PREFILLING, 2.0), (S.DECODING, 3.0), (S.PENDING, 4.0),
                             (S.DECODING, 5.0), (S.FINISHED, 8.0)]
    t = r.timings
    assert (t.queued, t.scheduled, t.first_token, t.finished) == (1.0, 2.0, 6.0, 8.0)
    assert (t.queue_s, t.ttft_s, t.e2e_s) == (1.0, 5.0, 7.0)
    r2 = Request("r2", [1])
    r2.transition(S.CANCELLED)
    assert r2.timings.finished is not None and r2.timings.finished >= r2.timings.queued


def test_real_clock_is_monotonic() -> None:
    r = Request("r", [1, 2])
    r.transition(S.DECODING)
    r.transition(S.FAILED)
    times = [t for _, t in r.transitions]
    assert times == sorted(times)


def test_counters_start_at_zero_and_are_reported() -> None:
    r = Request("r", [1, 2, 3])
    assert (r.prefix_cached_tokens, r.num_offloads, r.num_soft_resets) == (0, 0, 0)
    r.prefix_cached_tokens, r.num_offloads, r.num_soft_resets = 16, 2, 1
    out = r.output()
    assert isinstance(out, RequestOutput)
    assert (out.prefix_cached_tokens, out.num_offloads, out.num_soft_resets) == (16, 2, 1)
    assert out.prompt_token_ids == [1, 2, 3] and out.token_ids == [] and not out.finished


def test_prompt_validation() -> None:
    with pytest.raises(ValueError, match="empty prompt"):
        Request("r", [])
    for bad in ([1, -1], [1, 2.0], [True], ["a"], [None]):
        with pytest.raises(ValueError, match="non-negative integers"):
            Request("r", bad)
    with pytest.raises(ValueError, match="request_id"):
        Request("", [1])
    with pytest.raises(ValueError, match="request_id"):
        Request(5, [1])  # type: ignore[arg-type]


def test_integer_like_token_ids_are_accepted() -> None:
    np = pytest.importorskip("numpy")
    r = Request("r", np.array([5, 6, 7], dtype=np.int64))
    assert r.prompt_ids == [5, 6, 7] and all(type(t) is int for t in r.prompt_ids)
    r2 = Request("r2", range(3))
    assert r2.prompt_ids == [0, 1, 2]
    # the caller's list is copied
    src = [1, 2]
    r3 = Request("r3", src)
    src.append(3)
    assert r3.prompt_ids == [1, 2]


def test_max_new_tokens_cap() -> None:
    assert Request("r", [1], SamplingParams(max_new_tokens=5), max_new_tokens_cap=100).max_new_tokens == 5
    assert Request("r", [1], SamplingParams(), max_new_tokens_cap=100).max_new_tokens == 100
    assert Request("r", [1], SamplingParams()).max_new_tokens is None
    with pytest.raises(ValueError, match="no room"):
        Request("r", [1], SamplingParams(), max_new_tokens_cap=0)


def test_append_token_eos_and_length() -> None:
    r = Request("r", [1, 2], SamplingParams(max_new_tokens=3, eos_token_ids=[9, 10]))
    assert r.append_token(4) is False
    assert r.append_token(10) is True and r.finish_reason == "eos"
    assert r.output_ids == [4, 10]  # EOS included, as in transformers
    r = Request("r", [1, 2], SamplingParams(max_new_tokens=2, eos_token_ids=9))
    assert r.append_token(4) is False and r.tokens_left == 1
    assert r.append_token(5) is True and r.finish_reason == "length" and r.tokens_left == 0
    r = Request("r", [1], SamplingParams(max_new_tokens=2, eos_token_ids=9, ignore_eos=True))
    assert r.append_token(9) is False
    r = Request("r", [1], SamplingParams(max_new_tokens=1, eos_token_ids=-1))  # -1: no EOS
    assert r.sampling.eos_token_ids == frozenset()


def test_token_accounting_with_in_flight_samples() -> None:
    r = Request("r", [10, 11, 12], SamplingParams(max_new_tokens=5))
    assert (r.num_tokens, r.remaining, r.is_decode) == (3, 3, False)
    r.num_computed = 3
    r.pending_samples = 1  # scheduled, not applied yet
    assert (r.num_tokens, r.remaining, r.is_decode, r.tokens_left) == (4, 1, True, 4)
    assert r.token_ids(0, 4) == [10, 11, 12, -1]
    assert r.append_token(13) is False
    assert r.pending_samples == 0 and r.token_ids(1, 4) == [11, 12, 13]
    assert r.token_ids(2, 6) == [12, 13, -1, -1]
    assert r.all_known_ids() == [10, 11, 12, 13]
    r.swapped = True
    assert not r.is_decode  # a restore is scheduled as a prefill


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 1.5}, "max_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"seed": "x"}, "seed"),
        ({"do_sample": 1}, "do_sample"),
    ],
)
def test_sampling_params_validation(kwargs: dict, fragment: str) -> None:
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


def test_temperature_zero_is_greedy_and_top_k_zero_is_none() -> None:
    """OpenAI's and vLLM's `temperature=0` means greedy, with or without do_sample; top_k=0 means no top-k."""
    for do_sample in (False, True):
        p = SamplingParams(do_sample=do_sample, temperature=0)
        assert p.greedy and p.describe()[0].startswith("greedy")
    assert SamplingParams(do_sample=True, top_k=0).top_k is None
    with pytest.raises(ValueError, match=r"top_k must be an integer >= 0 \(0 or None: no top-k\); got -3"):
        SamplingParams(top_k=-3)


def test_sampling_params_eos_forms() -> None:
    assert SamplingParams(eos_token_ids=2).eos_token_ids == frozenset({2})
    assert SamplingParams(eos_token_ids=[2, 3, -1]).eos_token_ids == frozenset({2, 3})
    assert SamplingParams(eos_token_ids=None).eos_token_ids == frozenset()  # type: ignore[arg-type]
    assert SamplingParams.normalize_eos(None) == frozenset()
    assert SamplingParams.normalize_eos(-1) == frozenset()
    assert SamplingParams.normalize_eos((1, 2)) == frozenset({1, 2})


def test_output_snapshot_is_independent() -> None:
    r = Request("r", [1, 2], SamplingParams(max_new_tokens=3))
    r.transition(S.DECODING)
    r.append_token(5)
    out = r.output()
    r.append_token(6)
    r.prompt_ids.append(99)
    assert out.token_ids == [5] and out.prompt_token_ids == [1, 2] and out.state == S.DECODING
    assert out.timings is not r.timings


def test_states_print_by_name() -> None:
    assert str(RequestState.CANCELLED) == f"{RequestState.CANCELLED}" == "CANCELLED"
    assert f"{RequestState.FINISHED:>9}" == " FINISHED" and RequestState.FINISHED == 3
