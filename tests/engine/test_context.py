"""--max-context: by default the model's trained context, capped by memory; -c 0 the same; -c N wins.

The sizing is a pure function of the rooms (free bytes and bytes a cell per
device), so the cap is tested with made-up memory; the engine tests use the
tiny model, trained for 2,048 tokens.
"""

from __future__ import annotations

import logging

import pytest

from strata.cli import build_parser
from strata.engine.config import EngineConfig, config_from_args
from strata.engine.context import ContextChoice, PastTrained, Room, choose_context, pool_rooms
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.errors import BadRequest, ContextTooLong

GIB = 2**30
CELL = 128 << 10  # a Llama-3-8B cell in bf16: 32 layers x 2 x 8 KV heads x 128 x 2 bytes
TINY_TRAINED = 2048  # tests/tiny_llama.py's max_position_embeddings


def test_the_trained_context_when_the_pool_fits() -> None:
    choice = choose_context(EngineConfig(parallel=4), 8192, [Room("cpu", 10 * GIB, 23040)])
    assert choice == ContextChoice(8192, 8192)
    assert choice.describe() == "max context 8192 (trained 8192)"


@pytest.mark.parametrize("lanes, tokens", [(1, 16384), (4, 4096), (3, 4096)])
def test_capped_by_memory_to_whole_chunks(lanes: int, tokens: int) -> None:
    """2 GiB of 128 KiB cells hold 16,384 tokens: a lane's share, rounded down to 4096-cell chunks."""
    room = Room("cuda:0", 2 * GIB, CELL)
    choice = choose_context(EngineConfig(parallel=lanes), 131072, [room])
    assert choice.tokens == tokens and choice.trained == 131072
    assert lanes * choice.tokens * CELL <= room.free_bytes  # the pool fits where it lives
    assert choice.describe() == (f"max context {tokens} (trained 131072; capped by memory: cuda:0 has "
                                 f"2.0 GiB for the KV pool, {lanes} lanes x 128.0 KiB a token)")
    roomier = choose_context(EngineConfig(parallel=lanes), 131072, [Room("cuda:0", 4 * GIB, CELL)])
    assert roomier.tokens == 2 * tokens  # the control: twice the memory, twice the context


