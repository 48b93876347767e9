"""Lanes over one shared pool: exactness, prefix reuse, and every pool-full path."""

from __future__ import annotations

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import FinishReason, SamplingParams
from strata.errors import ContextTooLong, KvPoolFull, QueueFull

PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "In 1492, Columbus sailed",
    "Water boils at",
    "A list of prime numbers: 2, 3, 5,",
]


@pytest.fixture(scope="module")
def tiny(tiny_loaded):
    return tiny_loaded


def _engine(loaded, **kw) -> Engine:
    cfg = EngineConfig(model=loaded.path, device="cpu", dtype="bfloat16", **kw)
    return Engine(cfg, loaded=loaded)


def _ids(loaded, text: str) -> list[int]:
    return loaded.tokenizer.encode(text)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def _alone(loaded, prompts: list[list[int]], n: int) -> list[list[int]]:
    with _engine(loaded, parallel=1, max_context=256) as eng:
        return [eng.complete(p, _greedy(n)).token_ids for p in prompts]


@pytest.mark.parametrize("pool_tokens", [None, 512])
def test_lanes_are_byte_identical_to_running_alone(tiny, pool_tokens) -> None:
    prompts = [_ids(tiny, t) for t in PROMPTS]
    expected = _alone(tiny, prompts, 24)
    with _engine(tiny, parallel=3, max_context=256, kv_pool_tokens=pool_tokens, kv_chunk=16,
                 prefill_chunk=7) as eng:
        handles = [eng.generate(p, _greedy(24)) for p in prompts]
        got = [h.result().token_ids for h in handles]
        stats = eng.stats()
    assert got == expected
    assert stats["lanes_busy"] == 0
    if pool_tokens:
        assert stats["pool_cells_total"] == 512


def test_resumed_prefix_gives_same_output_as_reading_from_zero(tiny) -> None:
    first = _ids(tiny, "Once upon a time, in a land far away,")
    with _engine(tiny, parallel=2, max_context=256, kv_pool_tokens=256, kv_chunk=16) as eng:
        r1 = eng.complete(first, _greedy(20))
        follow = first + r1.token_ids + _ids(tiny, " and then")
        r2 = eng.complete(follow, _greedy(20))
        stats = eng.stats()
    assert r2.cached_tokens == len(first) + len(r1.token_ids) - 1
    assert stats["prefix_reuse_hits"] == 1
    assert stats["prefix_tokens_reused"] == r2.cached_tokens
    assert r2.token_ids == _alone(tiny, [follow], 20)[0]


def test_partly_shared_chunk_tail_is_overwritten(tiny) -> None:
    """A prefix that ends inside a chunk: the old tail beyond it is never read as valid."""
    a = _ids(tiny, "The weather today is sunny and warm with a light breeze")
    b = a[:9] + _ids(tiny, " cold, wet and grey")
    with _engine(tiny, parallel=1, max_context=256, kv_pool_tokens=128, kv_chunk=8) as eng:
        eng.complete(a, _greedy(10))
        rb = eng.complete(b, _greedy(16))
    assert rb.cached_tokens == 9
    assert rb.token_ids == _alone(tiny, [b], 16)[0]


def test_idle_caches_evicted_lru_first_then_refusal(tiny) -> None:
    p = [_ids(tiny, t) for t in PROMPTS[:3]]
    with _engine(tiny, parallel=3, max_context=64, kv_pool_tokens=64, kv_chunk=16) as eng:
        eng.complete(p[0], _greedy(4))  # lane 0 idle, 1 chunk
        eng.complete(p[1] + p[1], _greedy(4))  # another lane, LRU is lane of p[0]
        before = eng.stats()
        assert before["lanes_idle"] == 2
        long_prompt = (p[2] * 12)[:40]  # needs 3 chunks: 4 total, 1-2 free + evictions
        r = eng.complete(long_prompt, _greedy(4))
        assert r.finish_reason == FinishReason.LENGTH
        after = eng.stats()
        assert after["evictions"] >= 1
        # the most recent idle conversation survives when one eviction is enough
        assert eng.scheduler.lanes[0].tokens == [] or after["evictions"] == 2
        # a prompt that cannot fit even after evicting everything idle is refused
        with pytest.raises(KvPoolFull) as info:
            h1 = eng.generate((p[0] * 20)[:60], _greedy(30))
            h2 = eng.generate((p[1] * 20)[:60], _greedy(30))
            h1.result()
            h2.result()
        assert info.value.retry_after > 0
        eng.pool.check_invariants()


