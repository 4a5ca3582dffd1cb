"""Stop strings: find them in a request's generated text as tokens arrive (torch-free; runs on the engine thread).

`StopMatcher` decodes the generated tokens incrementally (each new token's text is the difference between decoding
a short window of tokens ending with it and the same window without it, the scheme of vLLM's incremental
detokenizer; an incomplete UTF-8 tail waits for the next token), and searches each new piece of text, together with
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

__all__ = ["StopMatcher"]

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
        self.ids: list[int] = []
        self.text = ""
        self._ends: list[float] = []  # per token: the text length once its characters are out (inf: not yet)
        self._prefix = 0  # decoding window: tokens [prefix, read) are decoded text already emitted
        self._read = 0
        self.stop: str | None = None
        self.kept_tokens = 0
        self.safe_tokens = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self) -> str | None:
        """Text added by the newest token(s) ("" for a token without text, None while the text ends in an
        incomplete UTF-8 character)."""
        before = self._decode(self.ids[self._prefix:self._read]) if self._read > self._prefix else ""
        after = self._decode(self.ids[self._prefix:])
        if after.endswith("\ufffd"):
            return None
        if after.startswith(before):
            new = after[len(before):]
        else:  # decoding the window changed its earlier text (a tokenizer clean-up rule): compare whole texts
            full = self._decode(self.ids)
            new = full[len(self.text):] if full.startswith(self.text) else ""
        self._prefix, self._read = self._read, len(self.ids)
        return new

    def push(self, token: int) -> bool:
        """Add one generated token. True when a stop string is now complete (then `text`, `kept_tokens` and
        `stop` say where; further pushes are ignored)."""
        if self.stop is not None:
            return True
        self.ids.append(int(token))
        self._ends.append(_INF)
        start = len(self.text)
        new = self._new_text()
        if new is None:
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
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        text = self.text
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best
