"""Erasing a lane's conversation (llama-server's `/slots/{id}?action=erase`) on the real engine,
and the busy lane's /slots row read off the real scheduler."""

from __future__ import annotations

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.errors import BadRequest, LaneBusy
from strata.serve.slots import lane_table


@pytest.fixture(scope="module")
def engine(tiny_loaded):
    cfg = EngineConfig(model=tiny_loaded.path, device="cpu", dtype="bfloat16", parallel=2,
                       max_context=256, kv_pool_tokens=512, kv_chunk=16)
    with Engine(cfg, loaded=tiny_loaded) as eng:
        yield eng


def test_an_erased_lane_holds_nothing_and_the_next_request_reads_from_zero(engine: Engine, tiny_loaded) -> None:
    prompt = tiny_loaded.tokenizer.encode("The quick brown fox jumps over")
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    engine.complete(prompt, params)
    again = engine.complete(prompt, params)
    assert again.cached_tokens > 0  # held in its lane: reused
    lane = next(lane.index for lane in engine.scheduler.lanes if lane.tokens)
    held = len(engine.scheduler.lanes[lane].tokens)
    assert engine.erase_slot(lane) == held
    assert engine.scheduler.lanes[lane].tokens == []
    assert engine.stats()["tokens_per_session"][lane] == 0
    assert engine.complete(prompt, params).cached_tokens == 0
    assert engine.erase_slot(1 - lane) == 0  # an empty lane: nothing to drop, no error


def test_a_busy_lane_or_an_unknown_one_is_refused(engine: Engine, tiny_loaded) -> None:
    for lane in range(2):
        engine.erase_slot(lane)
    with pytest.raises(BadRequest, match="no lane 2") as info:
        engine.erase_slot(2)
    assert info.value.param == "id_slot"
    handle = engine.generate(tiny_loaded.tokenizer.encode("Once upon a time"),
                             SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
    events = iter(handle)
    next(events)  # admitted and decoding
    busy = next(lane.index for lane in engine.scheduler.lanes if lane.request is not None)
    row = lane_table(engine)[busy]  # /slots' llama-server fields, read off the real scheduler
    assert row["is_processing"] is True and row["id_task"] >= 1 and row["params"]["n_predict"] == 200
    assert row["next_token"]["has_next_token"] is True and row["next_token"]["n_decoded"] >= 1
    with pytest.raises(LaneBusy, match="busy") as info:
        engine.erase_slot(busy)
    assert info.value.param == "id_slot"
    handle.cancel()
    list(events)
    assert engine.scheduler.lanes[busy].tokens  # its conversation kept: the erase changed nothing
