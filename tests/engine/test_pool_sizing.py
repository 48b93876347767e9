"""The chunk size chosen when --kv-chunk is not given: every lane can run, and start-up says so."""

from __future__ import annotations

import logging

import pytest

from strata.engine.config import EngineConfig, describe_pool, pool_chunk_size
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams


@pytest.mark.parametrize("kw, chunk", [
    ({"parallel": 4, "kv_pool_tokens": 8192}, 512),  # 4096 would make 2 chunks for 4 lanes
    ({"parallel": 1, "kv_pool_tokens": 8192}, 2048),
    ({"parallel": 4}, 4096),  # no shared pool: each lane owns its --max-context
    ({"parallel": 4, "max_context": 1000}, 512),
    ({"parallel": 64, "kv_pool_tokens": 8192}, 128),  # 4 per lane impossible above 64: one per lane
    ({"parallel": 512, "kv_pool_tokens": 8192}, 64),  # nothing fits: the smallest size
    ({"parallel": 4, "kv_pool_tokens": 8192, "kv_chunk": 4096}, 4096),  # the user's choice stands
    ({"max_context": 32, "kv_pool_tokens": 64}, 32),
])
def test_chunk_choice(kw: dict, chunk: int) -> None:
    """Chunk sizes of a resolved --max-context (4096 where a case leaves it out)."""
    assert pool_chunk_size(EngineConfig(**{"max_context": 4096, **kw})) == chunk


def test_chunk_choice_needs_a_resolved_context() -> None:
    """-c 0 means the model's trained context: the engine resolves it before sizing chunks."""
    with pytest.raises(ValueError, match="resolved --max-context"):
        pool_chunk_size(EngineConfig(parallel=4))


def test_every_lane_of_a_small_pool_runs_and_startup_says_what_it_holds(tiny_loaded, caplog) -> None:
    cfg = EngineConfig(model=tiny_loaded.path, device="cpu", dtype="bfloat16", parallel=4,
                       max_context=2048, kv_pool_tokens=1024)
    caplog.set_level(logging.INFO, logger="strata.engine")
    with Engine(cfg, loaded=tiny_loaded) as eng:
        prompt = tiny_loaded.tokenizer.encode("The quick brown fox")
        handles = [eng.generate(prompt + [100 + i], SamplingParams(max_tokens=8, ignore_eos=True))
                   for i in range(4)]
        results = [h.result() for h in handles]
        stats = eng.stats()
    assert all(len(r.token_ids) == 8 for r in results)
    assert stats["kv_chunk"] == 64 and stats["pool_cells_total"] == 1024
    assert stats["refusals"] == 0
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV pool:")]
    assert len(lines) == 1
    assert "4 lanes, 16 chunks of 64 cells = 1024 cells" in lines[0] and "shared" in lines[0]


def test_a_pool_with_fewer_chunks_than_lanes_says_so() -> None:
    line = describe_pool(4, 2, 4096, 2 << 20, "bf16", True)
    assert "only 2 of 4 lanes" in line
