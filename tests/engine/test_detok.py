"""Incremental detokenization (`cbnb.engine.detok`): O(n) decode work over a long stream, and text byte-identical to a
full decode, shared by a handle's stream, the stop matcher and the final text."""

from __future__ import annotations

import random

import pytest

from cbnb.engine.detok import IncrementalDetokenizer
from cbnb.engine.handle import RequestHandle
from cbnb.core.requests import Request, RequestState, SamplingParams
from cbnb.engine.stops import StopMatcher


TEXT = ("Grüße aus Köln! 東京タワーは高い。 Emoji: 🙂🚀👩‍👩‍👧 — naïve café, ½ ≠ ∞; Ελληνικά και русский текст. "
        "\tTabs, newlines\n\nand   spaces. ")


class Counting:
    """A tokenizer wrapper counting `decode` calls and the tokens they decoded."""

    def __init__(self, tok):
        self.tok = tok
        self.calls = 0
        self.tokens = 0

    def decode(self, ids, **kw):
        self.calls += 1
        self.tokens += len(ids)
        return self.tok.decode(ids, **kw)


def long_ids(tok, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(TEXT, add_special_tokens=False)
    return ids[:n]


def stream(tok, ids, chunk=1, finish_reason="length"):
    """Deliver `ids` to a handle `chunk` tokens at a time, as the engine thread does; returns (deltas, output)."""
    req = Request("r", [1, 2], SamplingParams(max_new_tokens=len(ids)))
    h = RequestHandle(req, tok)
    for i in range(0, len(ids), chunk):
        h._push(ids[i:i + chunk], RequestState.DECODING)
    req.output_ids = list(ids)
    req.finish_reason = finish_reason
    h._finish(req)
    deltas = list(h)
    return deltas, h.result()


def test_streaming_2000_tokens_costs_linear_decode_work(smollm2_tokenizer):
    ids = long_ids(smollm2_tokenizer, 2000)
    counting = Counting(smollm2_tokenizer)
    deltas, out = stream(counting, ids)
    n = len(ids)
    # Each delta decodes a window of a few tokens twice; re-decoding the whole output every time would be ~n^2/2.
    assert counting.tokens <= 8 * n, counting.tokens
    assert counting.calls <= 2 * n + 2
    full = smollm2_tokenizer.decode(ids, skip_special_tokens=True)
    assert "".join(d.text for d in deltas) == full == out.text  # byte-identical, the final text decoded once
    assert sum(len(d.token_ids) for d in deltas) == n


def test_the_stop_matcher_decodes_in_linear_work_too(smollm2_tokenizer):
    ids = long_ids(smollm2_tokenizer, 2000)
    counting = Counting(smollm2_tokenizer)
    m = StopMatcher(counting, ["<<never>>"])
    assert not any(m.push(t) for t in ids)
    assert counting.tokens <= 6 * len(ids)
    assert m.text == smollm2_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("chunk", [1, 3])
def test_multibyte_characters_split_over_tokens_match_a_full_decode(smollm2_tokenizer, chunk):
    tok = smollm2_tokenizer
    ids = tok.encode(TEXT * 2, add_special_tokens=False)
    # Byte-level BPE splits the emoji and CJK characters over several tokens: some prefixes end mid-character.
    assert any(tok.decode(ids[:k]).endswith("\ufffd") for k in range(1, len(ids)))
    deltas, out = stream(tok, ids, chunk)
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(d.text for d in deltas) == full == out.text
    assert all("\ufffd" not in d.text for d in deltas)  # no half character is ever shown


def test_random_byte_tokens_and_specials_match_a_full_decode(smollm2_tokenizer):
    tok = smollm2_tokenizer
    rng = random.Random(3)
    specials = list(tok.all_special_ids)
    for trial in range(20):
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(0, 512) for _ in range(120)]
        d = IncrementalDetokenizer(tok)
        pieces = [d.push([t]) for t in ids] + [d.finish()]
        assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=True), trial


def test_no_tokenizer_no_text():
    d = IncrementalDetokenizer(None)
    assert d.push([1, 2, 3]) == "" and d.finish() == "" and d.ids == [1, 2, 3]
