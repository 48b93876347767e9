"""Speculative decoding: drafts for decoding lanes, and what verification accepted.

A decoding lane may carry up to `--spec N` drafted tokens into a step: it
feeds its pending token and the drafts as one run, the forward returns
logits for every row of the run, and the engine samples row by row
(`Engine._verify`), keeping drafts while each sampled token equals the
draft at its place. The first token that differs (or the one after the last
draft) is the lane's next pending token, so every step still yields at least
one token. Rejected drafts are rolled back by length: their K/V stays in
cells past the lane's tokens and is overwritten by the next step, no copy.
A model's recurrent or window state goes back to the state after the last
kept row, which the verified run kept for each of its rows (`kv/state.py`).

Sampling row by row with the request's own generator, stopping at the first
mismatch, draws exactly the noise a run without drafts would draw for the
same tokens: for a draft proposed without a distribution (the suffix
proposer's), accepting when the sample equals the draft is the speculative
acceptance test against a point mass, so greedy and seeded output are the
same tokens as without speculation wherever the forward's rows do not depend
on their company (the CPU path; docs/SPECULATIVE.md).

Proposers sit behind `Proposer`: the suffix proposer (drafts from the
conversation and from finished ones, `suffix.py`), the model's own MTP head
(`mtp.py`) and a draft model (`draft_model.py`), asked in that order. Each lane's draft length
adapts: it grows while drafts are accepted whole and shrinks to what was
accepted, and a lane whose drafts keep failing pauses drafting for a while,
so open text, where drafts rarely hold, costs little.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from strata.engine.suffix import SharedCorpus, TokenIndex, draft_from

if TYPE_CHECKING:
    from strata.engine.request import Request

PAUSE_AFTER = 2  # verifications in a row accepting nothing before a lane pauses drafting
PAUSE_STEPS = 4  # decode steps of the first pause; each further pause in a row doubles it
MAX_PAUSE = 64
SHARED_TOKENS = 1 << 16  # tokens of finished conversations kept for drafting in others
# Rows a decode step may have before drafts stop being nearly free: past them a drafted row costs
# about what a lane's decoded token does, so drafts there pay only if almost all hold. The CPU's
# products turn compute-bound at a few rows (docs/SPECULATIVE.md); a GPU's stay bound by reading
# the weights far longer.
STEP_ROWS = {"cpu": 8, "cuda": 64}


@dataclass(frozen=True)
class SpecConfig:
    """--spec N (most drafts a lane carries into a step; 0: off), --spec-min-p, --suffix-draft."""

    n: int = 0
    min_p: float = 0.0  # a draft stops before its first token whose confidence is below this
    shared_tokens: int = SHARED_TOKENS
    step_rows: int = STEP_ROWS["cpu"]  # a step's decode rows (lanes plus drafts) at most


class Proposer(Protocol):
    """Drafts the tokens after a request's context; `name` labels its figures."""

    name: str

    def propose(self, req: Request, lane_state: LaneDrafting, k: int) -> list[int]: ...

    def finished(self, req: Request, lane_state: LaneDrafting) -> None: ...


@dataclass
class ProposerStats:
    proposed: int = 0  # draft tokens carried into steps
    accepted: int = 0  # of those, kept by verification
    verifications: int = 0  # lane-steps that carried a draft

    def as_dict(self) -> dict[str, float]:
        return {"drafted_tokens": self.proposed, "accepted_tokens": self.accepted,
                "verifications": self.verifications,
                "acceptance_rate": self.accepted / self.proposed if self.proposed else 0.0,
                "mean_accepted_length": self.accepted / self.verifications if self.verifications else 0.0}


@dataclass
class LaneDrafting:
    """One request's drafting: its own index, its current draft length and any pause."""

    k: int
    index: TokenIndex | None = None  # the request's prompt and output, built at its first draft
    source: str = ""  # the proposer of its last draft
    failures: int = 0  # verifications in a row that accepted nothing
    pause: int = 0  # decode steps left without drafting
    pauses: int = 0  # pauses in a row (the next one lasts longer)

    def drafted_by(self, name: str) -> None:
        """The proposer of the draft now in flight (its figures count the verification)."""
        self.source = name

    def verified(self, drafted: int, accepted: int, most: int) -> None:
        """Adapt to a verification: grow after a whole acceptance, shrink to what held, pause
        after repeated failures (longer each time in a row)."""
        if accepted == drafted:
            self.k = min(most, self.k + 1)
            self.failures = self.pauses = 0
        else:
            self.k = max(1, accepted + 1)
        if accepted == 0:
            self.failures += 1
            if self.failures >= PAUSE_AFTER:
                self.pause = min(MAX_PAUSE, PAUSE_STEPS << self.pauses)
                self.pauses += 1
                self.failures = 0
        else:
            self.failures = self.pauses = 0


