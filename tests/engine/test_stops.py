"""Stop strings (`cbnb.engine.stops`): found when they span token boundaries, the text ends before them, the token ids
are the tokens entirely before them, and streaming never shows a character of one."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import cbnb
from cbnb.engine.stops import StopMatcher

from helpers_engine import STD_PROMPTS, config, results

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def push_all(m: StopMatcher, ids: list[int]) -> int | None:
    """Push tokens until a stop; the number pushed, or None when none stopped."""
    for k, t in enumerate(ids):
        if m.push(t):
            return k + 1
    return None


def test_stop_spanning_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "The answer is 42.\n\nQuestion two: what### else?"
    ids = tok(text)["input_ids"]
    pieces = [tok.decode([i]) for i in ids]
    assert "\n\n" not in pieces and "###" not in pieces or len(ids) > 5  # the string is several tokens
    m = StopMatcher(tok, ["###", "\n\n"])
    pushed = push_all(m, ids)
    assert m.stop == "\n\n" and m.text == "The answer is 42."  # the earliest occurrence wins, not the list order
    assert pushed is not None and pushed < len(ids)
    kept = ids[:m.kept_tokens]
    assert tok.decode(kept) == m.text  # "\n\n" starts at a token boundary here
    # A stop string that starts inside a token ("swer" inside " answer"): that token is dropped, the text keeps
    # the characters before it.
    m2 = StopMatcher(tok, ["swer is"])
    push_all(m2, ids)
    assert m2.text == "The an"
    assert tok.decode(ids[:m2.kept_tokens]) == "The"


def test_streaming_holds_back_a_possible_stop(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok("one two three four")["input_ids"]
    m = StopMatcher(tok, [" three five"])
    safe = []
    for t in ids:
        assert not m.push(t)
        safe.append(m.safe_tokens)
    assert safe == sorted(safe)  # never decreases
    # " three" could start " three five": held back until " four" shows it does not
    i3 = next(k for k in range(len(ids)) if tok.decode(ids[:k + 1]).endswith("three"))
    assert safe[i3] <= i3 and safe[-1] == len(ids)


def test_matcher_refuses_bad_input(smollm2_tokenizer):
    with pytest.raises(ValueError, match="need a tokenizer"):
        StopMatcher(None, ["x"])
    with pytest.raises(ValueError, match="stop"):
        StopMatcher(smollm2_tokenizer, [""])


def _boundary_stops(tok, ref: list[int]) -> tuple[str, str]:
    """Two stop strings in the greedy text of `ref`: one spanning a token boundary and starting inside a token, one
    starting exactly at a boundary and spanning two tokens."""
    pieces = [tok.decode([t]) for t in ref]
    for k in range(3, len(ref) - 2):
        a, b = pieces[k], pieces[k + 1]
        full = tok.decode(ref)
        if len(a) >= 2 and len(b) >= 2 and a.isascii() and b.isascii() and "\ufffd" not in a + b:
            inside = a[-1] + b[:2]
            at_boundary = b + pieces[k + 2][:1]
            if full.find(inside) == len(tok.decode(ref[:k + 1])) - 1 and \
                    full.find(at_boundary) == len(tok.decode(ref[:k + 1])):
                return inside, at_boundary
    raise AssertionError("no suitable boundary in the reference text")


@pytest.mark.parametrize("where", ["inside_a_token", "at_a_boundary"])
def test_engine_stops_and_streams_consistently(llama, smollm2_tokenizer, where):
    model, oracle = llama
    tok = smollm2_tokenizer
    prompt = STD_PROMPTS[1]
    ref = oracle(prompt, 40)
    inside, at_boundary = _boundary_stops(tok, ref)
    stop = inside if where == "inside_a_token" else at_boundary
    full = tok.decode(ref, skip_special_tokens=True)
    at = full.find(stop)
    engine = cbnb.Engine(model, tokenizer=tok, config=config(page_size=16))
    with engine:
        h = engine.submit(prompt, max_new_tokens=40, eos_token_id=-1, stop=["never appears", stop])
        deltas = list(h)
        out = h.result()
        other = engine.submit(prompt, max_new_tokens=40, eos_token_id=-1, stop="never appears").result()
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:at]
    k = len(out.token_ids)
    assert out.token_ids == ref[:k]
    assert out.text.startswith(tok.decode(out.token_ids))
    # the next token holds the stop string's start, or is an incomplete UTF-8 piece whose character only came out
    # together with it (a random model's byte soup)
    assert len(tok.decode(ref[:k + 1])) > at or tok.decode(ref[k:k + 1]).endswith("\ufffd")
    if where == "at_a_boundary":
        assert tok.decode(out.token_ids) == out.text
    assert "".join(d.text for d in deltas) == out.text
    assert [t for d in deltas for t in d.token_ids] == out.token_ids
    assert other.finish_reason == "length" and other.token_ids == ref and other.text == full


class PieceTokenizer:
    """Token id i decodes to PIECES[i] (pieces of 1-3 characters): texts cut into tokens in many ways."""

    PIECES = ["a", "b", "c", "\n", "ab", "ca", "bc", "a\n", "\nc", "abc", "cab", "\n\n"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids)


@example(ids=[0, 0, 5], stops=["c", "aca"]).via("a stop inside a longer one completes first")
@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, len(PieceTokenizer.PIECES) - 1), max_size=20),
       stops=st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), min_size=1, max_size=3))
def test_first_stop_to_complete_wins_however_the_text_is_cut(ids, stops):
    # As if the text arrived character by character: the first end of a stop string cuts it (the longest of
    # those ending there); the tokens kept are those entirely before the cut; streaming never passes the cut.
    tok = PieceTokenizer()
    text = tok.decode(ids)
    hits = [e - max(len(s) for s in stops if text[:e].endswith(s))
            for e in range(1, len(text) + 1) if any(text[:e].endswith(s) for s in stops)]
    m = StopMatcher(tok, stops)
    pushed = push_all(m, ids)
    if not hits:
        assert pushed is None and m.text == text and m.safe_tokens <= len(ids)
        return
    cut = hits[0]
    assert m.text == text[:cut] and text[cut:].startswith(m.stop)
    assert len(tok.decode(ids[:m.kept_tokens])) <= cut < len(tok.decode(ids[:m.kept_tokens + 1]))
    assert m.safe_tokens <= m.kept_tokens
