"""Conversation cache policy: LRU by slots and bytes, reuse image, incremental re-park.

K/V here is a fake whose cell i is a function of tokens[:i + 1] (a rolling
hash), like real K/V: a cell holding another conversation's bytes is caught
by comparing against the expected K/V of the entry's own tokens.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from strata.engine.conversation_cache import (
    TOKEN_BYTES,
    ConversationCache,
    ParkedKV,
    common_prefix,
)

N_LAYERS = 2
CELL_BYTES = N_LAYERS * (8 + 3)  # per layer: "k" int64 [1] + "v" int8 [3]
BPT = CELL_BYTES  # K/V bytes per token over all layers
ENTRY_PER_TOKEN = BPT + TOKEN_BYTES


def fake_kv(tokens: list[int], start: int, end: int) -> list[dict[str, torch.Tensor]]:
    """Per layer K/V of positions [start, end): cell i depends on tokens[:i + 1] only."""
    h, hashes = 0, []
    for t in tokens[:end]:
        h = (h * 1_000_003 + t + 1) % (1 << 31)
        hashes.append(h)
    hs = torch.tensor(hashes[start:end], dtype=torch.int64).reshape(-1, 1)
    return [
        {"k": hs + layer, "v": ((hs + layer) % 127).to(torch.int8).expand(-1, 3).contiguous()}
        for layer in range(N_LAYERS)
    ]


class Capture:
    """A capture_fn for one conversation's tokens that records the ranges asked for."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = list(tokens)
        self.calls: list[tuple[int, int]] = []

    def __call__(self, start: int, end: int) -> list[dict[str, torch.Tensor]]:
        self.calls.append((start, end))
        return fake_kv(self.tokens, start, end)


def kv_matches(tokens: list[int], kv: ParkedKV) -> bool:
    want = fake_kv(tokens, 0, len(tokens))
    return kv.n_cells == len(tokens) and all(
        torch.equal(kv.layer(i)[name], want[i][name]) for i in range(N_LAYERS) for name in want[i]
    )


def parked(tokens: list[int]) -> ParkedKV:
    return ParkedKV(fake_kv(tokens, 0, len(tokens)))


def put(cache: ConversationCache, tokens: list[int]) -> int:
    return cache.put(tokens, parked(tokens))


def entry_size(n_tokens: int) -> int:
    return n_tokens * ENTRY_PER_TOKEN


def conv(tag: int, n: int, system: list[int] | None = None) -> list[int]:
    return (system or []) + [1000 * tag + i for i in range(n)]


def state(cache: ConversationCache) -> tuple:
    image = cache.reuse_image
    return (cache.entry_ids(), cache.bytes(), cache.stats().as_dict(), id(image),
            None if image is None else (image.kv.n_cells, image.kv.capacity))


# ----- lookup -----

def test_lookup_finds_each_clients_own_history_behind_a_shared_system_prompt() -> None:
    system = list(range(1, 41))
    cache = ConversationCache(1 << 20, slots=8, min_prefix=4)
    a, b = conv(1, 5, system), conv(2, 7, system)
    ida, idb = put(cache, a), put(cache, b)
    assert cache.lookup(a + [9, 9]) == (ida, len(a))
    assert cache.lookup(b + [9]) == (idb, len(b))
    eid, shared = cache.lookup(system + [77])  # only the system prompt: the most recent wins
    assert shared == len(system) and eid == idb
    assert cache.lookup([1, 2, 3]) is None  # shorter than min_prefix
    assert cache.lookup([5, 5, 5, 5, 5]) is None
    assert (cache.hits, cache.misses) == (3, 2)


def test_common_prefix() -> None:
    t = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    assert common_prefix(t([1, 2, 3]), t([1, 2, 4, 5])) == 2
    assert common_prefix(t([1, 2]), t([1, 2, 3])) == 2
    assert common_prefix(t([]), t([1])) == 0
    assert common_prefix(t([7]), t([1])) == 0


# ----- eviction -----

def test_eviction_is_least_recently_used_first() -> None:
    cache = ConversationCache(1 << 20, slots=3)
    ids = [put(cache, conv(i, 4)) for i in range(3)]
    cache.lookup(conv(0, 4))  # conversation 0 is now the most recently used
    assert cache.make_room(entry_size(4))
    assert cache.entry_ids() == [ids[2], ids[0]]
    assert cache.evictions == 1


