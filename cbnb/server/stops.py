"""Stop strings found by the server on the streamed text (until the engine finds them itself).

The engine stops on token ids only; the issue "generation parity" moves stop strings into the engine. Until then
the server watches the detokenised text: a `StopMatcher` releases text only when it cannot be the start of a stop
string, and once a stop string appears it returns the text before it and reports `stopped` (the server then cancels
the engine request). The token that completed the match was generated, so it counts in `usage.completion_tokens`.
"""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    """Incremental search for the earliest of several stop strings in a growing text.

    Args:
        stops: non-empty strings.

    `push(text)` returns what may be sent now; `flush()` returns the held-back tail when the stream ends without a
    stop. Text before a stop string is never held back longer than the longest stop string minus one character.
    Which stop wins does not depend on how the text is split into pushes: the one whose last character comes first
    (stops "c" and "aca" on "aaca": "c", leaving "aa").
    """

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self.buf = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.buf += text
        # The stop string completed first ends the text (generation halts there, as transformers'
        # StopStringCriteria does after the token that completes it); of those completed at the same character,
        # the longest. The first occurrence of each string is the one that completes first.
        hits = [(i + len(s), i) for s in self.stops if (i := self.buf.find(s)) >= 0]
        if hits:
            out, self.buf, self.stopped = self.buf[:min(hits)[1]], "", True
            return out
        hold = 0  # the longest tail of buf that is a proper prefix of a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.buf)), hold, -1):
                if self.buf.endswith(s[:k]):
                    hold = k
                    break
        cut = len(self.buf) - hold
        out, self.buf = self.buf[:cut], self.buf[cut:]
        return out

    def flush(self) -> str:
        out, self.buf = self.buf, ""
        return out
