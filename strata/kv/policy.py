"""Who gives chunks back when the pool is full: a pure function, no mechanism.

Order (seed 000): idle lanes' cached conversations give their chunks back,
least recently used first; if that is still not enough the caller refuses
the request (KvPoolFull) or, for a decoding lane, truncates it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class IdleLane:
    lane: int
    chunks: int  # chunks its cached conversation holds
    last_used: float  # when it last served a request (monotonic clock)


def choose_evictions(need: int, free: int, idle: list[IdleLane]) -> list[int] | None:
    """Lanes whose caches to drop, LRU first, so that `need` chunks are free.

    Returns [] when `free` already covers `need`, and None when even every
    idle cache is not enough (nothing should then be evicted).
    """
    if need <= free:
        return []
    chosen: list[int] = []
    have = free
    for s in sorted(idle, key=lambda s: (s.last_used, s.lane)):
        if s.chunks <= 0:
            continue
        chosen.append(s.lane)
        have += s.chunks
        if have >= need:
            return chosen
    return None