def test_slot_limit_evicts_even_with_bytes_to_spare() -> None:
    cache = ConversationCache(1 << 30, slots=2)
    first = put(cache, conv(0, 3))
    put(cache, conv(1, 3))
    assert not cache.can_fit(1)
    assert cache.make_room(1)
    assert len(cache) == 1 and first not in cache.entry_ids()


def test_byte_limit_evicts_just_enough() -> None:
    cache = ConversationCache(entry_size(10) * 3, slots=8)
    ids = [put(cache, conv(i, 10)) for i in range(3)]
    assert cache.bytes() == entry_size(10) * 3
    assert cache.make_room(entry_size(15))  # needs two entries gone
    assert cache.entry_ids() == [ids[2]] and cache.evictions == 2
    assert cache.bytes() + entry_size(15) <= cache.budget_bytes


def test_make_room_refuses_without_evicting_when_nothing_could_fit() -> None:
    cache = ConversationCache(entry_size(10), slots=4)
    put(cache, conv(0, 5))
    before = state(cache)
    assert not cache.make_room(entry_size(10), held_bytes=1)
    assert state(cache) == before


def test_can_fit_changes_nothing() -> None:
    cache = ConversationCache(entry_size(12), slots=3)
    put(cache, conv(0, 4))
    put(cache, conv(1, 4))
    cache.take(cache.lookup(conv(1, 4))[0])  # leaves a reuse image
    put(cache, conv(2, 4))
    before = state(cache)
    assert cache.bytes() == cache.budget_bytes
    sizes = (0, 1, entry_size(4), entry_size(100))
    answers = [cache.can_fit(x, held) for x in sizes for held in (0, 50)]
    assert state(cache) == before
    assert answers == [True] + [False] * 7
    assert cache.make_room(entry_size(4))  # the same question answered by acting changes things
    assert state(cache) != before


def test_make_room_drops_the_reuse_image_before_evicting_anyone() -> None:
    cache = ConversationCache(entry_size(30), slots=8)
    a, b, c = conv(0, 10), conv(1, 10), conv(2, 10)
    put(cache, a), put(cache, b), put(cache, c)
    cache.take(cache.lookup(c)[0])
    ids = cache.entry_ids()
    assert cache.reuse_image is not None and cache.bytes() == entry_size(30)
    assert cache.make_room(entry_size(10))
    assert cache.reuse_image is None and cache.reuse_drops == 1
    assert cache.entry_ids() == ids and cache.evictions == 0


def test_put_charges_true_size_on_the_capacity_basis() -> None:
    cache = ConversationCache(1 << 20, slots=4)
    tokens = conv(0, 9)
    assert cache.estimate_bytes(9, BPT) == entry_size(9)
    before = cache.bytes()
    put(cache, tokens)
    assert cache.bytes() - before == entry_size(9)
    roomy = ParkedKV([{k: torch.cat([t, t]) for k, t in s.items()} for s in fake_kv(tokens, 0, 9)],
                     n_cells=9)  # capacity 18, 9 cells valid
    before = cache.bytes()
    eid = cache.put(conv(1, 9), roomy)
    assert cache.bytes() - before == 18 * CELL_BYTES + 9 * TOKEN_BYTES
    assert cache.take(eid).nbytes() == 18 * CELL_BYTES + 9 * TOKEN_BYTES


def test_put_supersedes_entries_its_tokens_extend() -> None:
    cache = ConversationCache(1 << 20, slots=8)
    short = conv(0, 5)
    put(cache, short)
    other = put(cache, conv(1, 5))
    new = put(cache, short + [1, 2])
    assert cache.entry_ids() == [other, new] and cache.superseded == 1
    assert cache.bytes() == entry_size(5) + entry_size(7)


# ----- reuse image and incremental re-park -----

def test_take_keeps_the_bytes_as_the_reuse_image() -> None:
    cache = ConversationCache(1 << 20, slots=4)
    a = conv(0, 6)
    eid = put(cache, a)
    size = cache.bytes()
    entry = cache.take(eid)
    assert kv_matches(a, entry.kv) and len(cache) == 0
    assert cache.bytes() == size and cache.restores == 1
    image, shared = cache.reuse_for(a + [5])
    assert image is not None and shared == 6 and image.tokens.tolist() == a


