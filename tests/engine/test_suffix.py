"""The suffix proposer's index: incremental updates, candidates against a brute-force search, drafts."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.speculative import PAUSE_AFTER, PAUSE_STEPS, LaneDrafting
from strata.engine.suffix import KEY, SharedCorpus, TokenIndex, draft_from


def _brute(tokens: list[int], tail: list[int]) -> list[tuple[int, int]]:
    """Every position after an occurrence of tail's last KEY tokens, with its match length."""
    out = []
    for pos in range(KEY, len(tokens)):
        if tokens[pos - KEY : pos] != tail[-KEY:]:
            continue
        m = KEY
        while m < 32 and m < len(tail) and pos - m - 1 >= 0 and tokens[pos - m - 1] == tail[-m - 1]:
            m += 1
        out.append((m, pos))
    return out


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=60), st.lists(st.integers(0, 3), min_size=KEY, max_size=12))
def test_candidates_are_the_brute_force_occurrences(tokens: list[int], tail: list[int]) -> None:
    index = TokenIndex()
    for t in tokens:  # one token at a time, as a conversation grows
        index.append(t)
    got = index.candidates(tail, limit=1000)
    want = _brute(tokens, tail)
    assert sorted(got) == sorted(want)
    assert [m for m, _ in got] == sorted((m for m, _ in got), reverse=True)  # longest first
    assert index.candidates(tail, limit=1000) == TokenIndex(tokens).candidates(tail, limit=1000)


def test_draft_continues_the_longest_match() -> None:
    text = [5, 1, 2, 3, 4, 9, 9, 7, 1, 2, 3, 8, 8, 6, 7, 1, 2, 3]
    draft = draft_from([[TokenIndex(text)]], text, 3)
    assert draft.tokens == [8, 8, 6]  # after "7 1 2 3" (4 tokens of the tail), not "5 1 2 3" (3)
    assert draft.match == 4
    assert draft.confidence[0] == 0.5  # of the two candidates, one continues with 8


def test_confidence_cuts_the_draft() -> None:
    text = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    draft = draft_from([[TokenIndex(text)]], text, 4)
    assert draft.tokens[:2] == [4, 6] and draft.confidence[:2] == [1.0, 0.5]
    assert draft.cut(0.9) == [4]
    assert draft.cut(0.0) == draft.tokens


def test_the_conversation_itself_comes_before_other_conversations() -> None:
    corpus = SharedCorpus(100)
    corpus.add([1, 2, 3, 7, 7, 7])
    own = TokenIndex([1, 2, 3, 8, 8, 0, 1, 2, 3])
    assert draft_from([[own], corpus.sources()], own.tokens, 2).tokens == [8, 8]
    other = TokenIndex([0, 1, 2, 3])
    assert draft_from([[other], corpus.sources()], other.tokens, 2).tokens == [7, 7]
    assert draft_from([[TokenIndex([4, 4])], corpus.sources()], [9, 9, 9], 2).tokens == []


def test_shared_corpus_keeps_the_newest_within_its_budget() -> None:
    corpus = SharedCorpus(10)
    corpus.add([1, 2, 3, 4, 5, 6])
    corpus.add([7, 8, 9, 10, 11, 12])  # 12 tokens: the older conversation goes
    assert corpus.tokens == 6 and [d.tokens for d in corpus.sources()] == [[7, 8, 9, 10, 11, 12]]
    corpus.add(list(range(100, 130)))  # longer than the budget: its last 10 tokens are kept
    assert corpus.tokens == 10 and corpus.sources()[0].tokens == list(range(120, 130))


def test_draft_length_grows_shrinks_and_pauses() -> None:
    state = LaneDrafting(k=2)
    state.verified(2, 2, most=4)
    assert state.k == 3
    state.verified(3, 1, most=4)
    assert state.k == 2 and state.pause == 0
    for _ in range(PAUSE_AFTER):
        state.verified(2, 0, most=4)
    assert state.k == 1 and state.pause == PAUSE_STEPS
    for _ in range(PAUSE_AFTER):
        state.verified(1, 0, most=4)
    assert state.pause == 2 * PAUSE_STEPS  # a second pause in a row lasts twice as long
    state.verified(1, 1, most=4)
    assert state.pauses == 0 and state.k == 2