def test_decoding_lane_that_cannot_grow_is_truncated(tiny) -> None:
    p = [_ids(tiny, t) for t in PROMPTS[:2]]
    with _engine(tiny, parallel=2, max_context=128, kv_pool_tokens=64, kv_chunk=16) as eng:
        h1 = eng.generate(p[0], _greedy(100))
        h2 = eng.generate(p[1], _greedy(100))
        r1, r2 = h1.result(), h2.result()
        stats = eng.stats()
        eng.pool.check_invariants()
    truncated = [r for r in (r1, r2) if r.truncated]
    assert truncated, "with 4 chunks two lanes cannot both reach 100 tokens"
    assert all(r.finish_reason == FinishReason.LENGTH for r in truncated)
    assert stats["truncations"] == len(truncated)


def test_refusals_leave_the_pool_consistent_and_idle(tiny) -> None:
    with _engine(tiny, parallel=1, max_context=64, kv_pool_tokens=32, kv_chunk=16,
                 max_queued=1) as eng:
        with pytest.raises(ContextTooLong, match="64"):
            eng.complete(list(range(100, 170)), _greedy(1))
        with pytest.raises(KvPoolFull):
            eng.complete(list(range(100, 150)), _greedy(1))
        handles = [eng.generate(_ids(tiny, PROMPTS[0]), _greedy(8)) for _ in range(4)]
        outcomes = []
        for h in handles:
            try:
                h.result()
                outcomes.append("ok")
            except QueueFull:
                outcomes.append("queue_full")
        assert "queue_full" in outcomes and "ok" in outcomes
        stats = eng.stats()
        eng.pool.check_invariants()
    assert stats["refusals"] >= 2
    assert stats["lanes_busy"] == 0


def test_cancel_frees_the_lane(tiny) -> None:
    with _engine(tiny, parallel=1, max_context=256, kv_pool_tokens=256, kv_chunk=16) as eng:
        h = eng.generate(_ids(tiny, PROMPTS[0]), _greedy(200))
        it = iter(h)
        next(it)
        h.cancel()
        events = list(it)
        assert events[-1].finish_reason == FinishReason.CANCELLED
        r = eng.complete(_ids(tiny, PROMPTS[1]), _greedy(4))
        assert r.completion_tokens == 4
        assert eng.stats()["lanes_busy"] == 0


def test_cancel_all_ends_running_and_queued_requests(tiny) -> None:
    """What a stopping server does: every request ends with a cancelled finish, and the engine
    keeps serving (nothing else changed)."""
    with _engine(tiny, parallel=1, max_context=256) as eng:
        running = eng.generate(_ids(tiny, PROMPTS[0]), _greedy(200))
        it = iter(running)
        next(it)
        queued = eng.generate(_ids(tiny, PROMPTS[1]), _greedy(200))  # one lane: this one waits
        eng.cancel_all()
        assert list(it)[-1].finish_reason == FinishReason.CANCELLED
        assert list(queued)[-1].finish_reason == FinishReason.CANCELLED
        assert eng.complete(_ids(tiny, PROMPTS[2]), _greedy(3)).completion_tokens == 3


def test_an_idle_server_without_a_queue_admits_a_request(tiny) -> None:
    """--parallel 1 --max-queued 0: a free lane is not a queue; only a second request waits."""
    with _engine(tiny, parallel=1, max_context=64, max_queued=0) as eng:
        assert eng.complete(_ids(tiny, PROMPTS[0]), _greedy(3)).finish_reason == FinishReason.LENGTH
        handles = [eng.generate(_ids(tiny, PROMPTS[1]), _greedy(20)) for _ in range(2)]
        outcomes = []
        for h in handles:
            try:
                h.result()
                outcomes.append("ok")
            except QueueFull:
                outcomes.append("queue_full")
        assert sorted(outcomes) == ["ok", "queue_full"]
        assert eng.complete(_ids(tiny, PROMPTS[2]), _greedy(3)).finish_reason == FinishReason.LENGTH
