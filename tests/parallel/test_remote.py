"""A remote stage over loopback: byte-identical to one process, and every fault answered.

The main keeps layers [0, L) and the head; a worker (`strata stage`, here a
thread or a child process) runs the rest. Parking and session files keep
every layer's K/V, the worker's part fetched over the link.
"""

from __future__ import annotations

import time

import pytest

from strata.engine.config import EngineConfig
from strata.engine.engine import Engine
from strata.engine.types import SamplingParams
from strata.errors import StageUnavailable, StrataError
from strata.parallel.link import connect
from strata.parallel.protocol import PROTOCOL, Hello, Refusal
from strata.parallel.split_pool import SplitPool
from tests.chat_replay import chat_prompt, concurrent, replay
from tests.parallel.conftest import KEY

SYSTEM = "You answer questions about a small town's library, briefly and kindly. " * 4
QUESTIONS = [["Books about rivers?", "The shortest one?"], ["Poetry shelf?", "Open Sundays?"],
             ["Renew online?", "How often?"]]
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def _config(model, **kw) -> EngineConfig:
    base = dict(model=str(model), device="cpu", dtype="bfloat16", weights="dense", max_context=512,
                kv_chunk=32, stage_timeout=20.0)
    base.update(kw)
    return EngineConfig(**base)


def _remote(model, key_file, address: str, split_at: int = 2, **kw) -> Engine:
    return Engine(_config(model, remote_stage=address, stage_key_file=str(key_file), split_at=split_at, **kw))


def _prompt(tok, messages: list[dict]) -> list[int]:
    return chat_prompt(tok, messages)


def _replay(eng: Engine) -> list[list[int]]:
    return [out for _, out, _ in replay(eng, SYSTEM, QUESTIONS, PARAMS)]


def _concurrent(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return concurrent(eng, prompts, PARAMS)


@pytest.fixture(scope="module")
def one_process(four_layers):
    """What one process answers: the replay with parking, and three concurrent prompts."""
    with Engine(_config(four_layers, parallel=1, kv_pool_tokens=512, conversation_cache_mib=64)) as eng:
        replay = _replay(eng)
        tok = eng.tokenizer
        prompts = [_prompt(tok, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q[0]}])
                   for q in QUESTIONS]
    with Engine(_config(four_layers, parallel=3)) as eng:
        concurrent = _concurrent(eng, prompts)
    return {"replay": replay, "prompts": prompts, "concurrent": concurrent}


def test_remote_stage_replay_with_parking_equals_one_process(four_layers, key_file, thread_worker,
                                                             one_process) -> None:
    w = thread_worker()
    with _remote(four_layers, key_file, w.address, parallel=1, kv_pool_tokens=512,
                 conversation_cache_mib=64) as eng:
        assert isinstance(eng.pool, SplitPool) and eng.pool.parts[1].layer_range == range(2, 4)
        got = _replay(eng)
        stats = eng.stats()
    assert got == one_process["replay"]
    assert stats["conversation_restores"] > 0 and stats["prefix_tokens_reused"] > 0
    stage = stats["stages"][1]
    assert stage["kind"] == "remote" and stage["steps"] > 0 and stage["bytes_sent"] > 0


def test_concurrent_lanes_through_a_remote_stage(four_layers, key_file, thread_worker, one_process) -> None:
    w = thread_worker()
    with _remote(four_layers, key_file, w.address, split_at=1, parallel=3, kv_pool_tokens=512) as eng:
        assert _concurrent(eng, one_process["prompts"]) == one_process["concurrent"]


def test_a_worker_streaming_its_k_v_equals_one_process(four_layers, key_file, thread_worker,
                                                       one_process) -> None:
    w = thread_worker(kv_resident=64)  # its own choice: K/V in host RAM, 64 cells a layer "on device"
    with _remote(four_layers, key_file, w.address, split_at=1, parallel=3, kv_pool_tokens=512) as eng:
        assert _concurrent(eng, one_process["prompts"]) == one_process["concurrent"]
        assert eng.stats()["stages"][1]["workers"][0]["kv_bytes"] > 0


def test_quantized_weights_through_a_remote_stage(four_layers, key_file, thread_worker, one_process) -> None:
    """The worker holds no embedding: its int8 layers still compute in the main's dtype."""
    with Engine(_config(four_layers, parallel=3, weights="int8")) as eng:
        want = _concurrent(eng, one_process["prompts"])
    w = thread_worker(weights="int8")
    with _remote(four_layers, key_file, w.address, parallel=3, weights="int8") as eng:
        assert _concurrent(eng, one_process["prompts"]) == want


