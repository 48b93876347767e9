"""Which experts stay in a layer's device slots (`--expert-cache`): a pure policy.

The expert cache (`models/experts.py`) asks one question when a step's
routing needs experts that are not in its slots: which resident experts give
their slots up? Experts the step needs are never candidates. The three
orders measured (`python -m benchmarks.expert_policy`, docs/MOE.md):

- `lru`: least recently used first;
- `lfu`: fewest uses first (a static popularity order: right when a few
  experts are hot for the whole run);
- `lfru`: least decayed frequency first: every use adds 1 to a score that
  halves every `half_life` steps of that layer, so experts hot a while ago
  fade while steady favourites stay (frequency with recency).

Ties go to the lower expert id, so the same history always gives the same cache.
Nothing here touches memory; `ExpertUsage.record` is the only state change.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

POLICIES = ("lru", "lfu", "lfru")
DEFAULT_POLICY = "lfru"
HALF_LIFE = 64.0  # steps of one layer; measured: docs/MOE.md


@dataclass
class ExpertUsage:
    """One layer's history: per expert, its last step, its use count and its decayed score."""

    experts: int
    half_life: float = HALF_LIFE
    clock: int = 0
    last_use: list[int] = field(default_factory=list)
    uses: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)  # as of last_use

    def __post_init__(self) -> None:
        self.last_use = self.last_use or [-1] * self.experts
        self.uses = self.uses or [0] * self.experts
        self.score = self.score or [0.0] * self.experts

    def record(self, used: list[int]) -> None:
        """One step of the layer used these experts (each once)."""
        self.clock += 1
        for e in used:
            self.score[e] = self.decayed(e) + 1.0
            self.uses[e] += 1
            self.last_use[e] = self.clock

    def decayed(self, e: int) -> float:
        """Expert e's lfru score now."""
        if self.last_use[e] < 0:
            return 0.0
        return self.score[e] * math.exp2(-(self.clock - self.last_use[e]) / self.half_life)


def _key(usage: ExpertUsage, e: int, policy: str) -> tuple:
    """Expert e's place in the policy's order: the smaller, the sooner it goes."""
    if policy == "lru":
        return (usage.last_use[e], e)
    if policy == "lfu":
        return (usage.uses[e], usage.last_use[e], e)
    return (usage.decayed(e), usage.last_use[e], e)


def evict_order(usage: ExpertUsage, resident: list[int], needed: set[int], policy: str,
                limit: int | None = None) -> list[int]:
    """The resident experts a step may evict, first to go first (never one in `needed`); only the
    first `limit` of them if given (a partial selection: what a refill of a few slots asks)."""
    if policy not in POLICIES:
        raise ValueError(f"expert cache policy must be one of {', '.join(POLICIES)}, not {policy!r}")
    candidates = (e for e in resident if e not in needed)
    if limit is not None:
        return heapq.nsmallest(limit, candidates, key=lambda e: _key(usage, e, policy))
    return sorted(candidates, key=lambda e: _key(usage, e, policy))


def admit(usage: ExpertUsage, candidate: int, victim: int, policy: str) -> bool:
    """Whether copying `candidate` in over `victim` is worth a copy: the policy would keep the
    candidate longer. Where a miss is read in place anyway (`--expert-misses mapped`), a copy
    only pays for an expert used more than the one it replaces (lru: always, the candidate is
    the newer)."""
    return _key(usage, candidate, policy) > _key(usage, victim, policy)


def simulate(trace: list[list[int]], experts: int, slots: int, policy: str,
             half_life: float = HALF_LIFE) -> tuple[int, int]:
    """(hits, misses) of one layer's cache of `slots` over a trace of the experts each step used,
    starting empty: what `benchmarks/expert_policy.py` compares the policies with."""
    usage = ExpertUsage(experts, half_life)
    resident: list[int] = []
    hits = misses = 0
    for used in trace:
        need = set(used)
        missing = [e for e in sorted(need) if e not in resident]
        hits += len(need) - len(missing)
        misses += len(missing)
        free = slots - len(resident)
        if len(missing) > free:
            gone = set(evict_order(usage, resident, need, policy)[: len(missing) - free])
            resident = [e for e in resident if e not in gone]
        resident += missing[: max(0, slots - len(resident))]
        usage.record(sorted(need))
    return hits, misses
