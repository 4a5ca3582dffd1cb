"""Stop strings: find them in a request's generated text as tokens arrive (torch-free; runs on the engine thread).

`StopMatcher` decodes the generated tokens incrementally with `cbnb.engine.detok.IncrementalDetokenizer` (the same
offset-based detokenizer a handle's stream uses: a short tail window per token, an incomplete UTF-8 tail waits for
the next token), and searches each new piece of text, together with
the tail it may complete, for every stop string, so a stop string that spans several tokens is found. The first stop
string to complete wins, as if the text arrived one character at a time (the one that ends first; of those ending at
the same character, the longest), so how the text is cut into tokens does not matter.

When one appears, the request ends with finish reason "stop":

- its text ends right before the stop string (the stop string is not part of the output, as in OpenAI's API);
- its token ids are the generated tokens whose text lies entirely before the stop string; when the stop string
  begins inside a token, that token is dropped too, and the text keeps its characters before the stop string
  (so ``tokenizer.decode(token_ids)`` is a prefix of the text, equal to it when the stop string begins at a token
  boundary).

Streaming: `safe_tokens` is how many tokens may be delivered to a consumer now: those whose text ends before any
suffix of the text that could still grow into a stop string. Tokens held back are delivered once the text moves
past the possible stop string, or dropped when it completes, so a consumer never sees a token or a character of a
stop string. The count never decreases.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any, Sequence

from .detok import IncrementalDetokenizer

__all__ = ["StopMatcher", "TextStopFilter", "held_suffix"]

_INF = float("inf")


class StopMatcher:
    """Finds the first stop string in the text of the tokens pushed so far.

    Args:
        tokenizer: a transformers tokenizer (``decode(ids, skip_special_tokens=True)``).
        stops: the stop strings (non-empty).

    Attributes:
        text: the decoded text so far (after a stop: the text before it).
        stop: the stop string found (None until then).
        kept_tokens: after a stop, how many tokens lie entirely before it.
        safe_tokens: tokens that can no longer be part of a stop string.
    """

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        if tokenizer is None:
            raise ValueError("stop strings need a tokenizer: the engine has none (pass token-id stops as "
                             "eos_token_id instead)")
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be a list of non-empty strings; got {stops!r}")
        self.tokenizer = tokenizer
        self.stops = tuple(stops)
        self._longest = max(len(s) for s in self.stops)
        self.detok = IncrementalDetokenizer(tokenizer)
        self.ids = self.detok.ids
        self.text = ""
        self._ends: list[float] = []  # per token: the text length once its characters are out (inf: not yet)
        self.stop: str | None = None
        self.kept_tokens = 0
        self.safe_tokens = 0

    def push(self, token: int) -> bool:
        """Add one generated token. True when a stop string is now complete (then `text`, `kept_tokens` and
        `stop` say where; further pushes are ignored)."""
        if self.stop is not None:
            return True
        self._ends.append(_INF)
        start = len(self.text)
        new = self.detok.push((token,))
        if self.detok.held:  # an incomplete character: its token's text comes with the next one
            return False
        self.text += new
        end = len(self.text)
        for k in range(len(self._ends) - 1, -1, -1):  # this token and those that waited for its characters
            if self._ends[k] != _INF:
                break
            self._ends[k] = end
        found: tuple[int, int, str] | None = None  # (end, -length, stop) of the first stop string to complete
        if new:
            lo = max(0, start - self._longest + 1)  # a stop string ending in the new text starts here or later
            for s in self.stops:
                i = self.text.find(s, lo)
                if i >= 0 and (found is None or (i + len(s), -len(s)) < found[:2]):
                    found = (i + len(s), -len(s), s)
        if found is not None:
            end, neg, self.stop = found
            at = end + neg
            self.text = self.text[:at]
            self.kept_tokens = bisect_right(self._ends, at)
            self.safe_tokens = min(self.safe_tokens, self.kept_tokens)
            return True
        self.safe_tokens = max(self.safe_tokens, bisect_right(self._ends, len(self.text) - self._held()))
        return False

    def _held(self) -> int:
        return held_suffix(self.text, self.stops)


def held_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `stops` (what must wait)."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class TextStopFilter:
    """Stop strings found in streamed *text*, for an engine-like that does not take ``stop`` itself.

    `cbnb.Engine` finds stop strings on its token stream (`StopMatcher`), so the server passes ``stop`` to it; the
    server uses this filter only for an engine-like whose `cbnb.engine.engine_like.submit_keywords` lack ``stop``. Same
    rule as `StopMatcher`: the stop string that completes first wins (of those completing at the same character,
    the longest), whatever the pushes' split.

    Args:
        stops: strings (empty ones are dropped).

    `push(text)` returns what may be sent now (text that can no longer start a stop string); once a stop string
    appears it returns the text before it and sets `stopped` (the caller then cancels the request). `flush()`
    returns the held-back tail when the stream ends without a stop.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buf += text
        hits = [(i + len(s), i) for s in self.stops if (i := self.buf.find(s)) >= 0]
        if hits:
            out, self.buf, self.stopped = self.buf[:min(hits)[1]], "", True
            return out
        cut = len(self.buf) - held_suffix(self.buf, self.stops)
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
