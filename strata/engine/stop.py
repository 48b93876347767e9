"""Stop strings over streamed text.

Text arrives in pieces (one per decoded token, or fewer), and a stop string may
be spread over several of them, so the matcher holds back any tail that could
still become a stop string and releases it once that is ruled out.

Which stop string wins: the one that completes first in the text (the earliest
end), and among those ending at the same place the longest. That is what a
stream can decide without waiting for more text, and it does not depend on how
the text was cut into pieces. The emitted text is everything before the
winning match; nothing from the match on is ever emitted.

Memory is linear in the stop strings' total length: each keeps its KMP
failure table and how much of it the text so far ends with (keeping every
prefix of every stop string, as before, was quadratic: a 30,000-character
stop string cost 323 MiB on the engine thread). Each character of text costs
amortised O(1) per stop string, and runs of text that cannot start one are
skipped with str.find.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence


def _failure(s: str) -> array:
    """KMP's table: fail[i] is the longest proper border of s[: i + 1]."""
    fail = array("l", [0]) * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail


class _Tail:
    """One stop string and how much of it the text so far ends with (a KMP automaton)."""

    __slots__ = ("stop", "fail", "state")

    def __init__(self, stop: str) -> None:
        self.stop = stop
        self.fail = _failure(stop)
        self.state = 0  # the longest tail of the text that is a proper prefix of `stop`

    def scan(self, text: str) -> tuple[int, int]:
        """(end of the first completed match in `text` or -1, the state after `text` or that end)."""
        s, fail, k = self.stop, self.fail, self.state
        first, n, i = s[0], len(s), 0
        while i < len(text):
            if k == 0:  # jump to the next place the stop string could start
                i = text.find(first, i)
                if i < 0:
                    return -1, 0
            c = text[i]
            while k and c != s[k]:
                k = fail[k - 1]
            if c == s[k]:
                k += 1
                if k == n:
                    return i + 1, k
            i += 1
        return -1, k

    def keep(self, state: int) -> None:
        """The text so far was scanned without a match: remember how much of `stop` it ends with."""
        self.state = state

    def reset(self) -> None:
        self.state = 0


class StopMatcher:
    """Filter one request's output text against its stop strings."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        # An empty stop string would match before any text; it means nothing.
        self._tails = [_Tail(s) for s in sorted({s for s in stop_strings if s}, key=len, reverse=True)]
        self._held = ""
        self._stopped: str | None = None

    @property
    def stopped(self) -> str | None:
        """The stop string that ended the text, once one has."""
        return self._stopped

    def push(self, text: str) -> tuple[str, str | None]:
        """Add `text`; return what may be shown now and the stop string, if one matched.

        After a stop every further push returns ("", that stop string).
        """
        if self._stopped is not None:
            return "", self._stopped
        if not self._tails:
            return text, None
        # Held text never holds a whole stop string, so any match ends in `text`.
        best: tuple[int, int, str] | None = None  # (end in text, -length, stop)
        states = []
        for tail in self._tails:
            end, state = tail.scan(text)
            states.append(state)
            if end >= 0:
                key = (end, -len(tail.stop), tail.stop)
                if best is None or key < best:
                    best = key
        buf = self._held + text
        if best is not None:
            end, neg_len, stop = best
            self._held = ""
            self._stopped = stop
            return buf[: len(buf) - len(text) + end + neg_len], stop
        for tail, state in zip(self._tails, states):
            tail.keep(state)
        keep = max(states)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """Release held-back text at the end of generation (it never became a stop string)."""
        held, self._held = self._held, ""
        for tail in self._tails:
            tail.reset()
        return held