def test_reuse_image_is_never_handed_to_another_conversation() -> None:
    """Seed 000: a reuse image handed back regardless of tokens gives a parked
    entry of one conversation the K/V of another."""
    cache = ConversationCache(1 << 20, slots=4)
    system = [7, 8, 9]
    a = conv(1, 8, system)
    cache.take(put(cache, a))  # a is back in a lane; its bytes are the reuse image
    b = conv(2, 12)  # shares nothing with a
    assert cache.reuse_for(b) == (None, 0)
    cap_b = Capture(b)
    eb = cache.park(b, cap_b, BPT)
    assert cap_b.calls == [(0, len(b))] and kv_matches(b, cache.take(eb).kv)
    assert cache.full_parks == 1 and cache.incremental_parks == 0

    cache.take(put(cache, a))
    c = conv(3, 9, system)  # shares only the system prompt with a
    image, shared = cache.reuse_for(c)
    assert image is not None and shared == len(system)
    cap_c = Capture(c)
    ec = cache.park(c, cap_c, BPT)
    assert cap_c.calls == [(len(system), len(c))]
    assert kv_matches(c, cache.take(ec).kv)


def test_reuse_image_survives_a_full_cache_and_grows_incrementally() -> None:
    """Seed 002: a long conversation re-parked every round while short ones keep the
    cache full must keep the incremental path (no gate that recaptures it whole)."""
    growth = [40, 6, 9, 5, 12, 7]
    final = sum(growth)
    final_image = ParkedKV(fake_kv([0] * 40, 0, 40))  # the capacity the image will reach
    for n in (46, 55, 60, 72, final):
        final_image.append(fake_kv([0] * n, final_image.n_cells, n))
    budget = final_image.nbytes() + final * TOKEN_BYTES + 2 * entry_size(8)
    cache = ConversationCache(budget, slots=3)
    long_conv: list[int] = []
    for r, n in enumerate(growth):
        short = conv(100 + r, 8)  # a short-lived conversation: parked, fills the slots
        assert cache.park(short, Capture(short), BPT) is not None
        if long_conv:
            eid, shared = cache.lookup(long_conv + [1])
            assert shared == len(long_conv)
            assert kv_matches(long_conv, cache.take(eid).kv)
        old = len(long_conv)
        long_conv = long_conv + [7000 + r * 100 + i for i in range(n)]
        if old:  # the cache is full: a gate on can_fit would drop the image here
            image, shared = cache.reuse_for(long_conv)
            assert shared == old
            with_reuse = image.kv.nbytes_for(len(long_conv)) + len(long_conv) * TOKEN_BYTES
            assert not cache.can_fit(with_reuse)
        evictions = cache.evictions
        cap = Capture(long_conv)
        eid = cache.park(long_conv, cap, BPT)
        assert eid is not None and cap.calls == [(old, len(long_conv))]
        assert cache.evictions == evictions and cache.reuse_drops == 0
        assert cache.bytes() <= cache.budget_bytes and len(cache) <= cache.slots
    assert cache.incremental_parks == len(growth) - 1
    assert cache.full_parks == len(growth) + 1  # every short park plus the first long one
    entry = cache.take(cache.lookup(long_conv)[0])
    assert kv_matches(long_conv, entry.kv) and entry.kv.capacity == final_image.capacity


def test_park_without_new_tokens_captures_nothing() -> None:
    cache = ConversationCache(1 << 20, slots=4)
    a = conv(0, 10)
    cache.take(put(cache, a))
    cap = Capture(a[:6])  # the lane kept only a prefix (an edited turn)
    eid = cache.park(a[:6], cap, BPT)
    assert cap.calls == [] and kv_matches(a[:6], cache.take(eid).kv)


def test_make_room_estimate_for_a_grown_image_is_not_capped() -> None:
    """The image's capacity grows geometrically, so its true size exceeds a fresh
    estimate; capping the figure given to make_room would overfill the budget."""
    x, y = conv(0, 10), conv(1, 4)
    grown = x + [5]
    fresh = ConversationCache.estimate_bytes(len(grown), BPT)
    cache = ConversationCache(fresh + entry_size(len(y)), slots=8)
    cache.take(put(cache, x))
    ey = put(cache, y)
    asked: list[int] = []
    make_room = cache.make_room
    cache.make_room = lambda incoming, held=0: asked.append(incoming) or make_room(incoming, held)
    cap = Capture(grown)
    eid = cache.park(grown, cap, BPT)
    assert eid is not None and cap.calls == [(10, 11)]
    true_size = cache.entry(eid).nbytes()
    assert true_size > fresh and asked[0] == true_size  # room asked for the true size
    assert ey not in cache.entry_ids() and cache.evictions == 1
    assert cache.bytes() <= cache.budget_bytes


