"""A layer split in one process (`--gpus cpu,cpu`): byte-identical to the unsplit engine.

The tiny model has two layers, so each CPU stage holds one; the same code
runs `--gpus 0,1` on two GPUs. Several lanes at once, prefix reuse, parking
and session files (saved by one layout, restored by the other) all go
through the split's one set of chunk tables.
"""

from __future__ import annotations

import pytest
import torch

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.errors import BadRequest
from strata.parallel.plan import parse_devices, plan_stages, split_layers
from strata.parallel.split_pool import SplitPool
from tests.chat_replay import chat_prompt, concurrent, replay

SYSTEM = "You answer questions about a small town's library, briefly and kindly. " * 4
QUESTIONS = [["Books about rivers?", "The shortest one?"], ["Poetry shelf?", "Open Sundays?"],
             ["Renew online?", "How often?"]]
PARAMS = SamplingParams(max_tokens=10, ignore_eos=True)


def _engine(loaded, split: bool, **kw) -> Engine:
    base = dict(model=loaded.path, device="cpu", dtype="bfloat16", weights=loaded.weights, max_context=512,
                kv_chunk=32)
    base.update(kw)
    if split:
        return Engine(EngineConfig(**base, gpus="cpu,cpu"))
    return Engine(EngineConfig(**base), loaded=loaded)


def _prompt(loaded, messages: list[dict]) -> list[int]:
    return chat_prompt(loaded.tokenizer, messages)


def _replay(eng: Engine, cancel_first: bool = False) -> list[list[int]]:
    return [out for _, out, _ in replay(eng, SYSTEM, QUESTIONS, PARAMS, cancel_first)]


def _concurrent(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return concurrent(eng, prompts, PARAMS)


def test_split_engine_has_one_pool_over_two_stages(tiny_loaded) -> None:
    with _engine(tiny_loaded, True, parallel=2, kv_pool_tokens=256) as eng:
        pool = eng.pool
        assert isinstance(pool, SplitPool)
        assert [p.layer_range for p in pool.parts] == [range(0, 1), range(1, 2)]
        assert all(p.chunks is pool.chunks for p in pool.parts), "one chunk table per conversation"
        eng.complete(_prompt(tiny_loaded, [{"role": "user", "content": "Hi"}]), PARAMS)
        pool.check_invariants()
        assert eng.stats()["pool_bytes"] == sum(p.total_bytes() for p in pool.parts)


def test_concurrent_lanes_through_the_split_equal_one_device(tiny_loaded) -> None:
    prompts = [_prompt(tiny_loaded, [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": q[0]}]) for q in QUESTIONS]
    with _engine(tiny_loaded, False, parallel=3) as eng:
        want = _concurrent(eng, prompts)
    with _engine(tiny_loaded, True, parallel=3, kv_pool_tokens=512) as eng:
        got = _concurrent(eng, prompts)
    assert got == want


@pytest.mark.parametrize("cancel_first", [False, True])
def test_replay_with_parking_through_the_split_equals_one_device(tiny_loaded, cancel_first) -> None:
    kw = dict(parallel=1, kv_pool_tokens=512, conversation_cache_mib=64)
    with _engine(tiny_loaded, False, **kw) as eng:
        want = _replay(eng)
    with _engine(tiny_loaded, True, **kw) as eng:
        got = _replay(eng, cancel_first)
        stats = eng.stats()
    assert got == want
    assert stats["conversation_restores"] > 0 and stats["prefix_tokens_reused"] > 0


def test_session_files_cross_between_split_and_one_device(tiny_loaded, tmp_path) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
    ids = _prompt(tiny_loaded, msgs)
    with _engine(tiny_loaded, True, session_dir=str(tmp_path)) as eng:
        r1 = eng.complete(ids, PARAMS)
        eng.save_session(0, "split.strata")
    more = _prompt(tiny_loaded, msgs + [{"role": "assistant", "content": tiny_loaded.tokenizer.decode(r1.token_ids)},
                                        {"role": "user", "content": "And then?"}])
    with _engine(tiny_loaded, False, session_dir=str(tmp_path)) as eng:
        eng.restore_session(0, "split.strata")
        a = eng.complete(more, PARAMS)
        eng.save_session(0, "one.strata")
    with _engine(tiny_loaded, True, session_dir=str(tmp_path)) as eng:
        eng.restore_session(0, "one.strata")
        b = eng.complete(more, PARAMS)
    assert a.cached_tokens >= len(ids) - 1 and b.cached_tokens >= len(more) - 1
    assert a.token_ids == b.token_ids


def test_the_second_stage_k_v_is_used(tiny_loaded) -> None:
    """Negative control: zeroing the second stage's cells of a conversation changes its reply, so
    the equalities above compare outputs that depend on that stage's K/V."""
    ids = _prompt(tiny_loaded, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi?"}])
    with _engine(tiny_loaded, True) as eng:
        first = eng.complete(ids, PARAMS).token_ids
        again = eng.complete(ids, PARAMS)
        assert again.token_ids == first and again.cached_tokens > 0

        def wipe() -> None:
            part = eng.pool.parts[1]
            runs = part.export_range(0, 0, len(ids) - 1)
            part.import_range(0, 0, [{k: torch.zeros_like(t) for k, t in st.items()} for st in runs])

        eng.call(wipe).result()
        wiped = eng.complete(ids, PARAMS)
    assert wiped.cached_tokens > 0 and wiped.token_ids != first


def test_stage_plans_and_bad_flags() -> None:
    assert split_layers(32, [1.0, 1.0]) == [16, 16]
    assert split_layers(32, [3.0, 1.0]) == [24, 8]
    assert sum(split_layers(7, [1.0, 1.0, 1.0])) == 7 and min(split_layers(7, [100.0, 1.0, 1.0])) >= 1
    plan = plan_stages(4, parse_devices("cpu,cpu"), "3,1")
    assert plan.ranges == (range(0, 3), range(3, 4))
    for gpus, split, words in [("cpu,tpu", None, "tpu"), ("cpu,cpu", "2,3", "add up"),
                               ("cpu,cpu", "4", "names 1 stages"), ("cpu,cpu", "a,b", "layer counts")]:
        with pytest.raises(BadRequest, match=words):
            plan_stages(4, parse_devices(gpus), split)
    if not torch.cuda.is_available():
        with pytest.raises(BadRequest, match="CUDA is not available"):
            parse_devices("0,1")


def test_stage_figures_reach_metrics_and_state(tiny_loaded) -> None:
    from strata.serve.metrics import ServeMetrics

    with _engine(tiny_loaded, True, parallel=2, kv_pool_tokens=256) as eng:
        eng.complete(_prompt(tiny_loaded, [{"role": "user", "content": "Hi"}]), PARAMS)
        stages = eng.stats()["stages"]
        text = ServeMetrics(eng.stats).render().decode()
    assert [s["layers"] for s in stages] == [[0, 1], [1, 2]]
    assert 'strata_engine_stage_last_layer{kind="local",stage="1",where="cpu"} 1.0' in text
    assert f'strata_engine_stage_kv_bytes{{kind="local",stage="0",where="cpu"}} {float(stages[0]["kv_bytes"])}' in text