def test_the_tightest_device_decides_and_a_chunk_flag_rounds() -> None:
    rooms = [Room("cuda:0", 8 * GIB, CELL // 2), Room("cuda:1", 1 * GIB, CELL // 2)]
    assert choose_context(EngineConfig(), 131072, rooms).tokens == 16384
    assert "cuda:1 has 1.0 GiB" in (choose_context(EngineConfig(), 131072, rooms).reason or "")
    odd = Room("cpu", 20000 * CELL, CELL)  # 20,000 tokens fit: 4 chunks of 4096, or 20 of 1000
    assert choose_context(EngineConfig(), 131072, [odd]).tokens == 16384
    assert choose_context(EngineConfig(kv_chunk=1000), 131072, [odd]).tokens == 20000


def test_an_explicit_context_wins() -> None:
    small = [Room("cpu", 32 << 20, CELL)]  # would cap the default at 256 tokens
    assert choose_context(EngineConfig(max_context=4096), 8192, small) == ContextChoice(4096, 8192)
    past = choose_context(EngineConfig(max_context=16384), 8192, small)
    assert past.tokens == 16384 and "past the trained context" in past.describe()
    assert choose_context(EngineConfig(), 8192, small).tokens == 256  # the default is capped


def test_a_shared_pool_caps_by_its_size() -> None:
    choice = choose_context(EngineConfig(kv_pool_tokens=16384), 131072, [])
    assert choice.tokens == 16384 and choice.reason == "capped by --kv-pool-tokens 16384"
    assert choose_context(EngineConfig(kv_pool_tokens=1 << 20), 131072, []) == ContextChoice(131072, 131072)


def test_no_useful_pool_is_refused_naming_the_flags() -> None:
    with pytest.raises(BadRequest, match="no KV pool of a useful context fits: cpu has 16 MiB") as info:
        choose_context(EngineConfig(parallel=4), 131072, [Room("cpu", 16 << 20, CELL)])
    assert info.value.param == "max_context" and "--max-context N" in str(info.value)


def test_rooms_of_a_model_on_the_cpu(tiny_loaded) -> None:
    rooms = pool_rooms(tiny_loaded.model, [0, 1], 128, streamed=False, weights={"cpu": 1 << 20})
    assert [(r.device, r.bytes_per_cell) for r in rooms] == [("cpu", 256)]
    assert rooms[0].free_bytes < pool_rooms(tiny_loaded.model, [0, 1], 128, False, {})[0].free_bytes


def _engine(tiny_loaded, **kw) -> Engine:
    return Engine(EngineConfig(model=tiny_loaded.path, device="cpu", dtype="bfloat16", **kw), loaded=tiny_loaded)


def test_the_engine_takes_the_trained_context_and_says_so(tiny_loaded) -> None:
    with _engine(tiny_loaded) as eng:
        assert eng.config.max_context == TINY_TRAINED and eng.pool.total_cells == TINY_TRAINED
        assert "; max context 2048 (trained 2048);" in eng.summary()


@pytest.mark.parametrize("argv, tokens", [(["-c", "0"], TINY_TRAINED), ([], TINY_TRAINED), (["-c", "512"], 512),
                                          (["--ctx-size", "1024"], 1024)])
def test_flags_zero_is_trained_and_a_number_wins(tiny_loaded, argv: list[str], tokens: int) -> None:
    cfg = config_from_args(build_parser().parse_args(["serve", "--model", str(tiny_loaded.path), *argv]))
    with Engine(cfg, loaded=tiny_loaded) as eng:
        assert eng.config.max_context == tokens
        assert f"max context {tokens} (trained 2048)" in eng.summary()
        assert len(eng.complete(list(range(10, 10 + tokens - 1)), SamplingParams(max_tokens=1)).token_ids) == 1
        with pytest.raises(ContextTooLong):  # the control: one more token is past it
            eng.complete(list(range(10, 10 + tokens)), SamplingParams(max_tokens=1))


def test_bad_values_end_parsing(capsys) -> None:
    for bad in ("-1", "lots"):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(["serve", "-c", bad])
        assert info.value.code == 2
        assert "choose 0 (the model's trained context) or a number of tokens" in capsys.readouterr().err
    with pytest.raises(BadRequest, match="--max-context must be 0"):
        Engine(EngineConfig(max_context=-1))


def test_past_the_trained_context_warns_once(tiny_loaded, caplog) -> None:
    caplog.set_level(logging.INFO, logger="strata.engine")
    with _engine(tiny_loaded, max_context=2200) as eng:
        started = [r.getMessage() for r in caplog.records if "--max-context 2200" in r.getMessage()]
        assert started == ["--max-context 2200 is past the 2048 tokens the model was trained for (it has no "
                           "rope scaling): answers may degrade beyond them"]
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        assert len(eng.complete(list(range(10, 2000)), params).token_ids) == 2  # within: no warning yet
        assert not [r for r in caplog.records if "past the 2048 the model" in r.getMessage()]
        for first in (10, 20):
            assert len(eng.complete(list(range(first, first + 2100)), params).token_ids) == 2
    warned = [r.getMessage() for r in caplog.records if "past the 2048 the model" in r.getMessage()]
    assert len(warned) == 1 and "without rope scaling" in warned[0]


def test_past_trained_counts_tokens_not_steps(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="strata.engine")
    p = PastTrained(100, scaled=True)
    p.see(100, "req-1")
    assert not caplog.records
    p.see(101, "req-1")
    p.see(500, "req-2")
    assert [r.getMessage()[:40] for r in caplog.records] == ["request req-1 reached 101 tokens, past t"]
    assert "with its rope scaling" in caplog.records[0].getMessage()