class SuffixProposer:
    """Drafts read from where the context's tail occurred before: in the conversation itself,
    then in the finished conversations of `corpus`."""

    name = "suffix"

    def __init__(self, corpus: SharedCorpus, min_p: float) -> None:
        self.corpus = corpus
        self.min_p = min_p

    def propose(self, req: Request, state: LaneDrafting, k: int) -> list[int]:
        ctx = req.prompt + req.output  # the last output token is the lane's pending one
        if state.index is None:
            state.index = TokenIndex(ctx)
        else:
            state.index.extend(ctx[len(state.index) :])
        return draft_from([[state.index], self.corpus.sources()], ctx, k).cut(self.min_p)

    def finished(self, req: Request, state: LaneDrafting) -> None:
        self.corpus.add(req.prompt + req.output)


class Speculator:
    """The engine's drafting: which lanes draft, how many tokens, from which proposer (the first
    in order with a draft), and the figures of it per proposer."""

    def __init__(self, config: SpecConfig, proposers: list[Proposer]) -> None:
        self.config = config
        self.proposers = proposers
        self.stats = {p.name: ProposerStats() for p in proposers}
        self._lanes: dict[int, LaneDrafting] = {}  # request id -> its drafting

    def plan(self, wanted: list[tuple[Request, int]]) -> list[list[int]]:
        """Drafts for a step's decoding requests, each within its room (what its limits leave) and
        all within the step's rows (`step_rows`, the lanes counted); when they are short, requests
        whose drafts held lately (the longest current draft length) draft first."""
        budget = max(0, self.config.step_rows - len(wanted))
        out: list[list[int]] = [[] for _ in wanted]
        for i in sorted(range(len(wanted)), key=lambda i: -self._priority(wanted[i][0])):
            req, room = wanted[i]
            out[i] = self.draft(req, min(room, budget))
            budget -= len(out[i])
        return out

    def rests(self, reqs: Sequence[Request | None]) -> bool:
        """Whether none of these decoding requests would draft in their next step, whatever
        token this one gives: the step's rows leave no room for drafts, or each request is
        constrained by a grammar or in a pause after failed drafts. The engine may then launch
        that step before this one's tokens reach the host (its pipeline)."""
        if self._full(reqs):
            return True
        for req in (r for r in reqs if r is not None):
            state = self._lanes.get(req.id)
            if req.params.grammar is None and (state is None or state.pause == 0):
                return False
        return True

    def rested(self, reqs: Sequence[Request | None]) -> None:
        """A step of these requests went without drafting (`rests`): it counts off their pauses,
        as `draft` would have."""
        if self._full(reqs):
            return  # no room: `draft` would not have been asked either
        for req in reqs:
            state = None if req is None else self._lanes.get(req.id)
            if state is not None and state.pause > 0:
                state.pause -= 1

    def _full(self, reqs: Sequence[Request | None]) -> bool:
        """Whether these requests' decode rows alone fill a step: no room for any draft."""
        return sum(r is not None for r in reqs) >= self.config.step_rows

    def _priority(self, req: Request) -> int:
        state = self._lanes.get(req.id)
        return self.config.n if state is None else (0 if state.pause else state.k)

    def draft(self, req: Request, room: int) -> list[int]:
        """Drafts for `req`'s next step, at most `room` tokens."""
        if req.params.grammar is not None or room <= 0:  # a grammar's masks would need its matcher
            return []  # advanced through the drafts: constrained requests do not draft
        state = self._lanes.setdefault(req.id, LaneDrafting(self.config.n))
        if state.pause > 0:
            state.pause -= 1
            return []
        for proposer in self.proposers:
            drafts = proposer.propose(req, state, min(state.k, room))
            if drafts:
                state.drafted_by(proposer.name)
                return drafts
        return []

    def verified(self, req: Request, drafted: int, accepted: int) -> None:
        state = self._lanes.get(req.id)
        if state is None:
            return
        stats = self.stats[state.source]
        stats.proposed += drafted
        stats.accepted += accepted
        stats.verifications += 1
        state.verified(drafted, accepted, self.config.n)

    def finished(self, req: Request) -> None:
        """The request ended: its conversation becomes a source for others; its state goes."""
        state = self._lanes.pop(req.id, None) or LaneDrafting(self.config.n)
        for proposer in self.proposers:
            proposer.finished(req, state)

    def figures(self) -> dict[str, Any]:
        """All proposers' counts together, then each proposer's as `NAME_FIGURE`."""
        total = ProposerStats(sum(s.proposed for s in self.stats.values()),
                              sum(s.accepted for s in self.stats.values()),
                              sum(s.verifications for s in self.stats.values()))
        out: dict[str, Any] = {"proposers": ",".join(self.stats), "max_drafts": self.config.n,
                               "min_p": self.config.min_p, "step_rows": self.config.step_rows,
                               **total.as_dict()}
        for name, stats in self.stats.items():
            out.update({f"{name}_{key}": value for key, value in stats.as_dict().items()})
        return out
