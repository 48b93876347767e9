"""A MoE model served by the engine, with and without an expert cache: the same greedy text."""

from __future__ import annotations

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.errors import BadRequest
from strata.serve.metrics import EngineCollector
from tools.synth import SHAPES, copy_tokenizer_fields, write_gguf

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def moe_file(tmp_path_factory, default_gguf) -> str:
    path = tmp_path_factory.mktemp("moe") / "tiny-moe.gguf"
    write_gguf(path, SHAPES["tiny-moe"], copy_tokenizer_fields(str(default_gguf)), quant="Q8_0")
    return str(path)


def _run(path: str, **flags) -> tuple[list[list[int]], dict]:
    cfg = EngineConfig(model=path, device="cpu", max_context=256, parallel=2, **flags)
    with Engine(cfg) as eng:
        handles = [eng.generate(eng.tokenizer.encode(p), SamplingParams(max_tokens=12, temperature=0.0))
                   for p in PROMPTS]
        out = [h.result().token_ids for h in handles]
        return out, eng.stats()


def test_expert_cache_keeps_the_greedy_tokens(moe_file: str) -> None:
    resident, stats = _run(moe_file)
    assert stats["expert_cache"] is None and stats["weight_mode"] == "gguf"
    cached, stats = _run(moe_file, expert_cache="2", expert_policy="lru")
    assert cached == resident
    figures = stats["expert_cache"]
    assert figures["slots_per_layer"] == 2 and figures["layers"] == 4
    assert 0 < figures["hit_rate"] < 1 and figures["bytes_per_token"] > 0
    names = {m.name: m for m in EngineCollector(lambda: stats).collect()}
    assert names["strata_engine_expert_cache_enabled"].samples[0].value == 1
    assert names["strata_engine_expert_cache_hit_rate"].samples[0].value == figures["hit_rate"]
    capped, stats = _run(moe_file, expert_cache="2", expert_uploads=1)  # the rest on the host
    assert capped == resident
    assert stats["expert_cache"]["host_computed"] > 0
    ahead, stats = _run(moe_file, expert_cache="2", expert_prefetch=True)  # copies ahead of use
    assert ahead == resident
    assert stats["expert_cache"]["prefetched"] > 0
    assert 0 <= stats["expert_cache"]["prefetch_used"] <= stats["expert_cache"]["prefetched"]


def test_bad_expert_flags_are_refused_before_the_load(moe_file: str) -> None:
    with pytest.raises(BadRequest, match="--expert-cache"):
        Engine(EngineConfig(model=moe_file, device="cpu", expert_cache="0"))
    with pytest.raises(BadRequest, match="--expert-policy"):
        Engine(EngineConfig(model=moe_file, device="cpu", expert_policy="fifo"))
    with pytest.raises(BadRequest, match="--expert-uploads caps an expert cache's copies"):
        Engine(EngineConfig(model=moe_file, device="cpu", expert_uploads=2))
    with pytest.raises(BadRequest, match="--expert-prefetch fills an expert cache's slots"):
        Engine(EngineConfig(model=moe_file, device="cpu", expert_prefetch=True))
    with pytest.raises(BadRequest, match="--expert-uploads must be 0 or more"):
        Engine(EngineConfig(model=moe_file, device="cpu", expert_cache="2", expert_uploads=-1))
    with pytest.raises(BadRequest, match="--expert-misses must be one of copy, mapped"):
        Engine(EngineConfig(model=moe_file, device="cpu", expert_cache="2", expert_misses="stream"))
    with pytest.raises(BadRequest, match="--expert-misses says how an expert cache"):
        Engine(EngineConfig(model=moe_file, device="cpu", expert_misses="mapped"))
    with pytest.raises(BadRequest, match="does not take --expert-prefetch"):
        Engine(EngineConfig(model=moe_file, device="cpu", expert_cache="2", expert_misses="mapped",
                            expert_prefetch=True))
    with pytest.raises(BadRequest, match="reads host memory from a GPU"):
        Engine(EngineConfig(model=moe_file, device="cpu", expert_cache="2", expert_misses="mapped"))