def test_park_keeps_the_budget_when_bytes_per_token_is_understated() -> None:
    cache = ConversationCache(entry_size(20) - 1, slots=8)  # a and b do not fit together
    a, b = conv(0, 10), conv(1, 10)
    put(cache, a)
    assert cache.park(b, Capture(b), BPT // 2) is not None
    assert cache.bytes() <= cache.budget_bytes and cache.evictions == 1


def test_park_that_cannot_fit_is_skipped_and_changes_no_entry() -> None:
    cache = ConversationCache(entry_size(5), slots=4)
    e = put(cache, conv(0, 3))
    cap = Capture(conv(1, 6))
    assert cache.park(conv(1, 6), cap, BPT) is None
    assert cap.calls == [] and cache.entry_ids() == [e] and cache.skipped_parks == 1


# ----- random sequences -----

OPS = st.lists(
    st.tuples(st.sampled_from(["park", "grow", "restore", "put", "make_room", "lookup"]),
              st.integers(0, 4), st.integers(0, 12)),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=OPS, budget_tokens=st.integers(0, 80), slots=st.integers(1, 4))
def test_random_sequences_keep_the_accounting_and_the_kv_right(
    ops: list[tuple[str, int, int]], budget_tokens: int, slots: int
) -> None:
    system = [1, 2, 3, 4]
    cache = ConversationCache(entry_size(budget_tokens), slots=slots, min_prefix=2)
    convs = [conv(i + 1, 2, system) for i in range(5)]
    for op, i, k in ops:
        toks = convs[i]
        if op == "park":
            cache.park(toks, Capture(toks), BPT, held_bytes=k * ENTRY_PER_TOKEN // 4)
        elif op == "grow":
            convs[i] = toks + [50_000 + 13 * i + j for j in range(k)]
        elif op == "restore":
            hit = cache.lookup(toks)
            if hit is not None:
                eid, shared = hit
                whole = shared == len(cache.entry(eid).tokens)
                entry = cache.take(eid) if whole or k % 3 == 0 else cache.borrow(eid)
                assert entry.tokens[:shared].tolist() == toks[:shared]
        elif op == "put":
            if cache.make_room(cache.estimate_bytes(len(toks), BPT)):
                cache.put(toks, parked(toks))
        elif op == "make_room":
            cache.make_room(k * ENTRY_PER_TOKEN, held_bytes=k)
        else:
            cache.lookup(toks[: k + 1])
        image = cache.reuse_image
        entries = [cache.entry(e) for e in cache.entry_ids()]
        assert cache.bytes() <= cache.budget_bytes
        assert len(entries) <= slots
        assert cache.bytes() == sum(e.nbytes() for e in entries) + (image.nbytes() if image else 0)
        for e in entries:
            assert kv_matches(e.tokens.tolist(), e.kv)
        if image is not None:
            assert kv_matches(image.tokens.tolist(), image.kv)


def test_checkpoints_go_before_any_entry(tmp_path) -> None:
    """A recurrent model's entries: under pressure their checkpoints are shed, oldest entry
    first, and only then are entries evicted; each keeps its state at its end."""
    from strata.engine.checkpoints import Checkpoint

    def states(n: int) -> list[Checkpoint]:
        return [Checkpoint(p, {}, 100, 0) for p in (n - 2, n - 1, n)]

    a, b, c = conv(1, 6), conv(2, 6), conv(3, 6)
    entry = 6 * ENTRY_PER_TOKEN + 300
    cache = ConversationCache(budget_bytes=2 * entry + 6 * ENTRY_PER_TOKEN + 100, slots=8)
    ea = cache.park(a, Capture(a), BPT, states=states(6))
    eb = cache.park(b, Capture(b), BPT, states=states(6))
    assert cache.bytes() == 2 * entry
    ec = cache.park(c, Capture(c), BPT, states=states(6))  # a's checkpoints make the room
    assert len(cache) == 3 and cache.evictions == 0 and cache.shed_checkpoints == 1
    assert [s.position for s in cache.entry(ea).states] == [6]
    assert len(cache.entry(eb).states) == 3 and len(cache.entry(ec).states) == 3
    assert cache.bytes() == 2 * entry + 6 * ENTRY_PER_TOKEN + 100 and cache.stats().shed_checkpoints == 1
    cache.park(conv(4, 6), Capture(conv(4, 6)), BPT, states=states(6))  # now entries must go too
    assert cache.evictions >= 1 and ea not in cache.entry_ids()
