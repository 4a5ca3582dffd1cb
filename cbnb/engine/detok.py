"""`IncrementalDetokenizer`: a growing token sequence's text, decoding only a short tail window (torch-free).

The offset scheme of transformers' ``TextStreamer`` and vLLM's incremental detokenizer, written for cbnb: two
offsets into the ids, ``prefix_offset <= read_offset``. Tokens ``[prefix_offset, read_offset)`` are the window whose
text was already emitted; after new tokens arrive, the new text is ``decode(ids[prefix_offset:])`` minus
``decode(ids[prefix_offset:read_offset])``. Decoding a window rather than the new tokens alone keeps what depends on
the token before (a SentencePiece word boundary's space, a byte-level BPE character split over tokens). When the
window's text ends with U+FFFD (an incomplete UTF-8 character) nothing is emitted and the offsets stay, so the next
token completes it; then the offsets move to ``(read_offset, len(ids))``. Each push therefore decodes O(window)
tokens and a whole generation O(n), where re-decoding everything on every token is O(n^2).

One instance serves a request's streamed text, its stop-string search (`cbnb.engine.stops.StopMatcher`) and its final
text (`text` after ``push(..., final=True)`` is ``decode(ids)``): the tests hold it to a full decode, byte for byte,
including multi-byte characters split over tokens. In the rare case a tokenizer's clean-up rewrites a window's
earlier text (so the window's text does not start with the emitted part), the whole sequence is decoded once and the
difference taken (counted in `full_decodes`).
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["IncrementalDetokenizer"]

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """The text of the ids pushed so far (see the module docstring).

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens=True) -> str`` (a transformers tokenizer); None:
            no text (every push returns "").
        skip_special_tokens: passed to ``decode``.

    Attributes:
        ids: every token id pushed.
        text: the text emitted so far (after a final push: the whole decode of `ids`).
        full_decodes: how many times the whole sequence had to be decoded (the clean-up fallback).
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0
        self.full_decodes = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: Iterable[int], final: bool = False) -> str:
        """Add token ids; returns the text they complete ("" while it ends in an incomplete character, unless
        `final`: then whatever is left, replacement characters included)."""
        self.ids.extend(int(t) for t in ids)
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return ""
        p, r = self.prefix_offset, self.read_offset
        before = self._decode(self.ids[p:r]) if r > p else ""
        after = self._decode(self.ids[p:])
        if not final and after.endswith(_INCOMPLETE):
            return ""
        if after.startswith(before):
            new = after[len(before):]
        else:  # the tokenizer rewrote the window's earlier text: compare whole texts (rare)
            self.full_decodes += 1
            full = self._decode(self.ids)
            new = full[len(self.text):] if full.startswith(self.text) else ""
        self.prefix_offset, self.read_offset = r, len(self.ids)
        self.text += new
        return new

    @property
    def held(self) -> int:
        """Tokens pushed whose text is not emitted yet (an incomplete character waits for the next token)."""
        return len(self.ids) - self.read_offset

    def finish(self) -> str:
        """The final push (no more tokens): emit what was held back; returns it."""
        return self.push((), final=True) if self.read_offset < len(self.ids) else ""
