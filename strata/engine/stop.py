"""Stop strings over streamed text.

Text arrives in pieces (one per decoded token, or fewer), and a stop string may
be spread over several of them, so the matcher holds back any tail that could
still become a stop string and releases it once that is ruled out.

Which stop string wins: the one that completes first in the text (the earliest
end), and among those ending at the same place the longest. That is what a
stream can decide without waiting for more text, and it does not depend on how
the text was cut into pieces. The emitted text is everything before the
winning match; nothing from the match on is ever emitted.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Filter one request's output text against its stop strings."""

    def __init__(self, stop_strings: Sequence[str]) -> None:
        # An empty stop string would match before any text; it means nothing.
        self._stops = sorted({s for s in stop_strings if s}, key=len, reverse=True)
        self._prefixes = frozenset(s[:i] for s in self._stops for i in range(1, len(s)))
        self._max_hold = max((len(s) for s in self._stops), default=1) - 1
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
        if not self._stops:
            return text, None
        buf = self._held + text
        # Held text never holds a whole stop string, so any match ends in `text`.
        best: tuple[int, int, str] | None = None  # (end, -length, stop)
        for stop in self._stops:
            start = buf.find(stop)
            if start >= 0:
                key = (start + len(stop), -len(stop), stop)
                if best is None or key < best:
                    best = key
        if best is not None:
            end, neg_len, stop = best
            self._held = ""
            self._stopped = stop
            return buf[: end + neg_len], stop
        keep = self._hold_length(buf)
        self._held = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """Release held-back text at the end of generation (it never became a stop string)."""
        held, self._held = self._held, ""
        return held

    def _hold_length(self, buf: str) -> int:
        """Length of the longest tail of `buf` that starts some stop string."""
        for n in range(min(len(buf), self._max_hold), 0, -1):
            if buf[-n:] in self._prefixes:
                return n
        return 0
