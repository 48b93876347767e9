"""min_tokens, logit_bias and prompt-progress events through the engine (tiny random model)."""

from __future__ import annotations

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import FinishReason, PromptProgress, SamplingParams
from strata.errors import BadRequest


@pytest.fixture(scope="module")
def engine(tiny_loaded):
    cfg = EngineConfig(model=tiny_loaded.path, device="cpu", parallel=2, max_context=256,
                       prefill_chunk=16)
    with Engine(cfg, loaded=tiny_loaded) as eng:
        yield eng


def _ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def _run(n: int, **kw) -> SamplingParams:
    """n tokens that EOS does not end, unless `kw` says otherwise."""
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def test_logit_bias_makes_greedy_pick_a_token(engine) -> None:
    prompt = _ids(engine, "The weather today")
    free = engine.complete(prompt, _run(4))
    target = _ids(engine, " banana")[0]
    assert target not in free.token_ids
    assert engine.complete(prompt, _run(4, logit_bias={target: 100})).token_ids == [target] * 4
    sampled = engine.complete(prompt, _run(4, temperature=1.0, seed=3, logit_bias={target: 100.0}))
    assert sampled.token_ids == [target] * 4
    avoided = engine.complete(prompt, _run(4, logit_bias={free.token_ids[0]: -100}))
    assert avoided.token_ids[0] != free.token_ids[0]


def test_logprobs_stay_those_of_the_model_under_a_bias(engine) -> None:
    prompt = _ids(engine, "Numbers:")
    free = engine.complete(prompt, SamplingParams(max_tokens=1, logprobs=0))
    target = _ids(engine, " banana")[0]
    forced = engine.complete(prompt, SamplingParams(max_tokens=1, logprobs=0, logit_bias={target: 100}))
    assert forced.token_ids == [target]
    assert forced.logprobs[0].logprob < free.logprobs[0].logprob  # the raw model's view of the token


def test_min_tokens_holds_back_eos(engine) -> None:
    eos = engine.tokenizer.eos_token_id
    prompt = _ids(engine, "Hello")
    to_eos = SamplingParams(max_tokens=20, logit_bias={eos: 100})
    first = engine.complete(prompt, to_eos)  # the control: EOS at once
    assert first.finish_reason == FinishReason.STOP and first.token_ids == [eos]
    held = engine.complete(prompt, SamplingParams(max_tokens=20, logit_bias={eos: 100}, min_tokens=6))
    assert held.finish_reason == FinishReason.STOP
    assert held.completion_tokens == 7 and held.token_ids[-1] == eos and eos not in held.token_ids[:6]


def test_min_tokens_holds_back_stop_tokens_and_strings(engine) -> None:
    prompt = _ids(engine, "Once upon a time")
    free = engine.complete(prompt, _run(12))
    stop_at = free.token_ids[2]
    first = free.token_ids.index(stop_at)
    stopped = engine.complete(prompt, _run(12, stop_token_ids=[stop_at]))
    assert stopped.completion_tokens == first + 1  # the control
    held = engine.complete(prompt, _run(12, stop_token_ids=[stop_at], min_tokens=8))
    assert held.completion_tokens >= 8 and stop_at not in held.token_ids[:8]
    assert held.token_ids[:first] == free.token_ids[:first]

    stop = free.text[2:5]
    assert engine.complete(prompt, _run(12, stop=[stop])).stop_string == stop  # the control
    kept = engine.complete(prompt, _run(12, stop=[stop], min_tokens=12))
    assert kept.finish_reason == FinishReason.LENGTH and kept.text == free.text


def test_controls_are_validated(engine) -> None:
    with pytest.raises(BadRequest) as e:
        engine.complete([1, 2], SamplingParams(max_tokens=4, min_tokens=5))
    assert e.value.param == "min_tokens"
    with pytest.raises(BadRequest) as e:
        engine.complete([1, 2], SamplingParams(min_tokens=-1))
    assert e.value.param == "min_tokens"
    for bias in ({10**9: 1.0}, {-1: 1.0}, {5: 101.0}, {5: float("nan")}):
        with pytest.raises(BadRequest) as e:
            engine.complete([1, 2], SamplingParams(logit_bias=bias))
        assert e.value.param == "logit_bias"


def _progress(events) -> list[PromptProgress]:
    return [e.progress for e in events if e.progress is not None]


def test_progress_events_follow_the_prompt_read(engine) -> None:
    prompt = list(range(1000, 1040))  # 40 tokens: read 16, 16 and 8 (the last chunk samples)
    events = list(engine.generate(prompt, _run(3, progress=True)))
    assert _progress(events) == [PromptProgress(40, 0, 0), PromptProgress(40, 0, 16),
                                 PromptProgress(40, 0, 32)]
    for e in events:
        if e.progress is not None:
            assert e.text == "" and e.token_ids == [] and e.finish_reason is None
    assert sum(len(e.token_ids) for e in events) == 3 and events[-1].finish_reason is not None

    again = list(engine.generate(prompt, _run(3, progress=True)))
    assert _progress(again) == [PromptProgress(40, 39, 39)]  # the lane kept the prompt: one to read

    quiet = list(engine.generate(list(range(2000, 2040)), _run(3)))
    assert _progress(quiet) == [] and len(quiet) == 3  # without progress: the events of old
