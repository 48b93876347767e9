"""Generation through the engine: seeds, stop strings, limits, logprobs, streaming text."""

from __future__ import annotations

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import FinishReason, SamplingParams
from strata.errors import BadRequest


@pytest.fixture(scope="module")
def engine(tiny_loaded):
    loaded = tiny_loaded
    cfg = EngineConfig(model=loaded.path, device="cpu", parallel=4, max_context=256)
    with Engine(cfg, loaded=loaded) as eng:
        yield eng


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_seeded_sampling_is_reproducible_alone_and_in_company(engine) -> None:
    p = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    ids = _ids(engine, "Tell me a story")
    alone = engine.complete(ids, p).token_ids
    noise = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    handles = [engine.generate(_ids(engine, f"noise {i}"), noise) for i in range(3)]
    again = engine.complete(ids, p).token_ids
    for h in handles:
        h.result()
    assert alone == again
    other = engine.complete(ids, SamplingParams(**{**p.__dict__, "seed": 99})).token_ids
    assert other != alone


def test_max_tokens_ends_with_length(engine) -> None:
    r = engine.complete(_ids(engine, "Count:"), SamplingParams(max_tokens=5, ignore_eos=True))
    assert r.finish_reason == FinishReason.LENGTH and r.completion_tokens == 5
    assert not r.truncated


def test_stop_string_ends_generation_and_is_not_emitted(engine) -> None:
    ids = _ids(engine, "Once upon a time")
    free = engine.complete(ids, SamplingParams(max_tokens=20, ignore_eos=True))
    text = free.text
    assert len(text) > 6
    stop = text[3:6]
    r = engine.complete(ids, SamplingParams(max_tokens=20, ignore_eos=True, stop=[stop]))
    assert r.finish_reason == FinishReason.STOP
    assert r.stop_string == stop
    assert stop not in r.text
    assert r.text == text[: text.index(stop)]


def test_stop_token_ends_generation(engine) -> None:
    ids = _ids(engine, "Once upon a time")
    free = engine.complete(ids, SamplingParams(max_tokens=10, ignore_eos=True))
    stop_at = free.token_ids[4]
    r = engine.complete(ids, SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=[stop_at]))
    first = free.token_ids.index(stop_at)
    assert r.finish_reason == FinishReason.STOP
    assert r.token_ids == free.token_ids[: first + 1]


def test_logprobs_are_reported_per_token(engine) -> None:
    r = engine.complete(_ids(engine, "Hello"), SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3))
    assert len(r.logprobs) == 4
    for lp, tok in zip(r.logprobs, r.token_ids):
        assert lp.token_id == tok and lp.logprob <= 0.0
        assert len(lp.top) == 3
        assert lp.top[0][2] >= lp.logprob  # greedy: the chosen token is the best one


def test_streamed_text_equals_decoded_ids(engine) -> None:
    h = engine.generate(_ids(engine, "The sea"), SamplingParams(max_tokens=24, ignore_eos=True))
    events = list(h)
    text = "".join(e.text for e in events)
    ids = [t for e in events for t in e.token_ids]
    assert text == engine.tokenizer.decode(ids)
    assert events[-1].finish_reason is not None
    assert all(e.finish_reason is None for e in events[:-1])


def test_bad_requests_are_refused(engine) -> None:
    with pytest.raises(BadRequest, match="empty"):
        engine.complete([], SamplingParams())
    with pytest.raises(BadRequest, match="max_tokens"):
        engine.complete([1, 2], SamplingParams(max_tokens=-1))  # 0 reads the prompt only
    with pytest.raises(BadRequest, match="token ids"):
        engine.complete([10**9], SamplingParams())
