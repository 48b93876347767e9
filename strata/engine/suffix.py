"""Drafts from text already seen: where the conversation's last tokens occurred before, and what followed.

Agent and coding conversations repeat themselves (a file re-emitted with an
edit, a tool result quoted back), so the tokens that followed the last
occurrence of the current tail are often the tokens that come next. A
`TokenIndex` keeps, for one token sequence, the positions after every
`KEY`-token run, updated as tokens are appended (no rebuild per step); a draft
is read from the candidate whose match with the tail is longest (then the
most recent), and each draft token carries the share of the best candidates
that agree with the draft so far: a confidence that `--spec-min-p` cuts at.

Memory is one dict entry per indexed position, bounded by the sequence's
length (the context) for a conversation's own index and by `SharedCorpus`'s
token budget for the finished conversations the server keeps for reuse.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

KEY = 3  # tokens of the run a position is indexed under (shorter matches draft too often wrongly)
MAX_MATCH = 32  # tokens a match is extended backwards to rank candidates
CANDIDATES = 16  # most recent occurrences examined per lookup
VOTERS = 4  # best candidates whose continuations give a draft token its confidence


@dataclass
class Draft:
    """Proposed tokens, each with its confidence (the share of best candidates agreeing so far)."""

    tokens: list[int]
    confidence: list[float]
    match: int = 0  # tokens of the context tail the draft's source matched

    def cut(self, min_p: float) -> list[int]:
        """The draft up to the first token whose confidence falls below `min_p`."""
        n = next((i for i, c in enumerate(self.confidence) if c < min_p), len(self.tokens))
        return self.tokens[:n]


class TokenIndex:
    """One token sequence, and where each `KEY`-token run of it occurred, for drafting its continuation."""

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], list[int]] = {}  # run -> positions right after each occurrence
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        toks = self.tokens
        toks.append(token)
        end = len(toks)
        if end > KEY:  # the run ending before the newest token is followed by it
            self._after.setdefault(tuple(toks[end - 1 - KEY : end - 1]), []).append(end - 1)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def candidates(self, tail: Sequence[int], limit: int = CANDIDATES) -> list[tuple[int, int]]:
        """(match length, position after the match) of the most recent occurrences of `tail`'s last
        `KEY` tokens, longest match first, then most recent. A position equal to the sequence's
        length (the tail itself, when `tail` is this sequence's end) is left out: nothing follows it."""
        if len(tail) < KEY:
            return []
        hits = self._after.get(tuple(tail[-KEY:]))
        if not hits:
            return []
        toks, out = self.tokens, []
        for pos in reversed(hits[-limit - 1 :]):
            if pos >= len(toks):
                continue
            m = KEY
            while m < MAX_MATCH and m < len(tail) and pos - m - 1 >= 0 and toks[pos - m - 1] == tail[-m - 1]:
                m += 1
            out.append((m, pos))
            if len(out) == limit:
                break
        out.sort(key=lambda c: -c[0])  # stable: equal lengths stay most recent first
        return out


def draft_from(groups: Sequence[Sequence[TokenIndex]], tail: Sequence[int], k: int) -> Draft:
    """Up to `k` tokens continuing `tail`, from the first group of sources holding an occurrence of
    its last `KEY` tokens (groups in order of preference: the conversation itself, then the others
    the server keeps); within a group the longest match wins, then the earlier source.

    The draft follows the best candidate; token i's confidence is the share of the best
    `VOTERS` candidates whose next i + 1 tokens equal the draft's.
    """
    for group in groups:
        cands = [(m, s, pos) for s, index in enumerate(group) for m, pos in index.candidates(tail)]
        if not cands:
            continue
        cands.sort(key=lambda c: (-c[0], c[1]))  # stable: within a source, the most recent first
        voters = [(group[s].tokens, pos) for _, s, pos in cands[:VOTERS]]
        toks, best = voters[0]
        tokens = toks[best : best + k]
        agree = voters
        confidence = []
        for i, t in enumerate(tokens):
            agree = [(src, pos) for src, pos in agree if pos + i < len(src) and src[pos + i] == t]
            confidence.append(len(agree) / len(voters))
        return Draft(list(tokens), confidence, cands[0][0])
    return Draft([], [])


class SharedCorpus:
    """Finished conversations kept as indexes for drafting in others, newest first, within a token budget."""

    def __init__(self, budget_tokens: int) -> None:
        self.budget = budget_tokens
        self._docs: OrderedDict[int, TokenIndex] = OrderedDict()
        self.tokens = 0
        self._next = 0

    def add(self, tokens: Sequence[int]) -> None:
        """Keep `tokens` (a conversation that just ended), dropping the oldest past the budget."""
        if self.budget <= 0 or len(tokens) <= KEY:
            return
        tokens = tokens[-self.budget :]
        self._docs[self._next] = TokenIndex(tokens)
        self._next += 1
        self.tokens += len(tokens)
        while self.tokens > self.budget:
            _, old = self._docs.popitem(last=False)
            self.tokens -= len(old)

    def sources(self) -> list[TokenIndex]:
        """The kept conversations, newest first."""
        return list(reversed(self._docs.values()))