def test_relay_of_three_processes_equals_one_process(four_layers, key_file, worker_process,
                                                     one_process) -> None:
    last = worker_process()
    relay = worker_process("--next", last.address, "--split-at", "3")
    with _remote(four_layers, key_file, relay.address, split_at=1, parallel=3, kv_pool_tokens=512) as eng:
        assert [s["layers"] for s in eng.stats()["stages"][1]["workers"]] == [[1, 3], [3, 4]]
        assert _concurrent(eng, one_process["prompts"]) == one_process["concurrent"]
    # the relay links its next worker again for the next main: a replaced next worker is found
    last.kill()
    again = worker_process(port=last.port)
    with _remote(four_layers, key_file, relay.address, split_at=1, parallel=3, kv_pool_tokens=512) as eng:
        assert _concurrent(eng, one_process["prompts"]) == one_process["concurrent"]
    assert again.wait_for("serving main", 5)


def test_session_file_saved_through_a_remote_stage_restores_in_one_process(four_layers, key_file,
                                                                           thread_worker, tmp_path) -> None:
    w = thread_worker()
    with _remote(four_layers, key_file, w.address, session_dir=str(tmp_path)) as eng:
        tok = eng.tokenizer
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
        r1 = eng.complete(_prompt(tok, msgs), PARAMS)
        eng.save_session(0, "remote.strata")
        more = _prompt(tok, msgs + [{"role": "assistant", "content": tok.decode(r1.token_ids)},
                                    {"role": "user", "content": "And then?"}])
    with Engine(_config(four_layers, session_dir=str(tmp_path))) as eng:
        eng.restore_session(0, "remote.strata")
        a = eng.complete(more, PARAMS)
        eng.save_session(0, "one.strata")
    with _remote(four_layers, key_file, w.address, session_dir=str(tmp_path)) as eng:
        eng.restore_session(0, "one.strata")
        b = eng.complete(more, PARAMS)
    assert a.cached_tokens > len(more) // 2 and b.cached_tokens >= len(more) - 1
    assert a.token_ids == b.token_ids


def test_wrong_key_other_protocol_and_other_model_are_refused(four_layers, tiny_model_dir, key_file,
                                                              thread_worker, tmp_path) -> None:
    w = thread_worker()
    bad = tmp_path / "bad.key"
    bad.write_text("not-the-right-key-at-all")
    with pytest.raises(StrataError, match="key"):
        _remote(four_layers, bad, w.address)
    link = connect("127.0.0.1", int(w.address.rsplit(":", 1)[1]), KEY.encode(), 10.0)
    try:
        link.send(Hello(99, "x", 2, "bf16", 1, 512, 32, None, "bfloat16", 64, 0, False))
        reply = link.recv(10)
    finally:
        link.close()
    assert isinstance(reply, Refusal) and "protocol 99" in reply.reason and str(PROTOCOL) in reply.reason
    other = thread_worker(model=tiny_model_dir)  # two layers of other weights
    with pytest.raises(StrataError, match="other model"):
        _remote(four_layers, key_file, other.address, split_at=1)
    with _remote(four_layers, key_file, w.address) as eng:  # the worker still serves a good main
        assert eng.complete([1, 2, 3], PARAMS).completion_tokens == PARAMS.max_tokens


def test_a_second_main_is_refused_while_the_first_is_served(four_layers, key_file, thread_worker) -> None:
    w = thread_worker()
    with _remote(four_layers, key_file, w.address) as first:
        with pytest.raises(StrataError, match="already serves a main"):
            _remote(four_layers, key_file, w.address)
        assert first.complete([5, 6, 7], PARAMS).completion_tokens == PARAMS.max_tokens


def test_worker_killed_mid_decode_gives_503_then_recovers(four_layers, key_file, worker_process,
                                                         one_process) -> None:
    w = worker_process()
    prompt = one_process["prompts"][0]
    with _remote(four_layers, key_file, w.address, parallel=3, kv_pool_tokens=512) as eng:
        assert eng.complete(prompt, PARAMS).token_ids == one_process["concurrent"][0]
        handle = eng.generate(prompt, SamplingParams(max_tokens=400, ignore_eos=True))
        it = iter(handle)
        next(it)
        w.kill()
        with pytest.raises(StageUnavailable):
            for _ in it:
                pass
        with pytest.raises(StageUnavailable):  # no worker: refused at once, nothing hangs
            eng.complete(prompt, PARAMS)
        worker_process(port=w.port)  # restarted: its pool is empty
        r = eng.complete(prompt, PARAMS)
        assert r.cached_tokens == 0, "nothing cached before the restart may be reused"
        assert r.token_ids == one_process["concurrent"][0]
        assert eng.stats()["stages"][1]["connects"] == 2


