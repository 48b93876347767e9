"""The pool's figures after a request: cells holding tokens, not whole reserved chunks, are its usage."""

from __future__ import annotations

import re

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.serve.metrics import ServeMetrics


@pytest.fixture(scope="module")
def tiny(tiny_loaded):
    return tiny_loaded


def test_an_idle_engine_reports_the_tokens_its_lane_holds(tiny) -> None:
    cfg = EngineConfig(model=tiny.path, device="cpu", dtype="bfloat16", parallel=2, max_context=1024,
                       kv_pool_tokens=8192)
    prompt = tiny.tokenizer.encode("The quick brown fox")
    with Engine(cfg, loaded=tiny) as eng:
        out = eng.complete(prompt, SamplingParams(max_tokens=8, ignore_eos=True))
        stats = eng.stats()
        text = ServeMetrics(eng.stats, lambda: "tiny").render().decode()
    held = stats["tokens_per_session"]
    assert stats["lanes_busy"] == 0 and sum(1 for n in held.values() if n) == 1
    # The lane keeps the prompt and every answer token but the last (sampled, never read back).
    assert stats["pool_cells_holding_tokens"] == sum(held.values()) == len(prompt) + len(out.token_ids) - 1
    chunks = sum(stats["chunks_per_session"].values())
    assert chunks >= 1
    assert stats["pool_cells_reserved"] == stats["pool_cells_used"] == chunks * stats["kv_chunk"]
    assert stats["pool_cells_free"] == stats["pool_cells_total"] - stats["pool_cells_reserved"]
    assert stats["pool_cells_total"] == 8192
    usage = stats["pool_usage_fraction"]
    assert usage == stats["pool_cells_holding_tokens"] / 8192
    assert 0 < usage < stats["pool_cells_reserved"] / stats["pool_cells_total"] < 1
    m = re.search(r'^vllm:kv_cache_usage_perc\{model_name="tiny"\} (\S+)$', text, re.M)
    assert m is not None and float(m.group(1)) == pytest.approx(usage)


def test_the_start_up_summary_says_what_runs(tiny_loaded) -> None:
    cfg = EngineConfig(model=tiny_loaded.path, device="cpu", dtype="bfloat16", parallel=2, max_context=256,
                       kv_pool_tokens=512, kv_chunk=16)
    with Engine(cfg, loaded=tiny_loaded) as eng:
        line = eng.summary()
    assert f"({tiny_loaded.config.arch}, {tiny_loaded.config.num_layers} layers) on cpu, bfloat16" in line
    assert "KV bf16: 2 lanes, 512 cells in 32 chunks of 16" in line
    assert "conversation cache off" in line and "layer state" not in line
