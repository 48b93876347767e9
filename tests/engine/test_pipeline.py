"""Pipelined decode (the next greedy step launched before this one is post-processed).

On the GPU it overlaps the host's work with the device's; here on the CPU it
runs the same bookkeeping synchronously, so the CPU tests hold it to the
ordinary path's results exactly: the same tokens, texts and finish reasons
for lanes that stop at different steps, by EOS, stop strings, max_tokens and
cancellation, with requests queued behind busy lanes and sampled requests
mixed in.
"""

from __future__ import annotations

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import FinishReason, SamplingParams
from strata.errors import BadRequest

PROMPTS = [
    "Rain fell on the",
    "class Stack:\n    ",
    "The largest planet is",
    "Bread is made from",
    "Colours of the rainbow: red, orange,",
    "Once upon a time",
]


def _engine(loaded, pipeline: str, **kw) -> Engine:
    cfg = EngineConfig(model=loaded.path, device="cpu", dtype="bfloat16", pipeline=pipeline,
                       max_context=96, kv_chunk=16, **kw)
    return Engine(cfg, loaded=loaded)


def _params(i: int) -> SamplingParams:
    """Lanes that end at different steps and for different reasons."""
    if i == 3:
        return SamplingParams(max_tokens=30, temperature=0.8, seed=7)  # sampled: ordinary steps
    if i == 4:
        return SamplingParams(max_tokens=12, logprobs=2)
    return SamplingParams(max_tokens=[5, 19, 40, 0, 0, 200][i], ignore_eos=i != 0, stop=[", "] if i == 2 else [])


def _run(loaded, pipeline: str, parallel: int) -> list[tuple]:
    with _engine(loaded, pipeline, parallel=parallel) as eng:
        assert eng.pipeline == (pipeline == "on")
        handles = [eng.generate(loaded.tokenizer.encode(t), _params(i)) for i, t in enumerate(PROMPTS)]
        out = []
        for h in handles:
            events = list(h)
            out.append(("".join(e.text for e in events), [t for e in events for t in e.token_ids],
                        events[-1].finish_reason, events[-1].completion_tokens,
                        [lp.token_id for e in events for lp in e.logprobs]))
        stats = eng.stats()
        assert stats["lanes_busy"] == 0
        assert (stats["pipelined_steps"] > 20) == (pipeline == "on"), stats["pipelined_steps"]
    return out


@pytest.mark.parametrize("parallel", [1, 3, 6])
def test_pipelined_results_equal_the_ordinary_path(tiny_loaded, parallel) -> None:
    plain = _run(tiny_loaded, "off", parallel)
    piped = _run(tiny_loaded, "on", parallel)
    assert piped == plain
    reasons = {r[2] for r in plain}
    assert FinishReason.LENGTH in reasons  # the mix really ends lanes in more than one way
    assert plain[5][2] == FinishReason.LENGTH and plain[5][3] == 96 - len(tiny_loaded.tokenizer.encode(PROMPTS[5]))


def test_a_follow_up_reuses_the_pipelined_conversation(tiny_loaded) -> None:
    """The wasted step past a stopped lane's end leaves its kept K/V intact."""
    ids = tiny_loaded.tokenizer.encode("The capital of France")
    results = []
    for pipeline in ("off", "on"):
        with _engine(tiny_loaded, pipeline, parallel=2) as eng:
            first = eng.complete(ids, SamplingParams(max_tokens=9, ignore_eos=True))
            second = eng.complete(ids + first.token_ids + [5], SamplingParams(max_tokens=9, ignore_eos=True))
            assert eng.stats()["prefix_tokens_reused"] >= len(ids) + 8
            results.append((first.token_ids, second.token_ids))
    assert results[0] == results[1]


def test_cancel_while_a_step_is_in_flight(tiny_loaded) -> None:
    with _engine(tiny_loaded, "on", parallel=2) as eng:
        keep = eng.generate(tiny_loaded.tokenizer.encode("Water boils at"), SamplingParams(max_tokens=30, ignore_eos=True))
        gone = eng.generate(tiny_loaded.tokenizer.encode("The quick"), SamplingParams(max_tokens=80, ignore_eos=True))
        it = iter(gone)
        next(it)
        gone.cancel()
        rest = list(it)
        assert rest[-1].finish_reason == FinishReason.CANCELLED
        kept = keep.result()
        assert kept.completion_tokens == 30
    with _engine(tiny_loaded, "off", parallel=1) as eng:
        alone = eng.complete(tiny_loaded.tokenizer.encode("Water boils at"), SamplingParams(max_tokens=30, ignore_eos=True))
    assert kept.token_ids == alone.token_ids


def test_bad_pipeline_value(tiny_loaded) -> None:
    with pytest.raises(BadRequest, match="--pipeline"):
        _engine(tiny_loaded, "sometimes", parallel=1)