def test_killed_main_frees_the_worker_for_the_next(four_layers, key_file, worker_process) -> None:
    import subprocess
    import sys

    w = worker_process()
    script = ("from strata.engine.config import EngineConfig; from strata.engine.engine import Engine; "
              f"e = Engine(EngineConfig(model={str(four_layers)!r}, device='cpu', dtype='bfloat16', "
              f"weights='dense', max_context=512, kv_chunk=32, remote_stage={w.address!r}, "
              f"stage_key_file={str(key_file)!r}, split_at=2)); print('up', flush=True); "
              "import time; time.sleep(60)")
    main = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert main.stdout is not None and main.stdout.readline().strip() == "up"
        main.kill()
        main.wait(10)
    finally:
        if main.poll() is None:
            main.kill()
    w.wait_for("gone", 20)
    t0 = time.monotonic()
    with _remote(four_layers, key_file, w.address) as eng:
        assert eng.complete([1, 2, 3], PARAMS).completion_tokens == PARAMS.max_tokens
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("cancel_first", [False, True])
def test_prompt_cache_repeated_turns_resume_byte_identical(four_layers, key_file, thread_worker,
                                                          one_process, cancel_first) -> None:
    """Seed 003's check: every request sent twice; the repeat resumes through the kept parts
    (the worker's under ids) and equals the first, which equals one process."""
    w = thread_worker()
    tok = None
    with _remote(four_layers, key_file, w.address, parallel=1, kv_pool_tokens=512, prompt_cache=4) as eng:
        tok = eng.tokenizer
        chats = [[{"role": "system", "content": SYSTEM}] for _ in QUESTIONS]
        firsts, repeats, cached = [], [], []
        for turn in range(2):
            for c, qs in enumerate(QUESTIONS):
                chats[c].append({"role": "user", "content": qs[turn]})
                ids = _prompt(tok, chats[c])
                if cancel_first:
                    h = eng.generate(ids, PARAMS)
                    next(iter(h))
                    h.cancel()
                    h.result()
                a = eng.complete(ids, PARAMS)
                eng.complete(_prompt(tok, [{"role": "user", "content": f"unrelated {turn} {c}"}]), PARAMS)
                b = eng.complete(ids, PARAMS)  # the lane held something else: restored from the cache
                firsts.append(a.token_ids)
                repeats.append(b.token_ids)
                cached.append(b.cached_tokens)
                chats[c].append({"role": "assistant", "content": tok.decode(a.token_ids)})
        stats = eng.stats()
    assert repeats == firsts == one_process["replay"]
    assert all(n >= 50 for n in cached), cached
    assert stats["conversation_restores"] >= len(firsts) and stats["restore_misses"] == 0
    assert len(w.parts_held()) == 0, "the main went: the worker dropped what it kept"


def test_prompt_cache_moves_ids_not_bytes(four_layers, key_file, thread_worker) -> None:
    w = thread_worker()
    moved = {}
    for pc in (0, 4):
        extra = dict(prompt_cache=pc) if pc else dict(conversation_cache_mib=64)
        with _remote(four_layers, key_file, w.address, parallel=1, kv_pool_tokens=512, **extra) as eng:
            _replay(eng)
            moved[pc] = eng.stats()["stages"][1]["bytes_received"]
            held = len(w.parts_held())
        assert (held > 0) == (pc > 0)
    assert moved[4] < moved[0] / 2, moved


def test_a_part_the_worker_lost_makes_the_request_read_from_zero(four_layers, key_file, thread_worker,
                                                                  one_process, tmp_path) -> None:
    w = thread_worker()
    with _remote(four_layers, key_file, w.address, parallel=1, kv_pool_tokens=512, prompt_cache=4,
                 session_dir=str(tmp_path)) as eng:
        tok = eng.tokenizer
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0][0]}]
        ids = _prompt(tok, msgs)
        first = eng.complete(ids, PARAMS)
        eng.complete(_prompt(tok, [{"role": "user", "content": "something else"}]), PARAMS)
        parked = eng.parked()
        assert len(parked) == 1
        eng.save_parked_session(parked[0]["id"], "parked.strata")  # every layer, fetched
        eng.call(lambda: eng.runner.stages[1].forget([])).result()  # the worker's store emptied
        again = eng.complete(ids, PARAMS)
        stats = eng.stats()
    assert stats["restore_misses"] == 1 and again.cached_tokens == 0
    assert again.token_ids == first.token_ids == one_process["concurrent"][0]
    with Engine(_config(four_layers, session_dir=str(tmp_path))) as eng:
        eng.restore_session(0, "parked.strata")
        r = eng.complete(ids, PARAMS)
    assert r.cached_tokens >= len(ids) - 1 and r.token_ids == first.token_ids


def test_kept_part_limits_at_the_hello(four_layers, key_file, thread_worker) -> None:
    from strata.parallel.worker import MAX_KEPT, keep_limit_error

    assert keep_limit_error(0, 10**12, None) is None
    assert "at most" in keep_limit_error(MAX_KEPT + 1, 1, 10**12)
    assert "half" in keep_limit_error(4, 2**30, 6 * 2**30)
    assert keep_limit_error(4, 2**30, 9 * 2**30) is None
    assert "cannot read" in keep_limit_error(1, 1, None)
    w = thread_worker()
    with pytest.raises(StrataError, match="at most"):
        _remote(four_layers, key_file, w.address, prompt_cache=MAX_KEPT)
