"""Two request options llama-server's /completion needs: a lane chosen by the caller (`id_slot`) and a
request that only reads its prompt (`n_predict: 0`, to warm the cache)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.scheduler import Scheduler
from strata.engine.types import FinishReason, SamplingParams
from strata.errors import BadRequest

PROMPT = "The quick brown fox jumps over the lazy dog"


def _engine(loaded, **kw) -> Engine:
    return Engine(EngineConfig(model=loaded.path, device="cpu", dtype="bfloat16", **kw), loaded=loaded)


def _held(eng: Engine) -> dict[int, int]:
    return {int(k): int(v) for k, v in eng.stats()["tokens_per_session"].items()}


def test_a_pinned_request_runs_on_its_lane(tiny_loaded) -> None:
    ids = tiny_loaded.tokenizer.encode(PROMPT)
    with _engine(tiny_loaded, parallel=3, max_context=256) as eng:
        handle = eng.generate(ids, SamplingParams(max_tokens=3, ignore_eos=True, lane=2))
        assert handle.result().completion_tokens == 3 and handle.lane == 2
        assert _held(eng) == {0: 0, 1: 0, 2: len(ids) + 2}  # the last token is never fed
        free = eng.generate(ids, SamplingParams(max_tokens=3, ignore_eos=True))
        free.result()
        assert free.lane == 2  # unpinned: the lane holding the longest prefix, the same one
        other = eng.generate(ids, SamplingParams(max_tokens=3, ignore_eos=True, lane=0))
        assert other.result().cached_tokens == 0 and other.lane == 0  # a pin overrides the prefix


def test_a_pin_to_a_busy_lane_waits_while_later_requests_go_by(tiny_loaded) -> None:
    ids = tiny_loaded.tokenizer.encode(PROMPT)
    with _engine(tiny_loaded, parallel=2, max_context=256) as eng:
        long = eng.generate(ids, SamplingParams(max_tokens=60, ignore_eos=True, lane=0))
        first = iter(long)
        next(first)  # lane 0 is busy now
        pinned = eng.generate(ids, SamplingParams(max_tokens=2, ignore_eos=True, lane=0))
        later = eng.generate(ids, SamplingParams(max_tokens=2, ignore_eos=True))
        assert later.result().completion_tokens == 2 and later.lane == 1
        done = pinned.result()
        assert done.completion_tokens == 2 and pinned.lane == 0
        assert done.cached_tokens == len(ids) - 1  # it found lane 0 holding the long answer's prompt
        assert list(first)[-1].completion_tokens == 60


def test_a_pin_outside_the_lanes_is_refused(tiny_loaded) -> None:
    with _engine(tiny_loaded, parallel=2, max_context=256) as eng:
        with pytest.raises(BadRequest, match="no lane 5") as e:
            eng.complete(tiny_loaded.tokenizer.encode(PROMPT), SamplingParams(max_tokens=2, lane=5))
        assert e.value.param == "id_slot"
        assert eng.complete(tiny_loaded.tokenizer.encode(PROMPT), SamplingParams(max_tokens=2)).completion_tokens


def test_max_tokens_0_reads_the_prompt_and_keeps_it(tiny_loaded) -> None:
    ids = tiny_loaded.tokenizer.encode(PROMPT)
    with _engine(tiny_loaded, parallel=2, max_context=256) as eng:
        warm = eng.complete(ids, SamplingParams(max_tokens=0))
        assert warm.finish_reason == FinishReason.LENGTH and warm.token_ids == [] and warm.text == ""
        assert warm.completion_tokens == 0 and warm.prompt_tokens == len(ids)
        assert sorted(_held(eng).values()) == [0, len(ids)]  # the whole prompt stays in a lane
        again = eng.complete(ids, SamplingParams(max_tokens=2, ignore_eos=True))
        assert again.cached_tokens == len(ids) - 1  # all but the last token, whose logits are needed
        cold = eng.complete(tiny_loaded.tokenizer.encode("Something else entirely"), SamplingParams(max_tokens=1))
        assert cold.cached_tokens == 0  # the negative control: nothing was warmed for it
        with pytest.raises(BadRequest, match="at least 0"):
            eng.complete(ids, SamplingParams(max_tokens=-1))


def test_next_admissible_keeps_arrival_order_but_skips_busy_pins() -> None:
    """The scheduler's choice alone: the first waiting request whose lane is free (no pool needed)."""
    sched = Scheduler(None, lanes=2, prefill_chunk=16)  # type: ignore[arg-type]
    a, b, c = (SimpleNamespace(params=SamplingParams(lane=lane)) for lane in (0, None, 1))
    sched.waiting.extend([a, b, c])
    sched.lanes[0].request = SimpleNamespace()  # lane 0 busy
    assert sched.next_admissible() is b  # a waits for lane 0
    sched.lanes[1].request = SimpleNamespace()  # b took lane 1
    assert sched.next_admissible() is None  # c waits for lane 1, a for lane 0
    sched.lanes[0].request = None
    assert sched.next_admissible() is a and list(sched.waiting) == [c]
